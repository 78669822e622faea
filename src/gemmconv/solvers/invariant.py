"""The batch-invariant GEMM of the CPU solvers (gemmconv.batch_invariant).

CPU BLAS picks its kernel by the shape: MKL's sgemm (torch 2.14, AVX-512) summed a
row one way alone (a matrix-vector product), another in products of 2 or 3 rows and
in the tail rows of products under 12, and a third way in larger ones, so a sample
alone and the same sample in a batch differed in the last bits. Here every row is
computed by a product of one fixed shape, ``rows_chunk(K, N)`` rows by the same K
and N with the same strides, whatever the batch: the rows are taken in chunks of
that many and the last chunk is padded with zero rows. The chunk depends on the
reduction and output widths only, never on the row count; it is large enough that
each call's fixed cost stays small beside its work (2^23 multiply-adds, at least
256 rows: fp32 ran 1.05-1.1x the single product's time on the CPU machine for a
768 x 768 GEMM, bench/probes/cpu_row_invariance.py).

Every batch-invariant CPU solver (patch, point_output, pointwise, strided_pointwise)
multiplies the same column matrix (x's patches in x's memory order, unpadded) through
this one function, so that which of them a batch size chooses does not change a bit.
"""

from __future__ import annotations

import torch

from gemmconv.core.problem import ConvProblem, dtype_name
from gemmconv.solvers.views import rows_view

# Products of 5-7 or 9-11 columns summed a row by its place in the product (MKL's
# sgemm, fp32): the row 4 places on gave other bits. Widths of a multiple of 16 did not,
# in fp32, bf16 and fp16 (bench/probes/cpu_row_invariance.py), so the weight gets zero
# rows up to one.
COLUMN_MULTIPLE = 16
# Multiply-adds a chunk's product should do at least, and the bounds of its rows.
CHUNK_MACS = 1 << 23
MIN_CHUNK_ROWS = 256
MAX_CHUNK_ROWS = 1 << 14


def rows_chunk(reduction: int, columns: int) -> int:
    """Rows of every product the invariant GEMM runs for a [*, reduction] @
    [reduction, columns] GEMM: a power of two, from the widths alone."""
    rows = MIN_CHUNK_ROWS
    while rows < MAX_CHUNK_ROWS and rows * max(1, reduction * columns) < CHUNK_MACS:
        rows *= 2
    return rows


def invariant_rows_gemm(
    a: torch.Tensor, wm: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor
) -> torch.Tensor:
    """out [M, N] = a [M, K] @ wm [N, K]^T (+ bias), each row summed as in any other
    batch: every product is ``rows_chunk(K, N)`` rows of dense operands by N rounded up
    to COLUMN_MULTIPLE columns (zero weight rows and bias beyond N), the last chunk
    padded with zero rows. Returns out."""
    m, k = a.shape
    n = wm.shape[0]
    if m == 0 or n == 0:
        return out
    if a.stride() != (k, 1):
        a = a.contiguous()
    width = -(-n // COLUMN_MULTIPLE) * COLUMN_MULTIPLE
    if width != n:
        wm = torch.cat([wm, wm.new_zeros(width - n, k)])
        if bias is not None:
            bias = torch.cat([bias, bias.new_zeros(width - n)])
    b = wm.contiguous().t()
    chunk = rows_chunk(k, width)
    full = m - m % chunk
    if width == n and out.stride() == (n, 1):
        for start in range(0, full, chunk):
            _product(a[start : start + chunk], b, bias, out[start : start + chunk])
    else:
        # Products land in dense rows, as the padded chunk's do: the same strides for all.
        scratch = a.new_empty(chunk, width)
        for start in range(0, full, chunk):
            product = _product(a[start : start + chunk], b, bias, scratch)
            out[start : start + chunk].copy_(product[:, :n])
    if full < m:
        padded = a.new_zeros(chunk, k)
        padded[: m - full].copy_(a[full:])
        last = _product(padded, b, bias, a.new_empty(chunk, width))
        out[full:].copy_(last[: m - full, :n])
    return out


def _product(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor):
    if bias is None:
        return torch.mm(a, b, out=out)
    return torch.addmm(bias, a, b, out=out)


def store_invariant_rows(
    y: torch.Tensor, col: torch.Tensor, wm: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """y [N, K, S..] = col [N*prod(S), Kred] @ wm [K, Kred]^T (+ bias), the product's rows
    being y's pixels in channels-last order: straight into y where y is those rows,
    else through a rows buffer and one copy. Returns y."""
    y_rows = rows_view(y)
    if y_rows is not None:
        invariant_rows_gemm(col, wm, bias, y_rows)
        return y
    n, k, *spatial = y.shape
    product = invariant_rows_gemm(col, wm, bias, col.new_empty(col.shape[0], k))
    y.copy_(product.view(n, *spatial, k).movedim(-1, 1))
    return y


# fp64 products with an odd reduction (147) summed a row by its place in the product
# even at widths of 16 (MKL's dgemm): no fp64 forward is made invariant on the CPU.
INVARIANT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})


def cpu_reasons(p: ConvProblem) -> list[str]:
    """Why the CPU solvers' invariant GEMM would not serve ``p`` (empty: it does)."""
    if p.dtype not in INVARIANT_DTYPES:
        return [f"CPU BLAS sums {dtype_name(p.dtype)} rows by their place in the product"]
    return []


__all__ = [
    "CHUNK_MACS",
    "COLUMN_MULTIPLE",
    "INVARIANT_DTYPES",
    "cpu_reasons",
    "invariant_rows_gemm",
    "rows_chunk",
    "store_invariant_rows",
]
