"""Channels-first y or dY through one row-major GEMM over pixel rows.

A channels-first y or dY with several pixels per sample meets the GEMM (whose rows
are pixels) transposed: each sample is a [K, P] block. The per-sample bmm that
computes Y^T in y's own order has P as its leading dimension, and with P x element
size not a multiple of 16 bytes (ViT-B/16: P = 196) cuBLAS falls off its fast
kernels; the weight gradient copies dY to rows through torch's transposed copy.
This path runs one row-major GEMM on rows instead: cuBLAS's, on rows moved to or
from channels-first by the transpose kernel (kernels/strided_copy.py), or, in half
precision, the Triton kernels that write y or read dY in place
(kernels/pixel_rows_gemm.py; in_place says where).
"""

from __future__ import annotations

import dataclasses

import torch

from gemmconv.core.device_rates import DeviceRates, rates_for
from gemmconv.core.problem import ConvProblem, Direction
from gemmconv.solvers.base import gemm_flop_ms
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
# The in-place kernels' GEMM time against cuBLAS's on rows, by direction, where the
# GEMM is bound by its flops (bench/probes/pixel_rows_bench.py on an H100, bench/NOTES.md):
# the forward 1.35-1.66x (1.45 on ViT-B/16's rows at batch 256), backward-data
# 1.25-1.71x (1.66 on ViT-B/16's), the weight gradient 1.71-3.11x with its split
# count, and CLIP-L/14's at 336 pixels ran 0.95 ms against 0.28 on an H200 (the
# kept-columns bug that ef75e30 fixed) where 2.0 would have sent it in place. Where
# the GEMM is bound by bandwidth they run near cuBLAS's time (DiT-XL/2's weight
# gradient, 16 columns: 1.10x), and the transpose they drop is most of the
# work: dW in 0.076 ms against 0.172 for the transpose and cuBLAS.
IN_PLACE_GEMM_SLOWDOWN = {
    Direction.FORWARD: 1.45,
    Direction.BACKWARD_DATA: 1.66,
    Direction.BACKWARD_WEIGHTS: 3.5,
}
# Below these the in-place kernels lost on CUDA whatever the estimate (the same
# notes): ViT-B/16's forward at batch 64 (12544 rows) 0.065 ms against 0.061, and
# ViT-B/32's (49 pixels, no run longer than one element) 0.19-0.31 against 0.16.
IN_PLACE_MIN_ROWS = 1 << 15
IN_PLACE_MIN_RUN_BYTES = 8
_HALF = (torch.float16, torch.bfloat16)
# The widest pixel run the kernels claim: one 16-byte vector.
_VECTOR_BYTES = 16


def applies(p: ConvProblem) -> bool:
    """Whether a direction runs through rows: the channels-first weight gradient
    always (it copies dY to rows either way), the forward and backward-data only
    where the per-sample bmm would have an unaligned leading dimension."""
    if p.direction is Direction.BACKWARD_WEIGHTS:
        return transposed_pixels(p) > 0
    return batched_gemm_is_unaligned(p)


def in_place(p: ConvProblem) -> bool:
    """Whether the direction's GEMM reads dY or writes y channels-first itself
    (kernels/pixel_rows_gemm.py; the weight gradient's reduction in fp32 slices
    summed in a fixed order): in half precision only, fp32 staying on cuBLAS, whose
    one TF32 pass Triton's accurate fp32 dots (three passes, or plain fp32) do not
    match. On CUDA from IN_PLACE_MIN_ROWS pixel rows whose runs (pixel_run_bytes)
    are at least IN_PLACE_MIN_RUN_BYTES long, where the estimate says the slower
    GEMM costs less than the transpose it saves. Off CUDA (Triton's interpreter, the
    CPU tests) every direction runs in place, so each kernel stays tested."""
    if p.dtype not in _HALF:
        return False
    if p.device_type != "cuda":
        return True
    return (
        p.gemm_m >= IN_PLACE_MIN_ROWS
        and pixel_run_bytes(p) >= IN_PLACE_MIN_RUN_BYTES
        and in_place_is_cheaper(p, rates_for(p.device_type))
    )


