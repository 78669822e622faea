"""Channels-first y or dY through one row-major GEMM and the tiled transpose kernel.

A channels-first y or dY with several pixels per sample meets the GEMM (whose rows
are pixels) transposed: each sample is a [K, P] block. The per-sample bmm that
computes Y^T in y's own order has P as its leading dimension, and with P x element
size not a multiple of 16 bytes (ViT-B/16: P = 196) cuBLAS falls off its fast
kernels; the weight gradient copies dY to rows through torch's transposed copy.
This path runs one row-major GEMM on rows instead and moves between rows and
channels-first with the transpose kernel (kernels/strided_copy.py).
"""

from __future__ import annotations

import torch

from gemmconv.problem import ConvProblem, Direction
from gemmconv.solvers.patch.columns import ColumnSource
from gemmconv.solvers.patch.cost import output_rows_bytes
from gemmconv.solvers.patch.mapping import batched_gemm_is_unaligned, transposed_pixels

# The path's two buffers (column rows, and y or dY rows) are cut into sample chunks
# only where they would exceed both one copy of the largest operand and this size:
# that bounds the memory of huge batches, while an ordinary call runs in one pass.
CHUNK_ABOVE_BYTES = 256 << 20
# The tiled transpose kernel (kernels/strided_copy.py) against a plain copy.
TRANSPOSE_SLOWDOWN = 1.25
# The batch (grid axis 1) of one transpose launch is a sample count.
MAX_CHUNK_SAMPLES = 65535


def applies(p: ConvProblem) -> bool:
    """Whether a direction runs through rows: the channels-first weight gradient
    always (it copies dY to rows either way), the forward and backward-data only
    where the per-sample bmm would have an unaligned leading dimension."""
    if p.direction is Direction.BACKWARD_WEIGHTS:
        return transposed_pixels(p) > 0
    return batched_gemm_is_unaligned(p)


def _has_mm_out_dtype() -> bool:
    # torch.mm(..., out_dtype=) exists from torch 2.8 on, for CUDA only: it lets chunked
    # weight-gradient products be summed in fp32 without rounding each to bf16 first.
    return hasattr(torch.ops.aten.mm, "dtype")


def _fp32_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of half-precision operands, returned in fp32 without an fp16/bf16 rounding."""
    if a.is_cuda and _has_mm_out_dtype():
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())  # the CPU (interpreter tests): no out_dtype there


def chunk_samples(p: ConvProblem, ld: int) -> int:
    """Samples per pass: all of them, unless the buffers would exceed both one largest
    operand and CHUNK_ABOVE_BYTES; then as many as fit in the larger of the two."""
    per_sample = transposed_pixels(p) * (ld + p.k) * p.element_size
    # What else the direction holds meanwhile: the padded weight, and for the weight
    # gradient an fp32 running sum and one fp32 chunk product.
    fixed = p.k * ld * (p.element_size + 8)
    budget = max(p.largest_operand_bytes(), CHUNK_ABOVE_BYTES)
    fit = max(1, (budget - fixed) // max(per_sample, 1))
    half = p.dtype in (torch.float16, torch.bfloat16)
    if p.direction is Direction.BACKWARD_WEIGHTS and half and not _has_mm_out_dtype():
        fit = p.n  # chunk sums would round to the dtype in between: keep one GEMM
    return min(p.n, fit, MAX_CHUNK_SAMPLES)


def workspace_bytes(p: ConvProblem, ld: int) -> int:
    pixels = chunk_samples(p, ld) * transposed_pixels(p)
    return pixels * (ld + p.k) * p.element_size


def copied_bytes(p: ConvProblem) -> float:
    """y or dY crosses between rows and channels-first once, read and written."""
    return 2 * output_rows_bytes(p) * TRANSPOSE_SLOWDOWN


def passes(p: ConvProblem, ld: int) -> int:
    """Sample chunks the path walks (one unless its buffers would be too large)."""
    return -(-p.n // chunk_samples(p, ld))


def launches(p: ConvProblem, ld: int) -> int:
    return 3 * passes(p, ld)  # per chunk: gather or scatter, GEMM, transpose


def transpose_kernel_runs(p: ConvProblem) -> bool:
    """Whether the transpose kernel can move this problem's channels-first y or dY."""
    from gemmconv.kernels import triton_available

    return p.device_type == "cuda" and transposed_pixels(p) > 0 and triton_available()


