"""The paired-rows forward GEMM against what point 2D's forward runs now (a diagnostic).

Point 2D's forward (9500x3x14x14 -> 1280, rows of 588 half-precision elements, 8 bytes
off 16-byte alignment) as one GEMM: gemmconv.kernels.paired_rows_gemm per tile
configuration, the whole-row implicit GEMM (patch_implicit's kernel), cuBLAS on the
unaligned rows and, for reference, cuBLAS on rows padded to 592 (what an aligned GEMM of
this size costs). Device time by triton.testing.do_bench_cudagraph (replays of a
captured stream: no host in it) and do_bench (L2 flushed between calls); each paired
configuration is checked against float64 first. Also the host time of one ordinary
Triton launch of each kernel, back to back.

    PYTHONPATH=src python bench/probes/paired_rows_probe.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from host_profile import issue_us  # this folder is the script's first import path
from triton.testing import do_bench, do_bench_cudagraph

from gemmconv.kernels import paired_rows_gemm, patch_gemm
from gemmconv.kernels.tiles import TileConfig

CONFIGS = [
    TileConfig(128, 256, 64, 8, 4),
    TileConfig(128, 128, 64, 8, 3),
    TileConfig(128, 128, 64, 4, 3),
    TileConfig(128, 128, 64, 8, 4),
    TileConfig(128, 256, 64, 8, 3),
    TileConfig(128, 128, 32, 4, 4),
    TileConfig(128, 256, 32, 8, 4),
    TileConfig(64, 128, 64, 4, 4),
    TileConfig(256, 128, 64, 8, 3),
    TileConfig(128, 64, 64, 4, 4),
]


def _line(name: str, fn) -> None:
    graph_us = do_bench_cudagraph(fn) * 1000
    flushed_us = do_bench(fn) * 1000
    print(f"{name:<44} graph {graph_us:7.1f} us  flushed {flushed_us:7.1f} us  "
          f"host {issue_us(fn, 200, torch.cuda.synchronize, passes=1):6.1f} us",
          flush=True)  # fmt: skip


def _probe(dt: torch.dtype, dev: torch.device) -> None:
    n, c, k, r = 9500, 3, 1280, (14, 14)
    red = c * r[0] * r[1]
    x = torch.randn(n, c, *r, device=dev, dtype=dt)
    rows = x.view(n, red)
    w = torch.randn(k, red, device=dev, dtype=dt)
    bias = torch.randn(k, device=dev, dtype=dt)
    y = torch.empty(n, k, device=dev, dtype=dt)
    y4 = y.view(n, k, 1, 1)
    padded = F.pad(rows, (0, 4))
    w_padded = F.pad(w, (0, 4))
    ref = (rows.double() @ w.double().t() + bias.double()).float()
    print(f"== {dt}", flush=True)
    _line("cuBLAS addmm, unaligned rows", lambda: torch.addmm(bias, rows, w.t(), out=y))
    _line("cuBLAS addmm, rows padded to 592", lambda: torch.addmm(bias, padded, w_padded.t()))
    _line("whole-row implicit (patch_gemm)",
          lambda: patch_gemm.patch_gemm_forward(x, w, bias, r, False, out=y4))  # fmt: skip
    boxed = paired_rows_gemm.boxed_weights(w)
    _line("boxed_weights (the weight's padded copy)", lambda: paired_rows_gemm.boxed_weights(w))
    forward_boxed = paired_rows_gemm.paired_rows_forward_boxed
    _sweep("boxed", lambda cfg: forward_boxed(rows, boxed, bias, y, cfg), y, ref)
    _sweep(
        "paired", lambda cfg: paired_rows_gemm.paired_rows_forward(rows, w, bias, y, cfg), y, ref
    )


def _sweep(label: str, run, y: torch.Tensor, ref: torch.Tensor) -> None:
    """``run(cfg)`` (writing ``y``) per tile configuration: checked against ``ref``
    first, then timed."""
    for cfg in CONFIGS:
        name = f"{label} {cfg.block_m}x{cfg.block_n}x{cfg.block_k}"
        name += f" w{cfg.num_warps} s{cfg.num_stages}"
        try:
            y.fill_(float("nan"))
            run(cfg)
            err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            if not err < 1e-2:
                print(f"{name}: WRONG, relative error {err:.3g}", flush=True)
                continue
            _line(name, lambda cfg=cfg: run(cfg))
        except Exception as exc:  # out of shared memory and the like
            print(f"{name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)


def main() -> None:
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(dev), "torch", torch.__version__, flush=True)
    for dt in (torch.bfloat16, torch.float16):
        _probe(dt, dev)


if __name__ == "__main__":
    main()
