#!/usr/bin/env bash
# The GPU checks and benchmarks, in stages of at most 10 minutes each, every result
# written under $OUT as it finishes (a timeout keeps the rest). Run from the
# repository root on the GPU machine:
#   bash bench/probes/gpu_stages.sh tests [FILE..]  # the GPU tests, all or those files
#   bash bench/probes/gpu_stages.sh probe     # launch cost, CUDA-graph step, host profiles of rows
#   bash bench/probes/gpu_stages.sh compiled  # the compiled training step, split by kernel
#   bash bench/probes/gpu_stages.sh suite     # the suite (about 3 min of rows)
#   bash bench/probes/gpu_stages.sh fp8       # fp8 GPU tests, the fp8 probe
#   bash bench/probes/gpu_stages.sh fp8-scale # the fp8 scale kernel: its tests, its A/B
#   bash bench/probes/gpu_stages.sh invariance  # batch-invariance GPU tests, the chunk budgets
#   bash bench/probes/gpu_stages.sh tiles     # the implicit GEMMs per tile, invariance's cost
#   bash bench/probes/gpu_stages.sh boxed     # the rows forward on TMA boxes: its tests
#   bash bench/probes/gpu_stages.sh models    # the end-to-end table (about 3 min)
#   bash bench/probes/gpu_stages.sh gap       # backward-data public calls against call times
#   bash bench/probes/gpu_stages.sh rows      # the rows path's in-place GEMM: tests, device time
#   bash bench/probes/gpu_stages.sh suite-in-place  # the suite with that GEMM switched on
#   bash bench/probes/gpu_stages.sh precision # the GEMMs with cuBLAS's half-precision reductions on/off
#   bash bench/probes/gpu_stages.sh node      # point 2D's public backward calls per solver, profiled
#   bash bench/probes/gpu_stages.sh find-gap  # find's trials against the call it decides
#   OLD_TREE=old bash bench/probes/gpu_stages.sh ab   # order vs machine, below
set -u
: "${OUT:?set OUT to the folder for the results}"
export PYTHONPATH=src
stage=${1:?stage: tests, probe, compiled, suite, fp8, fp8-scale, invariance, tiles, boxed, suite-in-place, models, gap, rows, precision, node, find-gap or ab}
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
# A copied tree can report an older HEAD than the files it holds (an H200's copy
# reported 6ce0d30 while holding 22a735c's files): a digest of src/'s Python files says
# which code ran (the same command in a checkout gives that commit's). The files are
# sorted bytewise: a locale's collation orders them otherwise, and a GPU machine's
# digest matched no checkout's.
code=$(find src -name '*.py' | LC_ALL=C sort | xargs sha1sum | sha1sum | cut -c1-12)
echo "$stage at $commit (src digest $code), $(date -u +%FT%TZ)" >>"$OUT/stages.log"
case $stage in
tests)
    # The whole log, with a line per failure or error at its end: a log cut to its tail
    # once lost which tests had run (bench/NOTES.md, the run at 316a61b). All of them
    # took about 12 minutes on an H100 at ec300f0, more than one stage's 10: give files
    # to split them (three runs at ec300f0, four on the H200 at b9cd4c7).
    # tests/api/test_properties.py's GPU test takes 85 s on an H100 with its 40 examples;
    # tests/cli/test_cli.py's tunes every suite row and wants a run of its own.
    shift
    python3 -m pytest -q -rfE -p no:cacheprovider -m gpu "${@:-tests}" >"$OUT/gpu_tests.log" 2>&1
    echo "pytest exit $?" >>"$OUT/gpu_tests.log"
    ;;
probe)
    timeout 120 python3 bench/probes/launch_cost.py >"$OUT/launch_cost.txt" 2>&1
    timeout 240 python3 bench/probes/compiled_step_probe.py vit_b16_infer_b8_cudagraphs \
        >"$OUT/compiled_step_probe.txt" 2>&1
    for row in "point3d cf fwd" "point3d cf fwd_wgrad" "vit_b16 cf fwd" "vit_b16 cf bwd_weights" \
        "resnet_1x1 cf fwd" "convnext_down cl bwd_data"; do
        set -- $row
        # One file for all rows, to keep $OUT to a few files.
        echo "== $row" >>"$OUT/host_profiles.txt"
        timeout 120 python3 bench/probes/host_profile.py "$1" --layout "$2" --kind "$3" --top 30 \
            >>"$OUT/host_profiles.txt" 2>&1
    done
    ;;
