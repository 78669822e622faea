"""The patch GEMMs with TMA boxes (gemmconv.kernels.boxed_patch_gemm), each direction,
against the library's implicit GEMMs and cuBLAS on the same columns (a diagnostic).

Issue 44's reference for a gather inside the GEMM is cuBLAS on the same GEMM with the
column matrix gathered beforehand; its target is 0.85x that speed. For every bf16
channels-first suite row whose patches TMA can box (ViT-B/16, SAM ViT-H, VideoMAE;
ViT-B/16 at batch 32 too), this times, by device time (triton.testing.do_bench, L2
flushed between calls):

- ``boxed`` (``direction=fwd``): the TMA kernel with each tile configuration below;
- ``implicit``: patch_gemm's forward with the library's tiles (what patch_implicit runs);
- ``cublas``: torch.mm of the gathered columns [M, Kred] and W^T, into [M, K] rows;
- ``gather+cublas``: the Triton gather into those columns, then that mm (patch_triton's
  work before its output's transpose).

For the one-patch rows whose samples TMA can box as rows (point 3D, Qwen2-VL,
Qwen3-VL: ``boxed_rows_forward``, which batch invariance could run in place of the
implicit GEMM), the same with ``cublas`` as torch.mm on x's own rows, what
point_output runs.

Their backward-data (``direction=dgrad``): ``boxed_dgrad`` per configuration
(``boxed_patch_backward_data``, dY through its strides, dx's boxes stored by TMA),
``implicit`` (patch_gemm's), ``cublas`` (dY's rows made beforehand, @ W into the
columns) and ``transpose+cublas+scatter`` (dY's rows copied, that mm, the columns
scattered into dx: what patch_triton's backward-data runs).

The weight gradients of the same patch rows (``direction=wgrad``): ``boxed_wgrad``
per configuration (``boxed_patch_weight_grad``, x by TMA boxes, dY through its
strides), ``implicit`` (patch_gemm's, the library's tiles and splits), ``cublas`` (dY's
rows [M, K] transposed against the gathered columns, both made beforehand) and
``transpose+gather+cublas`` (dY's rows copied, the columns gathered, then that mm:
what patch_triton's weight gradient runs).

Each boxed configuration's output is compared with the implicit GEMM's first (relative
rms error, printed). One line per row and variant, printed as measured and, with
``--out FILE``, appended to FILE as a JSON line.

    PYTHONPATH=src python3 bench/probes/boxed_patch_gemm.py [--out FILE] [--configs N]
        [--cases vit_b16,qwen2vl,...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import torch
from triton.testing import do_bench

from gemmconv.bench.suite import suite_cases
from gemmconv.kernels import patch_gemm, split_programs
from gemmconv.kernels.boxed_patch_gemm import (
    applies,
    boxed_patch_backward_data,
    boxed_patch_forward,
    boxed_patch_weight_grad,
    boxed_rows_forward,
)
from gemmconv.kernels.patch_gemm import TileConfig
from gemmconv.kernels.patch_permute import gather_patches, scatter_patches

CONFIGS = (
    TileConfig(128, 128, 64, 8, 3),  # FORWARD_TILES at the time of writing
    TileConfig(128, 128, 64, 4, 4),
    TileConfig(128, 256, 64, 8, 3),
    TileConfig(256, 128, 64, 8, 3),
    TileConfig(128, 128, 128, 8, 3),
    TileConfig(128, 128, 32, 4, 4),
    TileConfig(64, 128, 64, 4, 4),
    TileConfig(128, 64, 64, 4, 4),
)
CASES = ("vit_b16", "sam_vit_h", "videomae")
ROW_CASES = ("point3d", "qwen2vl", "qwen3vl")
SMALL_BATCH = 32  # ViT-B/16's batch for the host-bound end
CHOSEN = list(CONFIGS)  # the configurations a run times (--configs)


def _rows(wanted: list[str]):
    """(name, shape) of the patch rows among the ``wanted`` cases."""
    names = [c for c in CASES if c in wanted]
    for case in suite_cases(names) if names else ():
        yield case.name, case.full
        if case.name == "vit_b16":
            yield f"vit_b16_b{SMALL_BATCH}", dataclasses.replace(case.full, n=SMALL_BATCH)


def _us(fn) -> float:
    return do_bench(fn, rep=40) * 1000


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--configs", type=int, default=len(CONFIGS),
                    help="the first this many tile configurations (each compiles)")  # fmt: skip
    ap.add_argument("--cases", default=",".join(CASES + ROW_CASES),
                    help="comma list of the cases to run")  # fmt: skip
    args = ap.parse_args(argv)
    del CHOSEN[args.configs :]
    wanted = args.cases.split(",")
    device = torch.device("cuda")
    out = open(args.out, "a") if args.out else None  # noqa: SIM115 (appended line by line)
    print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}", flush=True)

    def emit(record: dict) -> None:
        print(" ".join(f"{k}={v}" for k, v in record.items()), flush=True)
        if out is not None:
            out.write(json.dumps(record) + "\n")
            out.flush()

    try:
        for name, shape in _rows(wanted):
            _row(name, shape, device, emit)
        point_cases = [c for c in ROW_CASES if c in wanted]
        for case in suite_cases(point_cases) if point_cases else ():
            _point_row(case.name, case.full, device, emit)
    finally:
        if out is not None:
            out.close()
    return 0


def _operands(shape, device: torch.device):
    """(x, its patch kernel, the reduction's length, W's rows) in bf16."""
    x = torch.randn(shape.n, shape.c, *shape.spatial, device=device, dtype=torch.bfloat16)
    kernel = tuple(shape.kernel)
    reduction = shape.c * math.prod(kernel)
    w = torch.randn(shape.k, reduction, device=device, dtype=x.dtype) / math.sqrt(reduction)
    return x, kernel, reduction, w


def _dy_rows(dy: torch.Tensor) -> torch.Tensor:
    """Channels-first dY [N, K, O..] copied into rows [M, K], as patch_triton moves it."""
    return dy.flatten(2).transpose(1, 2).reshape(-1, dy.shape[1])


def _emit_baselines(base: dict, emit, times: dict[str, float]) -> None:
    for variant, us in times.items():
        emit({**base, "variant": variant, "us": round(us, 1)})


def _row(name: str, shape, device: torch.device, emit) -> None:
    x, kernel, reduction, w = _operands(shape, device)
    dtype = x.dtype
    outs = tuple(s // r for s, r in zip(shape.spatial, kernel))
    reasons = applies(x, kernel, w)
    if reasons:
        emit({"case": name, "skipped": "; ".join(reasons)})
        return
    y = torch.empty(shape.n, shape.k, *outs, device=device, dtype=dtype)
    m = shape.n * math.prod(outs)
    base = {"case": name, "direction": "fwd", "m": m, "n": shape.k, "k": reduction}

    implicit = _us(lambda: patch_gemm.patch_gemm_forward(x, w, None, kernel, False, out=y))
    reference = y.float().clone()
    cols = gather_patches(x, outs, kernel, False, torch.empty(m, reduction, device=device,
                                                               dtype=dtype))  # fmt: skip
    cublas = _us(lambda: torch.mm(cols, w.t()))

    def gathered():
        gather_patches(x, outs, kernel, False, cols)
        return torch.mm(cols, w.t())

    gather_mm = _us(gathered)
    _emit_baselines(
        base, emit, {"implicit": implicit, "cublas": cublas, "gather+cublas": gather_mm}
    )
    _sweep(base, "boxed", lambda cfg: boxed_patch_forward(x, w, None, kernel, y, cfg), y,
           reference, cublas, implicit, emit)  # fmt: skip
    _dgrad(base, x, w, kernel, outs, y, cols, emit)
    _wgrad(base, x, kernel, outs, y, cols, device, emit)


def _dgrad(base: dict, x, w, kernel, outs, y, cols, emit) -> None:
    base = {**base, "direction": "dgrad"}
    dy = torch.randn_like(y)
    dx = torch.empty_like(x)
    implicit = _us(lambda: patch_gemm.patch_gemm_backward_data(dy, w, kernel, False, dx))
    reference = dx.float().clone()
    dy_rows = _dy_rows(dy)
    cublas = _us(lambda: torch.mm(dy_rows, w, out=cols))

    def transposed_scattered():
        rows = _dy_rows(dy)
        torch.mm(rows, w, out=cols)
        return scatter_patches(cols, outs, kernel, False, dx)

    both = _us(transposed_scattered)
    _emit_baselines(base, emit, {"implicit": implicit, "cublas": cublas,
                                 "transpose+cublas+scatter": both})  # fmt: skip
    _sweep(base, "boxed_dgrad", lambda cfg: boxed_patch_backward_data(dy, w, kernel, dx, cfg),
           dx, reference, cublas, implicit, emit)  # fmt: skip


def _wgrad(base: dict, x, kernel, outs, y, cols, device: torch.device, emit) -> None:
    base = {**base, "direction": "wgrad"}
    dy = torch.randn_like(y)
    m, kout = cols.shape[0], y.shape[1]
    programs = split_programs(device)
    splits = patch_gemm.wgrad_splits(m, kout, cols.shape[1], x.dtype, programs)
    implicit = _us(lambda: patch_gemm.patch_gemm_weight_grad(dy, x, kernel, False, splits))
    reference = patch_gemm.patch_gemm_weight_grad(dy, x, kernel, False, splits)
    dy_rows = _dy_rows(dy)
    cublas = _us(lambda: torch.mm(dy_rows.t(), cols))

    def transposed_gathered():
        rows = _dy_rows(dy)
        gather_patches(x, outs, kernel, False, cols)
        return torch.mm(rows.t(), cols)

    both = _us(transposed_gathered)
    _emit_baselines(base, emit, {"implicit": implicit, "cublas": cublas,
                                 "transpose+gather+cublas": both})  # fmt: skip
    _sweep(base, "boxed_wgrad", lambda cfg: boxed_patch_weight_grad(dy, x, kernel, programs, cfg),
           None, reference, cublas, implicit, emit)  # fmt: skip


def _point_row(name: str, shape, device: torch.device, emit) -> None:
    """One patch a sample: x's own rows [N, Kred] are the columns."""
    x, kernel, reduction, w = _operands(shape, device)
    y = torch.empty(shape.n, shape.k, *(1,) * len(kernel), device=device, dtype=x.dtype)
    rows, y_rows = x.view(shape.n, reduction), y.view(shape.n, shape.k)
    base = {"case": name, "direction": "fwd", "m": shape.n, "n": shape.k, "k": reduction}
    implicit = _us(lambda: patch_gemm.patch_gemm_forward(x, w, None, kernel, False, out=y))
    reference = y_rows.float().clone()
    cublas = _us(lambda: torch.mm(rows, w.t()))
    _emit_baselines(base, emit, {"implicit": implicit, "cublas": cublas})
    _sweep(base, "boxed_rows", lambda cfg: boxed_rows_forward(rows, w, None, y_rows, cfg),
           y_rows, reference, cublas, implicit, emit)  # fmt: skip


def _sweep(base: dict, variant: str, run, result: torch.Tensor | None, reference,
           cublas: float, implicit: float, emit) -> None:  # fmt: skip
    """Time ``run(cfg)`` per configuration, its result (``result``, filled with NaN
    before the checked run, where it writes one given buffer) compared with
    ``reference`` first."""
    for cfg in CHOSEN:
        tile = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
        try:
            if result is not None:
                result.fill_(float("nan"))
            got = run(cfg).float()
            error = ((got - reference).norm() / reference.norm()).item()
            us = _us(lambda c=cfg: run(c))
        except Exception as exc:  # out of shared memory and the like
            emit({**base, "variant": variant, "tile": tile, "error": type(exc).__name__})
            continue
        emit({**base, "variant": variant, "tile": tile, "us": round(us, 1),
              "cublas_over_boxed": round(cublas / us, 3),
              "implicit_over_boxed": round(implicit / us, 3),
              "rel_rms_vs_implicit": f"{error:.2e}"})  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
