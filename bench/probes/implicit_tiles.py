"""Tile sizes for the general implicit GEMMs, row by row of the suite (a diagnostic).

The forward and weight-gradient kernels of gemmconv.kernels.patch_gemm (the patches
gathered inside the GEMM's loads: patch_implicit, and CUDA's batch-invariant form of
half-precision patches) are timed on every bf16 row of the suite, both layouts, with
each tile configuration below, against cuBLAS on the same GEMM with the column matrix
gathered beforehand (rows padded to 16 bytes, as patch_triton's): issue 44's reference
for a gather inside the GEMM. Device time by triton.testing.do_bench (L2 flushed
between calls). One line per row and configuration, printed as measured and, with
``--out FILE``, appended to FILE as a JSON line:

    direction case layout BMxBNxBK wW sS  kernel_us cublas_us cublas/kernel  ptx

where ``ptx`` counts the compiled kernel's global loads by width (cp.async copies of
16, 8 and 4 bytes, and plain loads) and says whether it multiplies with wgmma: a
gather whose alignment Triton cannot prove compiles to plain loads, not pipelined
(CLIP-L/14's 14-pixel runs on an H100 at e1278fd). A forward row's lines follow one
naming the tiles the library picks for it (patch_gemm.forward_tiles). With
``--gather-align-ab`` each configuration of a row is timed twice: with the alignment
hints the host proves (patch_gemm.gather_alignment for the gather, _weight_alignment
for W's rows, pixel_alignment for y's and dY's pixels; ``align`` is the gather's) and
with none (``no hints``), so that their effect is read within one run.

With ``--offline`` nothing runs: each row's forward kernel, with the tiles the library
picks, is compiled for sm_90 on this machine (no GPU needed: Triton's own ptxas) with
the hints and without, and its load widths printed. The run at f489b52 (Triton 3.8)
showed every channels-first gather pipelined with the hints, where CLIP-L/14's and
ConvNeXt's and Wan 2.1's compiled to 2-byte plain loads without.

    PYTHONPATH=src python3 bench/probes/implicit_tiles.py [--cases vit_b16,...]
        [--layouts cf,cl] [--directions fwd,wgrad] [--gather-align-ab] [--offline]
        [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from triton.testing import do_bench

from gemmconv.bench.suite import suite_cases
from gemmconv.core.sizes import round_up
from gemmconv.kernels import patch_gemm, split_programs
from gemmconv.kernels.offline import load_widths, sm90_ptx
from gemmconv.kernels.patch_permute import PatchGeometry
from gemmconv.kernels.tiles import TileConfig

FORWARD_CONFIGS = (
    TileConfig(128, 128, 64, 8, 3),  # FORWARD_TILES at the time of writing
    TileConfig(128, 128, 64, 4, 3),
    TileConfig(128, 128, 64, 4, 4),
    TileConfig(128, 128, 32, 4, 4),
    TileConfig(128, 256, 64, 8, 3),
    TileConfig(256, 128, 64, 8, 3),
    TileConfig(64, 128, 64, 4, 4),
    TileConfig(128, 64, 64, 4, 4),
)
WGRAD_CONFIGS = (
    TileConfig(64, 128, 128, 8, 3),  # WGRAD_TILES at the time of writing
    TileConfig(64, 128, 128, 4, 3),
    TileConfig(64, 128, 64, 4, 4),
    TileConfig(32, 128, 128, 4, 4),
    TileConfig(64, 256, 64, 8, 3),
)


def _operands(case, layout: str, device: torch.device):
    shape = case.full
    dims = len(shape.kernel)
    x = torch.randn(shape.n, shape.c, *shape.spatial, device=device, dtype=torch.bfloat16)
    if layout == "cl":
        x = x.to(memory_format=torch.channels_last if dims == 2 else torch.channels_last_3d)
    outs = tuple(s // r for s, r in zip(shape.spatial, shape.kernel))
    y = torch.empty(shape.n, shape.k, *outs, device=device, dtype=x.dtype)
    if layout == "cl":
        y = y.to(memory_format=torch.channels_last if dims == 2 else torch.channels_last_3d)
    reduction = shape.c * math.prod(shape.kernel)
    w = torch.randn(shape.k, reduction, device=device, dtype=x.dtype)
    return x, w, y, outs


def _cublas_us(m: int, k: int, n: int, device: torch.device, wgrad: bool) -> float:
    """cuBLAS on the pre-gathered operands: cols [m, ld] @ W^T, or dY^T @ cols."""
    ld = round_up(k, 8)
    cols = torch.randn(m, ld, device=device, dtype=torch.bfloat16)
    if wgrad:
        dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
        return do_bench(lambda: torch.mm(dy.t(), cols), rep=40) * 1000
    w = torch.randn(n, ld, device=device, dtype=torch.bfloat16)
    return do_bench(lambda: torch.mm(cols, w.t()), rep=40) * 1000


def _ptx_summary(launch, tensors) -> str:
    """What the compiled kernel loads and multiplies with (see the docstring)."""
    compiled = launch._ordinary(tensors)
    return _load_widths(getattr(compiled, "asm", {}).get("ptx", ""))


def _load_widths(ptx: str) -> str:
    w = load_widths(ptx)
    return (f"cp16={w['cp16']} cp8={w['cp8']} cp4={w['cp4']} ld={w['ld']} "
            f"wgmma={'yes' if w['wgmma'] else 'no'}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="", help="comma list of suite case names (default all)")
    ap.add_argument("--layouts", default="cf,cl")
    ap.add_argument("--directions", default="fwd,wgrad")
    ap.add_argument("--gather-align-ab", action="store_true")
    ap.add_argument("--offline", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if args.offline:
        return _offline([c for c in args.cases.split(",") if c] or None, args.layouts)
    device = torch.device("cuda")
    names = [c for c in args.cases.split(",") if c] or None
    out = open(args.out, "a") if args.out else None  # noqa: SIM115 (appended line by line)
    saved = dict(patch_gemm.WGRAD_TILES)
    print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}", flush=True)
    try:
        for direction in args.directions.split(","):
            for case in suite_cases(names):
                if all(r == 1 for r in case.full.kernel):
                    continue  # 1x1: the pointwise solvers' (no gather to put in the GEMM)
                for layout in args.layouts.split(","):
                    _sweep(direction, case, layout, device, out, args.gather_align_ab)
    finally:
        patch_gemm.WGRAD_TILES.update(saved)
        patch_gemm._launches.clear()
        if out is not None:
            out.close()
    return 0


def _sweep(direction: str, case, layout: str, device: torch.device, out, ab: bool) -> None:
    saved = {name: getattr(patch_gemm, name) for name in _PROOFS + ("forward_tiles",)}
    try:
        _sweep_row(direction, case, layout, device, out, saved["gather_alignment"], ab)
    finally:
        for name, value in saved.items():
            setattr(patch_gemm, name, value)


# The host's alignment proofs, each replaced by "nothing proved" for the unhinted runs.
_PROOFS = ("gather_alignment", "_weight_alignment", "pixel_alignment")
_ALIGNS = ("GATHER_ALIGN", "W_ALIGN", "PIXEL_ALIGN")
_NOTHING_PROVED = {
    "gather_alignment": lambda g, element_size: 0,
    "_weight_alignment": lambda g, weight_rows, row_align: row_align,
    "pixel_alignment": lambda t: 0,
}


def _sweep_row(direction, case, layout, device, out, proof, ab: bool) -> None:
    x, w, y, outs = _operands(case, layout, device)
    kernel, last = case.full.kernel, layout == "cl"
    geometry = PatchGeometry.of(x, outs, kernel, last)
    proved = proof(geometry, x.element_size())
    proofs = {name: getattr(patch_gemm, name) for name in _PROOFS}
    library_tiles = patch_gemm.forward_tiles
    for hinted in (True, False) if ab else (True,):
        for name in _PROOFS:
            setattr(patch_gemm, name, proofs[name] if hinted else _NOTHING_PROVED[name])
        # Each timed configuration replaces the library's tile rule; a pass starts from
        # it, so that the pick it prints is the library's.
        patch_gemm.forward_tiles = library_tiles
        label = f"align={proved}" if hinted else "align=0 (no hints)"
        _time_configs(direction, case, layout, device, out, x, w, y, label)


def _time_configs(direction, case, layout, device, out, x, w, y, hints: str) -> None:
    kernel, last = case.full.kernel, layout == "cl"
    m, reduction, kout = y.numel() // case.full.k, w.shape[1], case.full.k
    wgrad = direction == "wgrad"
    cublas = _cublas_us(m, reduction, kout, device, wgrad)
    dy = torch.randn_like(y)
    dt = torch.bfloat16
    if not wgrad:
        picked = patch_gemm.forward_launch(x, w, None, kernel, last, y, False, device)
        print(f"# {case.name} {layout}: the library's tiles {picked.options} "
              f"{ {k: v for k, v in picked.constants.items() if k.startswith('BLOCK')} }",
              flush=True)  # fmt: skip
    for cfg in WGRAD_CONFIGS if wgrad else FORWARD_CONFIGS:
        if wgrad:
            patch_gemm.WGRAD_TILES[dt] = cfg
        else:
            patch_gemm.forward_tiles = lambda *args, chosen=cfg: chosen
        patch_gemm._launches.clear()
        try:
            if wgrad:
                splits = patch_gemm.wgrad_splits(m, kout, reduction, dt, split_programs(device))

                def call(s=splits):
                    return patch_gemm.patch_gemm_weight_grad(dy, x, kernel, last, s)

                prepared = patch_gemm.weight_grad_launch(dy, x, kernel, last, splits, False, device)
                parts = torch.empty(prepared.partials_shape, device=device)
                ptx = _ptx_summary(prepared.launch, (dy, x, parts))
            else:

                def call():
                    return patch_gemm.patch_gemm_forward(x, w, None, kernel, last, out=y)

                prepared = patch_gemm.forward_launch(x, w, None, kernel, last, y, False, device)
                ptx = _ptx_summary(prepared, (x, w, None, y))
            us = do_bench(call, rep=40) * 1000
        except Exception as exc:  # out of shared memory and the like
            print(f"{direction} {case.name} {layout} {cfg}: {type(exc).__name__}", flush=True)
            continue
        tile = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
        print(f"{direction} {case.name} {layout} {tile} {hints} {us:.1f} {cublas:.1f} "
              f"{cublas / us:.2f} {ptx}", flush=True)  # fmt: skip
        if out is not None:
            out.write(json.dumps({"direction": direction, "case": case.name, "layout": layout,
                                  "tile": tile, "hints": hints, "kernel_us": round(us, 2),
                                  "cublas_us": round(cublas, 2), "ptx": ptx}) + "\n")  # fmt: skip
            out.flush()


def _offline(names, layouts: str) -> int:
    """Compile each forward row for sm_90 here and print its load widths (--offline)."""
    for case in suite_cases(names):
        if all(r == 1 for r in case.full.kernel):
            continue
        for layout in layouts.split(","):
            x, w, y, _ = _operands(case, layout, torch.device("meta"))
            launch = patch_gemm.forward_launch(
                x, w, None, case.full.kernel, layout == "cl", y, False, torch.device("cpu")
            )
            hinted = dict(launch.constants)
            plain = {**hinted, "GATHER_ALIGN": 0, "W_ALIGN": hinted["ROW_ALIGN"], "PIXEL_ALIGN": 0}
            for name, constants in (("hints", hinted), ("no hints", plain)):
                ptx = sm90_ptx(launch, (x, w, None, y), constants)
                aligns = " ".join(f"{k}={constants[k]}" for k in _ALIGNS)
                print(f"fwd {case.name} {layout} {name} {aligns}: {_load_widths(ptx)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