def in_place_is_cheaper(p: ConvProblem, rates: DeviceRates) -> bool:
    """Whether the in-place GEMM's estimated time is below cuBLAS's GEMM and the
    transpose, each GEMM bound by its flops or its bytes as in Solver.work_ms."""
    flop_ms = gemm_flop_ms(p, rates)
    byte_ms = p.min_bytes() / rates.bytes_per_ms()
    transpose_ms = 2 * output_rows_bytes(p) * TRANSPOSE_SLOWDOWN / rates.bytes_per_ms()
    in_place_ms = max(flop_ms * IN_PLACE_GEMM_SLOWDOWN[p.direction], byte_ms)
    return in_place_ms < max(flop_ms, byte_ms) + transpose_ms


def pixel_run_bytes(p: ConvProblem) -> int:
    """Bytes of the pixel runs the in-place kernels can claim on a dense
    channels-first y or dY: the largest power of two dividing a sample's pixel
    count, in elements, up to one 16-byte vector."""
    pixels = transposed_pixels(p)
    if pixels <= 0:
        return 0
    return min((pixels & -pixels) * p.dtype.itemsize, _VECTOR_BYTES)


def _row_width(p: ConvProblem, ld: int) -> int:
    """Elements a pixel row takes in the path's buffers: its columns, and its y or dY
    row unless the GEMM reads or writes those in place."""
    return ld if in_place(p) else ld + p.k


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
    per_sample = transposed_pixels(p) * _row_width(p, ld) * p.element_size
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
    return pixels * _row_width(p, ld) * p.element_size


def copied_bytes(p: ConvProblem) -> float:
    """y or dY crosses between rows and channels-first once, read and written, unless
    the GEMM reads or writes it in place (the weight gradient's fp32 slices, a few
    MB where dY is tens, are left out)."""
    return 0.0 if in_place(p) else 2 * output_rows_bytes(p) * TRANSPOSE_SLOWDOWN


def gemm_slowdown(p: ConvProblem) -> float:
    """The path's GEMM time against cuBLAS's on rows."""
    return IN_PLACE_GEMM_SLOWDOWN[p.direction] if in_place(p) else 1.0


