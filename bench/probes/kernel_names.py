"""The kernels one public call launches, by name, for suite rows (what the suite's
``api_kernels`` counts; gemmconv.bench.kernel_count). Used to find the launch a row over the
three-launch target can drop.

    PYTHONPATH=src python bench/probes/kernel_names.py clip_l14_336/cf/fwd vit_b16/cf/bwd_data
"""

from __future__ import annotations

import argparse

import torch

from gemmconv.bench.call_timing import public_call_kernels
from gemmconv.bench.suite import DIRECTION_NAMES, DTYPES, LAYOUT_NAMES, SUITE, make_problem


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rows", nargs="+", help="case/layout/direction, e.g. vit_b16/cf/fwd")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    args = parser.parse_args()
    cases = {case.name: case for case in SUITE}
    device = torch.device("cuda")
    for row in args.rows:
        name, layout, direction = row.split("/")
        p = make_problem(cases[name].full, LAYOUT_NAMES[layout], DTYPES[args.dtype], device,
                         DIRECTION_NAMES[direction])  # fmt: skip
        names = public_call_kernels(p, device)
        print(f"== {row}/{args.dtype}: {'not counted' if names is None else len(names)}")
        for kernel in names or ():
            print(f"   {kernel[:160]}")


if __name__ == "__main__":
    main()