compiled)
    # The compiled training step's gap to the rewrite: two variants, each compiling
    # ViT-B/16's training step.
    timeout 500 python3 bench/probes/compiled_step_probe.py vit_b16_train_b256_compiled \
        --variants converted_channels_last linear --steps 10 --profiled 3 \
        >"$OUT/compiled_train_probe.txt" 2>&1
    ;;
suite)
    # 110 s of rows left 9 of 66 unrun on a slow host (the run at 316a61b); 140 ran all,
    # and 99 s did on an H100 at 1e09e80. The kernel counts (one profiled call a row)
    # follow the timed rows, outside the budget: rows and counts took 127 s on an H100
    # at f8a6778 with a budget of 125. With the four new cases, find's and the
    # invariance columns, 90 rows took 156 s on an H100 at f0db2a3, the fp8 rows after.
    python3 -m gemmconv bench --out "$OUT/suite" --time-budget 210 --no-plot >"$OUT/suite.log" 2>&1
    ;;
fp8)
    # The fp8 GPU tests took 35 s with -n 12 on an H100 at f0db2a3, with the
    # invariance ones; the probe (timings and three 300-step ViT-S/16 runs) about 2.5
    # min before its compiled variants (eight compiles) and a fourth run were added.
    python3 -m pytest -q -rfE -p no:cacheprovider -m gpu -n 12 tests/api/test_fp8.py \
        tests/bench/test_fp8_rows.py >"$OUT/fp8_tests.log" 2>&1
    echo "pytest exit $?" >>"$OUT/fp8_tests.log"
    timeout 480 python3 bench/probes/fp8_embeds.py --out "$OUT/fp8" >/dev/null 2>>"$OUT/fp8_tests.log"
    ;;
fp8-scale)
    # What the fp8 scale kernel lands on: its GPU tests and the fp8 runs' (bytes equal to
    # torch's calls; 105 s for these with the kernel tests on an H100), then the fp8 rows
    # with the kernel and with torch's calls in one run.
    timeout 240 python3 -m pytest -q -rfE -p no:cacheprovider -m gpu -n 12 \
        tests/kernels/test_amax_scale.py tests/solvers/test_float8_casts.py \
        tests/api/test_fp8.py >"$OUT/fp8_scale_tests.log" 2>&1
    echo "pytest exit $?" >>"$OUT/fp8_scale_tests.log"
    timeout 90 python3 bench/probes/fp8_scale_ab.py --out "$OUT/fp8_scale_ab.jsonl" \
        >"$OUT/fp8_scale_ab.txt" 2>&1
    ;;
invariance)
    # The batch-invariance GPU tests, then each candidate chunk budget of CUDA's
    # invariant GEMM over the suite's forward rows (solvers/invariant.CUDA_CHUNK_MACS).
    python3 -m pytest -q -rfE -p no:cacheprovider -m gpu -n 12 \
        tests/solvers/test_gpu_batch_invariance.py >"$OUT/invariance_tests.log" 2>&1
    echo "pytest exit $?" >>"$OUT/invariance_tests.log"
    timeout "${CHUNK_SECONDS:-300}" python3 bench/probes/invariant_chunk_cost.py \
        --budgets "${BUDGETS:-32,33}" --out "$OUT/invariant_chunk_cost.jsonl" \
        >"$OUT/invariant_chunk_cost.txt" 2>&1
    ;;
