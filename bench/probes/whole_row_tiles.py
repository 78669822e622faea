"""Tile sizes for the whole-row implicit GEMMs (a diagnostic, not a benchmark).

Times gemmconv.kernels.patch_gemm's three kernels on point 2D (9500x3x14x14 -> 1280,
bf16, the whole-row path) with each tile configuration below, device time by
triton.testing.do_bench, so the tables in patch_gemm.py can be chosen by measurement.

    PYTHONPATH=src python bench/probes/whole_row_tiles.py
"""

from __future__ import annotations

import itertools

import torch
from triton.testing import do_bench

from gemmconv.kernels import patch_gemm, split_programs
from gemmconv.kernels.tiles import TileConfig


def main() -> None:
    dev = torch.device("cuda")
    dt = torch.bfloat16
    n, c, k, r = 9500, 3, 1280, (14, 14)
    x = torch.randn(n, c, *r, device=dev, dtype=dt)
    w = torch.randn(k, c * r[0] * r[1], device=dev, dtype=dt)
    dy = torch.randn(n, k, 1, 1, device=dev, dtype=dt)
    y = torch.empty(n, k, 1, 1, device=dev, dtype=dt)
    dx = torch.empty_like(x)
    cublas = do_bench(lambda: torch.mm(x.view(n, -1), w.t()))
    print(f"cuBLAS mm on the unaligned rows: {cublas * 1000:.1f} us", flush=True)
    for bm, bn, bk, warps, stages in itertools.product(
        (64, 128), (64, 128, 256), (32, 64), (4, 8), (3, 4)
    ):
        if bm * bn > 128 * 128 or (bn == 256 and warps == 4):
            continue
        cfg = TileConfig(bm, bn, bk, warps, stages)
        # Backward-data reads DGRAD_TILES, the same table as FORWARD_TILES.
        patch_gemm.FORWARD_TILES[dt] = patch_gemm.WHOLE_ROW_FORWARD_TILES[dt] = cfg
        patch_gemm._launches.clear()
        try:
            fwd = do_bench(lambda: patch_gemm.patch_gemm_forward(x, w, None, r, False, out=y))
            dgrad = do_bench(lambda: patch_gemm.patch_gemm_backward_data(dy, w, r, False, dx))
        except Exception as exc:  # out of shared memory and the like
            print(f"{cfg}: {type(exc).__name__}", flush=True)
            continue
        print(f"fwd/dgrad {bm}x{bn}x{bk} w{warps} s{stages}: {fwd * 1000:.1f} / "
              f"{dgrad * 1000:.1f} us", flush=True)  # fmt: skip
    for bm, bn, bk, warps, stages in itertools.product(
        (32, 64, 128), (64, 128), (64, 128), (4, 8), (3, 4)
    ):
        cfg = TileConfig(bm, bn, bk, warps, stages)
        patch_gemm.WGRAD_TILES[dt] = cfg
        patch_gemm._launches.clear()
        splits = patch_gemm.wgrad_splits(n, k, w.shape[1], dt, split_programs(dev))
        try:
            ms = do_bench(lambda s=splits: patch_gemm.patch_gemm_weight_grad(dy, x, r, False, s))
        except Exception as exc:
            print(f"{cfg}: {type(exc).__name__}", flush=True)
            continue
        print(f"wgrad {bm}x{bn}x{bk} w{warps} s{stages} splits {splits}: {ms * 1000:.1f} us",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
