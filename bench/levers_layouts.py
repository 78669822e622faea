"""Lever experiments for the channels-first and unaligned rows (run on the GPU).

Times, with gemmconv.measuring.timing.time_ms (device time, L2 flushed), the pieces a solver
would be built from, so that a solver is only written for a variant that pays:

- ViT-B/16 channels-first forward: the Y^T-per-sample bmm (ldc = 196, unaligned)
  against one row-major GEMM into a token-major buffer followed by a tiled transpose
  into channels-first y, whole or in sample chunks (chunks bound the extra memory and
  may keep the buffers in L2), and against a bmm into a padded (ldc = 200) buffer.
- The channels-first dY -> rows copy (weight and data gradients): torch vs the kernel.
- Point 2D (Kred = 588): the pad copy [M, 588] -> [M, 592] as a 2-byte gather, a torch
  slice copy and a copy of 8-byte words (1176-byte rows are whole words), and the
  unpad copy of backward-data.

Writes a JSON and prints a table. Usage: PYTHONPATH=src python bench/levers_layouts.py OUT
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from gemmconv.kernels.patch_permute import gather_patches
from gemmconv.kernels.strided_copy import pad_rows, strided_copy
from gemmconv.measuring.timing import time_ms

DEV = torch.device("cuda")
BF16 = torch.bfloat16
results: dict[str, float] = {}


def record(name: str, fn) -> None:
    results[name] = time_ms(fn, device=DEV, warmup=3, reps=20).median_ms
    print(f"{name:60s} {results[name]:.4f} ms", flush=True)


def vit_cf_forward() -> None:
    n, c, s, r, k = 256, 3, 224, 16, 768
    o = s // r
    pix = o * o
    kred = c * r * r
    x = torch.rand(n, c, s, s, device=DEV, dtype=BF16) * 2 - 1
    w = torch.rand(k, kred, device=DEV, dtype=BF16) * 2 - 1
    y = torch.empty(n, k, o, o, device=DEV, dtype=BF16)
    col = torch.empty(n * pix, kred, device=DEV, dtype=BF16)
    tmp = torch.empty(n * pix, k, device=DEV, dtype=BF16)
    expected = F.conv2d(x.float(), w.float().view(k, c, r, r), stride=r)

    def gather(xs, cols):
        gather_patches(xs, (o, o), (r, r), False, out=cols)

    record("vit cf: gather only", lambda: gather(x, col))
    record("vit cf: mm col @ W^T only", lambda: torch.mm(col, w.t(), out=tmp))

    def bmm_unaligned():
        gather(x, col)
        col3 = col.view(n, pix, kred).transpose(1, 2)
        torch.bmm(w.expand(n, k, kred), col3, out=y.view(n, k, pix))

    record("vit cf fwd: gather + bmm Y^T (ldc 196)", bmm_unaligned)
    padded = torch.empty(n, k, 200, device=DEV, dtype=BF16)

    def bmm_padded():
        gather(x, col)
        col3 = col.view(n, pix, kred).transpose(1, 2)
        torch.bmm(w.expand(n, k, kred), col3, out=padded[:, :, :pix])
        y.view(n, k, pix).copy_(padded[:, :, :pix])

    record("vit cf fwd: gather + bmm into ldc 200 + slice copy", bmm_padded)

    def mm_transpose(chunks: int, torch_copy: bool = False):
        step = n // chunks
        for i in range(0, n, step):
            xs = x[i : i + step]
            cs = col[: step * pix]
            ts = tmp[: step * pix]
            gather(xs, cs)
            torch.mm(cs, w.t(), out=ts)
            dst = y[i : i + step].view(step, k, pix).transpose(1, 2)
            if torch_copy:
                dst.copy_(ts.view(step, pix, k))
            else:
                strided_copy(dst, ts.view(step, pix, k))

    record("vit cf fwd: gather + mm + torch transpose", lambda: mm_transpose(1, True))
    for chunks in (1, 2, 4, 8, 16):
        record(f"vit cf fwd: gather + mm + kernel transpose, {chunks} chunks",
               lambda chunks=chunks: mm_transpose(chunks))  # fmt: skip
    mm_transpose(4)
    err = (y.float() - expected).abs().max().item()
    print(f"  check: max abs error of the 4-chunk path vs fp32 conv {err:.3g}")
    results["vit cf fwd chunked max abs error"] = err

    # dY rows for the gradients: [N, K, L] -> [N*L, K].
    dy = torch.rand(n, k, o, o, device=DEV, dtype=BF16)
    rows = torch.empty(n * pix, k, device=DEV, dtype=BF16)
    src = dy.view(n, k, pix).transpose(1, 2)
    record("dY rows: torch copy", lambda: rows.view(n, pix, k).copy_(src))
    record("dY rows: kernel", lambda: strided_copy(rows.view(n, pix, k), src))
    assert torch.equal(rows.view(n, pix, k), src)
    record("vit cf wgrad GEMM rows^T @ col", lambda: torch.mm(rows.t(), col))
    record("vit cf bwd-data GEMM rows @ W", lambda: torch.mm(rows, w, out=col))
    record("vit cf bwd-data bmm dY^T @ W (lda 196)",
           lambda: torch.bmm(src, w.expand(n, k, kred), out=col.view(n, pix, kred)))  # fmt: skip


def point2d() -> None:
    n, kred, ld, k = 9500, 588, 592, 1280
    x = torch.rand(n, kred, device=DEV, dtype=BF16)
    w = torch.rand(k, ld, device=DEV, dtype=BF16)
    col = torch.empty(n, ld, device=DEV, dtype=BF16)
    col[:, kred:].zero_()
    y = torch.empty(n, k, device=DEV, dtype=BF16)

    x4 = x.view(n, 3, 14, 14)
    record("point2d: gather kernel (2-byte runs)",
           lambda: gather_patches(x4, (1, 1), (14, 14), False, out=col))  # fmt: skip
    record("point2d: torch slice copy", lambda: col[:, :kred].copy_(x))
    words_src = x.view(torch.int64)  # [n, 147]
    words_dst = col.view(torch.int64)  # [n, 148]
    record("point2d: torch slice copy of 8-byte words", lambda: words_dst[:, :147].copy_(words_src))
    record("point2d: pad_rows (8-byte words, zeros in the same pass)", lambda: pad_rows(col, x))
    record(
        "point2d: kernel copy of 8-byte words", lambda: strided_copy(words_dst[:, :147], words_src)
    )
    assert torch.equal(col[:, :kred], x)
    record("point2d: mm padded", lambda: torch.mm(col, w.t(), out=y))
    record("point2d: mm unaligned", lambda: torch.mm(x, w[:, :kred].t(), out=y))
    record("point2d: F.linear unaligned", lambda: F.linear(x, w[:, :kred].contiguous()))
    dx = torch.empty(n, kred, device=DEV, dtype=BF16)
    record("point2d: unpad torch copy", lambda: dx.copy_(col[:, :kred]))
    record("point2d: unpad 8-byte words", lambda: dx.view(torch.int64).copy_(words_dst[:, :147]))


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "levers_layouts.json"
    print(torch.cuda.get_device_name(), torch.__version__)
    vit_cf_forward()
    point2d()
    with open(out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "median_ms": results}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
