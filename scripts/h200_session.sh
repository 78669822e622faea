#!/usr/bin/env bash
# One GPU session's checks and benchmarks, in stages that each fit the device tool's
# 10-minute call, every result written under $OUT as it finishes (a timeout keeps the
# rest). Run from the repository root on the GPU machine:
#   bash scripts/h200_session.sh tests     # the GPU tests (about 4 min)
#   bash scripts/h200_session.sh probe     # a Triton launch's host cost, host profiles of rows
#   bash scripts/h200_session.sh suite     # the suite (about 3 min of rows)
#   bash scripts/h200_session.sh models    # the end-to-end table (about 3 min)
set -u
: "${OUT:?set OUT to the folder for the results}"
export PYTHONPATH=src
stage=${1:?stage: tests, probe, suite or models}
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
echo "$stage at $commit, $(date -u +%FT%TZ)" >>"$OUT/session.log"
case $stage in
tests)
    python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tail -60 >"$OUT/gpu_tests.log"
    ;;
probe)
    timeout 120 python3 scripts/launch_cost.py >"$OUT/launch_cost.txt" 2>&1
    for row in "point3d cf fwd" "point3d cf fwd_wgrad" "vit_b16 cf fwd" "vit_b16 cf bwd_weights" \
        "resnet_1x1 cf fwd" "convnext_down cl bwd_data"; do
        set -- $row
        timeout 120 python3 scripts/host_profile.py "$1" --layout "$2" --kind "$3" --top 30 \
            >"$OUT/profile_$1_$2_$3.txt" 2>&1
    done
    ;;
suite)
    # 110 s of rows left 9 of 66 unrun on a slow host (the run at 316a61b); 140 ran all.
    python3 -m gemmconv bench --out "$OUT/suite" --time-budget 160 >"$OUT/suite.log" 2>&1
    ;;
models)
    python3 -m gemmconv bench --models --out "$OUT/e2e" --time-budget 300 >"$OUT/e2e.log" 2>&1
    ;;
*)
    echo "stage=$stage: expected tests, probe, suite or models" >&2
    exit 2
    ;;
esac
echo "$stage done, $(date -u +%FT%TZ)" >>"$OUT/session.log"