tiles)
    # The implicit forward per tile configuration with each kernel's load widths (about
    # 4 min for the suite's bf16 patch rows on an H100 at e1278fd), then the forward
    # rows' invariance cost under the tiles the library picks (kernels/patch_gemm.py's
    # forward_tiles).
    timeout 330 python3 bench/probes/implicit_tiles.py --directions fwd \
        --out "$OUT/implicit_tiles.jsonl" >"$OUT/implicit_tiles.txt" 2>&1
    timeout 200 python3 bench/probes/invariant_chunk_cost.py --budgets 32 \
        --out "$OUT/invariant_cost.jsonl" >"$OUT/invariant_cost.txt" 2>&1
    ;;
boxed)
    # The whole-sample rows forward on TMA boxes (kernels/boxed_rows_gemm.py): its GPU
    # tests.
    timeout 150 python3 -m pytest -q -rfE -p no:cacheprovider -m gpu \
        tests/kernels/test_boxed_rows_gemm.py >"$OUT/boxed_tests.log" 2>&1
    echo "pytest exit $?" >>"$OUT/boxed_tests.log"
    ;;
suite-in-place)
    # The suite with the rows path's in-place GEMMs on in every direction and size in
    # this process only (rows_path.in_place_is_cheaper and its limits): what widening
    # them in the code would change, measured before it is done.
    python3 - --out "$OUT/suite_in_place" --time-budget 160 >"$OUT/suite_in_place.log" 2>&1 <<'PY'
import runpy
import sys

from gemmconv.solvers.patch import rows_path

rows_path.in_place_is_cheaper = lambda p, rates: True
rows_path.IN_PLACE_MIN_ROWS = rows_path.IN_PLACE_MIN_RUN_BYTES = 0
sys.argv = ["gemmconv", "bench", *sys.argv[1:]]
runpy.run_module("gemmconv", run_name="__main__", alter_sys=True)
PY
    ;;
models)
    # A budget of 230 s ran all ten scenarios at 316a61b; each timed step has had an
    # untimed one before it since (bench_models.py), about 40 s more of steps.
    python3 -m gemmconv bench --models --out "$OUT/e2e" --time-budget 280 >"$OUT/e2e.log" 2>&1
    ;;
gap)
    # Public backward-data calls ran 60-220 us over their solver's call time (what find
    # ranks by) in the suites at b9cd4c7 and 69f90e9 (bench/NOTES.md): wall, host issue
    # and device time of each, with point 2D on both solvers find weighed there. One
    # file, to keep $OUT to a few files. At 91437bd on an H100 the node's own host
    # time was 78-118 us where the same run
    # issued from the main thread took 101 in all: the rows run again with the
    # backward on the calling thread and the ops' host times listed.
    for row in "point2d cl bwd_data" "vit_b16 cf bwd_data" "dit_xl2 cl bwd_data" \
        "dit_xl2 cl bwd_weights" "sam_vit_h cf bwd_data" "convnext_down cf bwd_weights"; do
        set -- $row
        echo "== $row" >>"$OUT/backward_gap.txt"
        timeout 120 python3 bench/probes/host_profile.py "$1" --layout "$2" --kind "$3" --top 0 \
            --kernels --host-ops 14 --calling-thread >>"$OUT/backward_gap.txt" 2>&1
    done
    for solver in patch_triton point_output; do
        for layout in cl cf; do
            echo "== point2d $layout bwd_data, GEMMCONV_SOLVER=$solver" >>"$OUT/backward_gap.txt"
            GEMMCONV_SOLVER=$solver timeout 120 python3 bench/probes/host_profile.py point2d \
                --layout $layout --kind bwd_data --top 30 --kernels >>"$OUT/backward_gap.txt" 2>&1
        done
    done
    ;;
rows)
    # The GEMMs that write a channels-first y or read dY in place
    # (kernels/pixel_rows_gemm.py: forward, backward-data, weight gradient) ran only in
    # Triton's interpreter when they landed; CUDA runs them where rows_path.in_place
    # says (solvers/patch/rows_path.py): their GPU tests (the
    # kernels with pixel runs of 1 to 8 elements, the rows path and dW from kept
    # columns with the switch either way), then their device time against cuBLAS and
    # the transpose per tile configuration.
    python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/kernels/test_pixel_rows_gemm.py \
        tests/kernels/test_triton_kernels.py tests/solvers/test_prepared_run.py \
        -k "pixel_rows or rows_path or rows_into or into_rows or forwards_columns" \
        >"$OUT/rows_tests.log" 2>&1
    echo "pytest exit $?" >>"$OUT/rows_tests.log"
    timeout 240 python3 bench/probes/pixel_rows_bench.py >"$OUT/pixel_rows.txt" 2>&1
    ;;