def channels_first_rows(dy: torch.Tensor) -> torch.Tensor:
    """A contiguous channels-first dY [N, K, S..] as new rows [N*prod(S), K], copied by
    the transpose kernel."""
    n, k = dy.shape[:2]
    dy3 = dy.view(n, k, -1)
    return _dy_rows(dy3, 0, n, dy.new_empty(n * dy3.shape[2], k))


def _dy_rows(dy3: torch.Tensor, start: int, count: int, buf: torch.Tensor) -> torch.Tensor:
    """Samples start..start+count of channels-first dY [N, K, P] as rows [count*P, K],
    written into the front of ``buf`` by the transpose kernel."""
    from gemmconv.kernels.strided_copy import strided_copy

    _, k, pixels = dy3.shape
    rows = buf[: count * pixels]
    strided_copy(rows.view(count, pixels, k), dy3[start : start + count].transpose(1, 2))
    return rows


def forward(
    columns: ColumnSource,
    p: ConvProblem,
    x: torch.Tensor,
    wm: torch.Tensor,
    bias: torch.Tensor | None,
    y3: torch.Tensor,
) -> torch.Tensor | None:
    """y3 [N, K, P] (channels-first y) = conv(x), from the weight rows ``wm`` [K, ld];
    returns the column matrix of the whole batch where one pass made it."""
    from gemmconv.kernels.strided_copy import strided_copy

    ld = wm.shape[1]
    pixels, step = transposed_pixels(p), chunk_samples(p, ld)
    wt = wm.t()
    col_buf = x.new_empty(step * pixels, ld)
    y_buf = x.new_empty(step * pixels, p.k)
    for start in range(0, p.n, step):
        count = min(step, p.n - start)
        col = columns.gather(x[start : start + count], p, ld, out=col_buf[: count * pixels])
        rows = y_buf[: count * pixels]
        if bias is None:
            torch.mm(col, wt, out=rows)
        else:
            torch.addmm(bias, col, wt, out=rows)
        strided_copy(y3[start : start + count].transpose(1, 2), rows.view(count, pixels, p.k))
    return col_buf if step >= p.n else None


def backward_data(
    columns: ColumnSource, p: ConvProblem, dy3: torch.Tensor, wm: torch.Tensor, dx: torch.Tensor
) -> None:
    """The patch positions of dx from channels-first dY [N, K, P] and ``wm`` [K, ld]."""
    ld = wm.shape[1]
    pixels, step = transposed_pixels(p), chunk_samples(p, ld)
    dy_buf = dy3.new_empty(step * pixels, p.k)
    dcol_buf = dy3.new_empty(step * pixels, ld)
    for start in range(0, p.n, step):
        count = min(step, p.n - start)
        dy_rows = _dy_rows(dy3, start, count, dy_buf)
        dcol = torch.mm(dy_rows, wm, out=dcol_buf[: count * pixels])
        columns.scatter(dcol, p, dx[start : start + count])


def weight_gradient_rows(
    columns: ColumnSource, p: ConvProblem, x: torch.Tensor, dy3: torch.Tensor, ld: int
) -> torch.Tensor:
    """dW as [K, ld] rows in the column order, from x and channels-first dY [N, K, P];
    fp32 where chunk products of half-precision operands were summed."""
    pixels, step = transposed_pixels(p), chunk_samples(p, ld)
    col_buf = x.new_empty(step * pixels, ld)
    dy_buf = dy3.new_empty(step * pixels, p.k)
    # Chunk products are summed in fp32 (half types: cuBLAS's fp32 result, not a
    # rounded one) or in the dtype itself; one chunk is one GEMM, rounded once.
    half = p.dtype in (torch.float16, torch.bfloat16)
    total = None
    for start in range(0, p.n, step):
        count = min(step, p.n - start)
        col = columns.gather(x[start : start + count], p, ld, out=col_buf[: count * pixels])
        dy_rows = _dy_rows(dy3, start, count, dy_buf)
        if step >= p.n or not half:
            part = torch.mm(dy_rows.t(), col)
        else:
            part = _fp32_product(dy_rows.t(), col)
        total = part if total is None else total.add_(part)
    return total
