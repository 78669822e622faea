"""A quick look at the headline case on the GPU: each applicable solver vs vendor, per direction.

Used while developing, before the full bench suite: prints the median time (CUDA events,
L2 flushed) of every applicable solver and its verification verdict.
"""

from __future__ import annotations

import sys

import torch

from gemmconv import ConvProblem, ConvTensors, Direction, Layout
from gemmconv.solvers import SOLVERS
from gemmconv.timing import time_ms
from gemmconv.verify import verify


def main() -> int:
    dtype = torch.bfloat16
    cases = [
        ("point2d", dict(n=9500, c=3, k=1280, spatial=(14, 14), kernel=14, stride=14)),
        ("vit_b16", dict(n=256, c=3, k=768, spatial=(224, 224), kernel=16, stride=16)),
        ("resnet_1x1", dict(n=256, c=256, k=64, spatial=(56, 56), kernel=1, stride=1)),
    ]
    for name, sizes in cases:
        for layout in Layout:
            for direction in Direction:
                p = ConvProblem.from_sizes(
                    **sizes, layout=layout, dtype=dtype, device_type="cuda", direction=direction
                )
                g = torch.Generator(device="cuda").manual_seed(0)

                def rand(shape, lay=layout):
                    t = torch.rand(shape, device="cuda", generator=g, dtype=torch.float32)
                    t = (t * 2 - 1).to(dtype)
                    if lay is Layout.CHANNELS_LAST:
                        t = t.contiguous(memory_format=torch.channels_last)
                    return t

                t = ConvTensors(
                    input=rand(p.input_shape),
                    weight=rand(p.weight_shape),
                    grad_output=rand(p.output_shape),
                )
                for s in SOLVERS:
                    if s.not_supported_reasons(p):
                        continue
                    try:
                        tm = time_ms(lambda s=s: s.run(p, t), device="cuda", reps=20)
                        v = verify(p, t, s.run(p, t), compare_vendor=False)
                        print(
                            f"{name:11s} {layout.value:14s} {direction.value:16s} {s.id:18s}"
                            f" {tm.median_ms:8.4f} ms est {s.estimate_ms(p):8.4f}  {v}",
                            flush=True,
                        )
                    except Exception as e:  # noqa: BLE001 - a probe reports and goes on
                        print(f"{name} {layout.value} {direction.value} {s.id} ERROR {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
