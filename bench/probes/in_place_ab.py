"""Public calls with the rows path's in-place verdict as rows_path decides it and with
the in-place GEMMs off, alternating in one process (what a change of the verdict buys
a user, measured on the same machine).

    PYTHONPATH=src python3 bench/probes/in_place_ab.py [--rounds 3]
"""

from __future__ import annotations

import argparse

import torch

from gemmconv.bench.call_timing import api_times
from gemmconv.core.problem import ConvProblem, Direction
from gemmconv.selection import calibrate, dispatch
from gemmconv.solvers.patch import rows_path

# (name, n, c, k, size, patch, direction): the suite's rows whose verdict is near or
# past the line.
CASES = [
    ("dit_xl2", 256, 4, 1152, 32, 2, Direction.BACKWARD_WEIGHTS),
    ("vit_b16", 256, 3, 768, 224, 16, Direction.BACKWARD_WEIGHTS),
    ("vit_b16", 256, 3, 768, 224, 16, Direction.BACKWARD_DATA),
    ("vit_b16", 256, 3, 768, 224, 16, Direction.FORWARD),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    decide = rows_path.in_place_is_cheaper
    # The verdicts below read the device's rates: calibrated first, as the first call's
    # dispatch would (before it, a GPU the table does not know takes the nearest entry).
    calibrate.prepare("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    for name, n, c, k, size, patch, direction in CASES:
        p = ConvProblem.from_sizes(
            n, c, k, (size, size), patch, patch, dtype=torch.bfloat16, device_type="cuda"
        ).with_direction(direction)
        verdict = rows_path.in_place(p)
        for r in range(args.rounds):
            for label, rule in (("as decided", decide), ("off", lambda p, rates: False)):
                rows_path.in_place_is_cheaper = rule
                dispatch.clear_cache()  # plans are prepared afresh under the rule
                t = api_times(p, "cuda", seed=r)
                print(
                    f"{name} cf {direction.value} in_place={verdict} round {r} {label}: "
                    f"gemmconv {t['api_ms']:.4f} ms, torch {t['vendor_api_ms']:.4f}, "
                    f"linear {t['linear_api_ms']:.4f}",
                    flush=True,
                )
        rows_path.in_place_is_cheaper = decide


if __name__ == "__main__":
    main()
