"""The fp8 scale kernel's effect on what users pay (a diagnostic).

The suite's fp8 rows (gemmconv.bench.fp8_rows: Qwen2-VL's embed at 8192 patches,
ViT-B/16 at batch 256, the module called as a training step) timed in one interleaved
run with the tensorwise scales from kernels/amax_scale.py ("scale kernel") and from
torch's four calls ("torch scale": kernels.amax_scale.dense_flat made to refuse every
tensor, which is the path a non-dense tensor takes), beside gemmconv's bf16. One JSON
line per case, printed and, with ``--out FILE``, appended to FILE.

    PYTHONPATH=src python3 bench/probes/fp8_scale_ab.py [--reps 30] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from json_rows import emit

from gemmconv.bench.call_timing import _interleaved_twice
from gemmconv.bench.fp8_rows import CASES, _modules, _step
from gemmconv.bench.suite import suite_cases
from gemmconv.kernels import amax_scale


@contextlib.contextmanager
def _torch_scales():
    kept = amax_scale.dense_flat
    amax_scale.dense_flat = lambda t: None
    try:
        yield
    finally:
        amax_scale.dense_flat = kept


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    for case in suite_cases(list(CASES)):
        shape = case.full
        modules = _modules(shape, len(shape.kernel), device)
        seeded = torch.Generator().manual_seed(1)
        x = torch.randn(shape.n, shape.c, *shape.spatial, generator=seeded)
        x = x.to(device, torch.bfloat16).requires_grad_()
        with torch.no_grad():
            dy = torch.randn_like(modules["torch"](x))
        fp8 = _step(modules["gemmconv fp8"], x, dy)
        calls = {"scale kernel": [fp8], "torch scale": [fp8],
                 "gemmconv bf16": [_step(modules["gemmconv bf16"], x, dy)]}  # fmt: skip
        settings = {"torch scale": _torch_scales}
        times = _interleaved_twice(calls, device, args.reps, 2, None, settings)
        ms = {name: round(t.median_ms, 4) for name, t in times.items()}
        row = {"case": case.name, "device": torch.cuda.get_device_name(), "ms": ms,
               "torch/kernel": round(ms["torch scale"] / ms["scale kernel"], 3),
               "fp8 x bf16": round(ms["gemmconv bf16"] / ms["scale kernel"], 3)}  # fmt: skip
        emit(row, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
