"""A quick look at three suite problems on the GPU: every applicable solver, per direction.

Used while developing, before the full bench suite: each solver measured as find
measures it (gemmconv.measuring.measure: verified against float64 and the vendor, then its call
time back to back and its device time), beside its cost estimate.
"""

from __future__ import annotations

import sys

import torch

from gemmconv import ConvProblem, Direction, Layout
from gemmconv.measuring import measure
from gemmconv.solvers import SOLVERS


def main() -> int:
    cases = [
        ("point2d", dict(n=9500, c=3, k=1280, spatial=(14, 14), kernel=14, stride=14)),
        ("vit_b16", dict(n=256, c=3, k=768, spatial=(224, 224), kernel=16, stride=16)),
        ("resnet_1x1", dict(n=256, c=256, k=64, spatial=(56, 56), kernel=1, stride=1)),
    ]
    for name, sizes in cases:
        for layout in Layout:
            for direction in Direction:
                p = ConvProblem.from_sizes(
                    **sizes, layout=layout, dtype=torch.bfloat16, device_type="cuda",
                    direction=direction,
                )  # fmt: skip
                applicable = [s for s in SOLVERS if s.is_applicable(p)]
                for m in measure.measure_solvers(p, applicable, verify=True):
                    label = f"{name:11s} {layout.value:14s} {direction.value:16s} {m.solver:18s}"
                    if not m.ok:
                        print(f"{label} SKIPPED {m.skipped}", flush=True)
                        continue
                    estimate = next(s for s in applicable if s.id == m.solver).estimate_ms(p)
                    print(
                        f"{label} call {m.call_ms:8.4f} ms device {m.device_ms:8.4f} ms "
                        f"est {estimate:8.4f}  {m.verdict}",
                        flush=True,
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
