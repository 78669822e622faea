"""The fp8 run's operand casts on a GPU: Triton copies against torch's strided multiply.

Per embed (Qwen2-VL's Conv3d at 8192 patches, ViT-B/16 at batch 256; bf16, both input
layouts) and per operand (cols [M, ld], cols^T [ld, M'], dY rows [M, K], dY^T [K, M']):
the device time of the cast through each path (CUDA events, median of ``--reps``
after warm-up) and whether the two give the same fp8 bytes. One JSON line per row.

    PYTHONPATH=src python3 bench/probes/fp8_casts.py [--reps 50]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import gemmconv
from gemmconv.core.problem import ConvProblem
from gemmconv.solvers import float8

# name -> (conv class, in_channels, out_channels, kernel, input spatial, batch)
EMBEDS = {
    "qwen2vl": (torch.nn.Conv3d, 3, 1280, (2, 14, 14), (2, 14, 14), 8192),
    "vit_b16": (torch.nn.Conv2d, 3, 768, (16, 16), (224, 224), 256),
}


def _device_us(call, reps: int) -> float:
    for _ in range(3):
        call()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def rows(name: str, layout: str, reps: int):
    cls, c, k, kernel, spatial, n = EMBEDS[name]
    x = torch.randn(n, c, *spatial, device="cuda", dtype=torch.bfloat16)
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
    w = torch.randn(k, c, *kernel, device="cuda", dtype=torch.bfloat16)
    y = cls(c, k, kernel, stride=kernel, bias=False).to("cuda", torch.bfloat16)(x)
    dy = torch.randn_like(y)
    run = float8.Float8Run(ConvProblem.from_tensors(x, w, None, kernel), gemmconv.Float8Config())
    fp8 = run.config.forward_dtype
    source = run._patches(x, run.geometry.x_order_last)
    sx, _ = run._scale(source, fp8, None)
    sdy, _ = run._scale(dy, run.config.grad_dtype, None)
    operands = {
        "cols": lambda: run._columns(x, source, sx, fp8, False),
        "cols^T": lambda: run._columns(x, source, sx, fp8, True),
        "dY rows": lambda: run._gradient(dy, sdy, False),
        "dY^T": lambda: run._gradient(dy, sdy, True),
    }
    decide = float8.kernel_casts
    for operand, call in operands.items():
        float8.kernel_casts = decide
        kernel_us, by_kernel = _device_us(call, reps), call()
        float8.kernel_casts = lambda *args: False
        torch_us, by_torch = _device_us(call, reps), call()
        float8.kernel_casts = decide
        same = by_kernel.shape == by_torch.shape and torch.equal(
            by_kernel.view(torch.uint8), by_torch.view(torch.uint8)
        )
        yield {
            "embed": name, "layout": layout, "operand": operand,
            "shape": list(by_kernel.shape), "kernel_us": round(kernel_us, 1),
            "torch_us": round(torch_us, 1), "same_bytes": same,
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args(argv)
    for name in EMBEDS:
        for layout in ("channels_first", "channels_last"):
            for row in rows(name, layout, args.reps):
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