def passes(p: ConvProblem, ld: int) -> int:
    """Sample chunks the path walks (one unless its buffers would be too large)."""
    return -(-p.n // chunk_samples(p, ld))


def launches(p: ConvProblem, ld: int) -> int:
    # Per chunk: gather or scatter, GEMM, and the transpose unless the GEMM does it;
    # an in-place weight gradient sums its slices in a third.
    fused = in_place(p) and p.direction is not Direction.BACKWARD_WEIGHTS
    return (2 if fused else 3) * passes(p, ld)


def transpose_kernel_runs(p: ConvProblem) -> bool:
    """Whether the transpose kernel can move this problem's channels-first y or dY."""
    from gemmconv.kernels import triton_available

    return p.device_type == "cuda" and transposed_pixels(p) > 0 and triton_available()


def weight_gradient_reads_dy(p: ConvProblem) -> bool:
    """Whether dW from the kept columns of forward ``p`` reads a dense channels-first
    dY in place (kernels/pixel_rows_gemm.py) where the transpose kernel would copy
    it: as the weight gradient's direction decides, not the forward's."""
    weights = dataclasses.replace(p, direction=Direction.BACKWARD_WEIGHTS)
    return transpose_kernel_runs(p) and in_place(weights)


def in_place_splits(p: ConvProblem, rows: int, ld: int, device: torch.device) -> int:
    """The slices the in-place weight gradient cuts a reduction over ``rows`` into."""
    from gemmconv.kernels import split_programs
    from gemmconv.kernels.pixel_rows_gemm import weight_gradient_splits

    return weight_gradient_splits(rows, p.k, ld, p.dtype, split_programs(device))


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
    rows = _front(buf, count * pixels)
    strided_copy(rows.view(count, pixels, k), _samples(dy3, start, count).transpose(1, 2))
    return rows


def _samples(t: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """Samples start..start+count of ``t``: ``t`` itself where that is all of them (a
    slice is a torch call, and one pass is the usual case)."""
    return t if count == t.shape[0] else t[start : start + count]


def _front(buf: torch.Tensor, rows: int) -> torch.Tensor:
    """The first ``rows`` rows of ``buf``, ``buf`` itself where that is all of them."""
    return buf if rows == buf.shape[0] else buf[:rows]


def forward(
    columns: ColumnSource,
    p: ConvProblem,
    x: torch.Tensor,
    wm: torch.Tensor,
    bias: torch.Tensor | None,
    y3: torch.Tensor,
    step: int | None = None,
    fused: bool | None = None,
) -> torch.Tensor | None:
    """y3 [N, K, P] (channels-first y) = conv(x), from the weight rows ``wm`` [K, ld],
    ``step`` samples a pass (chunk_samples(p, ld) where not given) and the GEMM in
    place where ``fused`` (in_place(p) where not given): a prepared run knows both.
    Returns the column matrix of the whole batch where one pass made it."""
    from gemmconv.kernels.pixel_rows_gemm import rows_into_channels_first
    from gemmconv.kernels.strided_copy import strided_copy

    ld = wm.shape[1]
    pixels, step = transposed_pixels(p), step or chunk_samples(p, ld)
    col_buf = x.new_empty(step * pixels, ld)
    fused = in_place(p) if fused is None else fused
    if not fused:
        wt = wm.t()
        y_buf = x.new_empty(step * pixels, p.k)
    for start in range(0, p.n, step):
        count = min(step, p.n - start)
        col = columns.gather(_samples(x, start, count), p, ld, out=_front(col_buf, count * pixels))
        y_part = _samples(y3, start, count)
        if fused:
            rows_into_channels_first(col, wm, bias, y_part)
            continue
        rows = _front(y_buf, count * pixels)
        if bias is None:
            torch.mm(col, wt, out=rows)
        else:
            torch.addmm(bias, col, wt, out=rows)
        strided_copy(y_part.transpose(1, 2), rows.view(count, pixels, p.k))
    return col_buf if step >= p.n else None


def backward_data(
    columns: ColumnSource,
    p: ConvProblem,
    dy3: torch.Tensor,
    wm: torch.Tensor,
    dx: torch.Tensor,
    step: int | None = None,
    fused: bool | None = None,
) -> None:
    """The patch positions of dx from channels-first dY [N, K, P] and ``wm`` [K, ld],
    ``step`` samples a pass, the GEMM in place where ``fused`` (each as forward's)."""
    from gemmconv.kernels.pixel_rows_gemm import channels_first_into_rows

    ld = wm.shape[1]
    pixels, step = transposed_pixels(p), step or chunk_samples(p, ld)
    dcol_buf = dy3.new_empty(step * pixels, ld)
    fused = in_place(p) if fused is None else fused
    if not fused:
        dy_buf = dy3.new_empty(step * pixels, p.k)
    for start in range(0, p.n, step):
        count = min(step, p.n - start)
        dcol = _front(dcol_buf, count * pixels)
        if fused:
            channels_first_into_rows(_samples(dy3, start, count), wm, dcol)
        else:
            torch.mm(_dy_rows(dy3, start, count, dy_buf), wm, out=dcol)
        columns.scatter(dcol, p, _samples(dx, start, count))


def weight_gradient_rows(
    columns: ColumnSource,
    p: ConvProblem,
    x: torch.Tensor,
    dy3: torch.Tensor,
    ld: int,
    step: int | None = None,
    fused: bool | None = None,
) -> torch.Tensor:
    """dW as [K, ld] rows in the column order, from x and channels-first dY [N, K, P],
    ``step`` samples a pass, the GEMM in place where ``fused`` (each as forward's);
    fp32 where chunk products of half-precision operands were summed."""
    from gemmconv.kernels.pixel_rows_gemm import channels_first_weight_gradient

    pixels, step = transposed_pixels(p), step or chunk_samples(p, ld)
    col_buf = x.new_empty(step * pixels, ld)
    fused = in_place(p) if fused is None else fused
    if fused:
        splits = in_place_splits(p, step * pixels, ld, x.device)
    else:
        dy_buf = dy3.new_empty(step * pixels, p.k)
    # Chunk products are summed in fp32 (half types: cuBLAS's fp32 result, not a
    # rounded one) or in the dtype itself; one chunk is one GEMM, rounded once.
    half = p.dtype in _HALF
    total = None
    for start in range(0, p.n, step):
        count = min(step, p.n - start)
        col = columns.gather(_samples(x, start, count), p, ld, out=_front(col_buf, count * pixels))
        if fused:
            part = x.new_empty(p.k, ld, dtype=p.dtype if step >= p.n else torch.float32)
            channels_first_weight_gradient(_samples(dy3, start, count), col, part, splits)
            total = part if total is None else total.add_(part)
            continue
        dy_rows = _dy_rows(dy3, start, count, dy_buf)
        if step >= p.n or not half:
            part = torch.mm(dy_rows.t(), col)
        else:
            part = _fp32_product(dy_rows.t(), col)
        total = part if total is None else total.add_(part)
    return total
