"""How cuBLAS's GEMM for a channels-first output compares with the rewrite's (a
diagnostic, device time).

A channels-first y with several pixels per sample is [N, K, P]: the patch solvers
write it as Y^T = W @ col^T per sample, one batched GEMM (column_gemm.store_batched),
where the rewrite writes [N*P, K] rows and returns them as a channels-last view. On
Wan 2.1's patchify (one sample, 32760 pixels, K = 5120, a reduction of 64) the
channels-first GEMM took 0.219 ms against the rows' 0.139 on an H100 at 3dd28ca, for
the same 335 MB written. This times, on the suite's multi-pixel cases' GEMMs with
random operands, the rows GEMM and ways of writing [N, K, P]: the batched GEMM with
the weight broadcast (stride 0) and materialised, the columns gathered K-major,
torch.matmul, where N is 1 one plain GEMM and slices of it, each with torch's default
BLAS and with cuBLASLt, and the rows GEMM followed by a transposing copy. One JSON
line per case, printed and, with ``--out FILE``, appended.

    PYTHONPATH=src python3 bench/probes/cf_output_gemm.py [--cases a,b] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import math

import torch
from json_rows import emit
from triton.testing import do_bench

from gemmconv.bench.suite import suite_cases

MULTI_PIXEL = ("wan21_patchify", "sd3_patchify", "vit_b16", "clip_l14_336", "sam_vit_h",
               "videomae", "dit_xl2", "convnext_down")  # fmt: skip


@contextlib.contextmanager
def _blas(library: str):
    kept = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(kept)


def _variants(n: int, p: int, k: int, r: int):
    cols = torch.randn(n * p, r, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(k, r, device="cuda", dtype=torch.bfloat16)
    col_t = cols.view(n, p, r).transpose(1, 2)
    y = torch.empty(n, k, p, device="cuda", dtype=torch.bfloat16)
    w_full = w.expand(n, k, r).contiguous()
    out = {
        "rows": lambda: torch.mm(cols, w.t()),
        "batched": lambda: torch.bmm(w.expand(n, k, r), col_t, out=y),
        "batched_full_w": lambda: torch.bmm(w_full, col_t, out=y),
        "matmul": lambda: torch.matmul(w, col_t),
        "rows_then_transpose": lambda: y.copy_(torch.mm(cols, w.t()).view(n, p, k).transpose(1, 2)),
    }
    col_k_major = col_t.contiguous()  # the columns gathered [N, R, P]
    out["batched_k_major_columns"] = lambda: torch.bmm(w.expand(n, k, r), col_k_major, out=y)
    if n == 1:
        out["one_mm"] = lambda: torch.mm(w, cols.t(), out=y[0])
        # Slices of y's pixels or channels, each its own GEMM: other shapes, other kernels.
        for chunk in (4096, 16384):
            out[f"pixel_slices_{chunk}"] = _slices(cols, w, y[0], chunk, by_pixels=True)
        for chunk in (1024, 2560):
            out[f"channel_slices_{chunk}"] = _slices(cols, w, y[0], chunk, by_pixels=False)
    return out


def _slices(cols, w, y, chunk: int, by_pixels: bool):
    def run():
        for i in range(0, y.shape[1 if by_pixels else 0], chunk):
            if by_pixels:
                torch.mm(w, cols[i : i + chunk].t(), out=y[:, i : i + chunk])
            else:
                torch.mm(w[i : i + chunk], cols.t(), out=y[i : i + chunk])

    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(MULTI_PIXEL))
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    for case in suite_cases(args.cases.split(",")):
        s = case.full
        p = math.prod(d // r for d, r in zip(s.spatial, s.kernel))
        r = -(-s.c * math.prod(s.kernel) // 8) * 8  # the reduction padded to 16 bytes
        ms = {}
        for library in ("cublas", "cublaslt"):
            with _blas(library):
                for name, fn in _variants(s.n, p, s.k, r).items():
                    try:
                        ms[f"{name}/{library}"] = round(do_bench(fn, return_mode="median"), 4)
                    except RuntimeError as e:  # a BLAS that refuses the form
                        ms[f"{name}/{library}"] = str(e).splitlines()[0][:80]
        row = {"case": case.name, "device": torch.cuda.get_device_name(), "n": s.n, "p": p,
               "k": s.k, "r": r, "ms": ms}  # fmt: skip
        emit(row, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