precision)
    # The Qwen2-VL patch embed stayed 3-6% behind the rewrite, whose GEMMs are the same
    # but may sum in half precision; on an H100 the flag changed none of the embed's
    # kernels (bench/results/reduction_flag_h100.txt).
    timeout 200 python3 bench/probes/reduction_flag_probe.py >"$OUT/reduction_flag.txt" 2>&1
    ;;
node)
    # Point 2D's public backward calls ran 1.5-2.6x their solver's call time on an H200
    # for every solver but point_output (bench/results/point2d_public_h200.txt, at
    # 22a735c): each solver forced, on the engine's thread and on the calling thread
    # (--calling-thread times both in one process), with the kernels and the host's
    # ops listed. One file, to keep $OUT to a few files.
    for solver in point_output patch_padded patch_implicit; do
        for kind in bwd_data bwd_weights; do
            echo "== point2d cf $kind, GEMMCONV_SOLVER=$solver" >>"$OUT/node_gap.txt"
            GEMMCONV_SOLVER=$solver timeout 90 python3 bench/probes/host_profile.py point2d \
                --layout cf --kind $kind --top 20 --kernels --host-ops 14 --calling-thread \
                --reps 9 --calls 100 >>"$OUT/node_gap.txt" 2>&1
        done
    done
    ;;
find-gap)
    # Rows whose find-mode call ran 1.16-1.31x immediate mode's, or whose public
    # backward-data call ran far above its prepared run from a node (H100 at a17f7c4):
    # each candidate's trial, the decided call and immediate's, timed with their
    # kernels and find's log. A budget that leaves the boxed stage room in one call.
    timeout 250 python3 bench/probes/find_trial_gap.py --out "$OUT/find_trial_gap.jsonl" \
        >"$OUT/find_trial_gap.txt" 2>&1
    ;;
ab)
    # Whether the suite's backward calls moved with the machine or with the order of
    # the interleaved calls: the same rows, alternating processes, in the shuffled
    # order, in the old rotation (--rotated) and, where $OLD_TREE holds an older
    # checkout (its src/ and its probes, under bench/probes/ or, before they moved
    # there, scripts/), from that code, which rotates. About 15 s a
    # process (imports, Triton compiling); $AB_ROUNDS rounds, one by default.
    for ((round = 1; round <= ${AB_ROUNDS:-1}; round++)); do
        for row in "vit_b16 cf bwd_weights" "videomae cf bwd_data" "point2d cl bwd_weights"; do
            set -- $row
            args=("$1" --layout "$2" --kind "$3" --top 0)
            timeout 100 python3 bench/probes/host_profile.py "${args[@]}" >>"$OUT/ab_shuffled.txt" 2>&1
            timeout 100 python3 bench/probes/host_profile.py "${args[@]}" --rotated \
                >>"$OUT/ab_rotated.txt" 2>&1
            if [ -n "${OLD_TREE:-}" ]; then
                probe=bench/probes/host_profile.py
                [ -f "$OLD_TREE/$probe" ] || probe=scripts/host_profile.py
                (cd "$OLD_TREE" && PYTHONPATH=src timeout 100 python3 "$probe" \
                    "${args[@]}") >>"$OUT/ab_old_tree.txt" 2>&1
            fi
        done
    done
    ;;
*)
    echo "stage=$stage: expected tests, probe, compiled, suite, fp8, fp8-scale, invariance, tiles, boxed, suite-in-place, models, gap," \
        "rows, precision, node, find-gap or ab" >&2
    exit 2
    ;;
esac
echo "$stage done, $(date -u +%FT%TZ)" >>"$OUT/stages.log"
