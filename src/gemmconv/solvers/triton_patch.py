"""Patch class with the permutation done by one Triton pass (gemmconv.kernels.patch_permute).

The same mapping as patch_padded (column buffer padded to a 16-byte reduction, one
cuBLAS GEMM), but the gather x -> col and the scatter dcol -> dx each run as one
kernel that reads through x's strides and writes the dense side in full rows, with
the zero padding written in the same pass. torch's copy through a permuted view
ran at 1.2 TB/s on an H200, a third of a plain copy; this kernel aims at the copy rate.
Padding is applied only when the reduction is unaligned; aligned problems (ViT-B/16,
Kred = 768) still gain the faster gather.

Channels-first tensors with several pixels per sample meet the GEMM transposed
(y and dY are [N, K, P]). The torch solvers handle that with a Y^T-per-sample bmm,
whose leading dimension is P: with P x element size not a multiple of 16 bytes
(ViT-B/16: P = 196) cuBLAS falls off its fast kernels; and the weight gradient copies
dY to rows through torch's transposed copy. Here both go through one row-major GEMM
and the tiled transpose kernel (kernels/strided_copy.py) instead, sample chunk by chunk
so that the buffers together stay within one copy of the largest operand.
"""

from __future__ import annotations

import math

import torch

from gemmconv.kernels import triton_available
from gemmconv.memory_format import Layout
from gemmconv.problem import ConvProblem, Direction
from gemmconv.solvers.base import ConvTensors
from gemmconv.solvers.padded_patch import (
    PaddedPatchSolver,
    covered_extent,
    padded_reduction,
    padded_weight_rows,
)
from gemmconv.solvers.patch import (
    batched_gemm_is_unaligned,
    patch_class_reasons,
    patches,
    patches_are_views,
)
from gemmconv.solvers.views import (
    batched_view,
    result_buffer,
    rows_view,
    store_weight_rows,
    try_view,
    zero_outside,
)

# Cost of the kernel's pass relative to a plain device copy of the same bytes: the
# strided side is read in short runs (R elements), so allow a quarter more time.
TRITON_PERMUTE_SLOWDOWN = 1.25
# Its scatter (backward-data), when the contiguous run of a patch row (R elements
# channels-first, R*C channels-last) is not a whole number of 16-byte vectors, stores
# element by element. On an H200 (bench/results/h200.json, torch 2.11) it moved about
# 280 GB/s channels-first, 15x behind a plain copy (point 2D/3D and ConvNeXt downsample
# backward-data rows), and about 1 TB/s channels-last, 4x (point 2D, 84-byte runs);
# fitted to those rows.
TRITON_UNALIGNED_SCATTER_SLOWDOWN = {Layout.CHANNELS_FIRST: 15.0, Layout.CHANNELS_LAST: 4.0}
VECTOR_BYTES = 16
# Point-output rows copied as 8-byte words (pad_rows): 22.4 MB in 11 us on an H200,
# about 2 TB/s against 4.2 for a plain copy (bench/results/h200_levers_layouts_run1.json).
WORD_COPY_SLOWDOWN = 2.0
# The transpose kernel's cost relative to a plain copy of the same bytes.
TRANSPOSE_SLOWDOWN = 1.25
# The batch (grid axis 1) of one transpose launch is a sample count.
MAX_CHUNK_SAMPLES = 65535


def _has_mm_out_dtype() -> bool:
    # torch.mm(..., out_dtype=) exists from torch 2.8 on, for CUDA only: it lets chunked
    # weight-gradient products be summed in fp32 without rounding each to bf16 first.
    return hasattr(torch.ops.aten.mm, "dtype")


def _fp32_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of half-precision operands, returned in fp32 without an fp16/bf16 rounding."""
    if a.is_cuda and _has_mm_out_dtype():
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())  # the CPU (interpreter tests): no out_dtype there


def _patch_rows_view(t: torch.Tensor, p: ConvProblem) -> torch.Tensor | None:
    """``t`` as its column matrix [N, Kred] without a copy, where patches are whole
    samples (point-output, nothing cropped) and t's memory is in the column order."""
    if not patches_are_views(p):
        return None
    return try_view(patches(t, p), t.shape[0], p.gemm_k)


def _dy_rows(dy3: torch.Tensor, start: int, count: int, buf: torch.Tensor) -> torch.Tensor:
    """Samples start..start+count of channels-first dY [N, K, P] as rows [count*P, K],
    written into the front of ``buf`` by the transpose kernel."""
    from gemmconv.kernels.strided_copy import strided_copy

    _, k, pixels = dy3.shape
    rows = buf[: count * pixels]
    strided_copy(rows.view(count, pixels, k), dy3[start : start + count].transpose(1, 2))
    return rows


def transposed_pixels(p: ConvProblem) -> int:
    """Pixels per sample when the channels-first rows path applies, else 0."""
    pixels = math.prod(p.output_spatial)
    return pixels if p.layout is Layout.CHANNELS_FIRST and pixels > 1 else 0


def uses_rows_path(p: ConvProblem) -> bool:
    """Whether a direction runs through the row-major GEMM and the transpose kernel:
    the channels-first weight gradient always (it copies dY to rows either way), the
    forward and backward-data only when the per-sample bmm would have an unaligned
    leading dimension (P x element size not a multiple of 16 bytes)."""
    if p.direction is Direction.BACKWARD_WEIGHTS:
        return transposed_pixels(p) > 0
    return batched_gemm_is_unaligned(p)


def chunk_samples(p: ConvProblem) -> int:
    """Samples per chunk of the rows path: its two buffers (column rows and dY or y
    rows) together hold at most one copy of the largest operand."""
    ld = padded_reduction(p)
    per_sample = transposed_pixels(p) * (ld + p.k) * p.element_size
    # What else the direction holds meanwhile: the padded weight, and for the weight
    # gradient an fp32 running sum and one fp32 chunk product.
    fixed = p.k * ld * (p.element_size + 8)
    fit = max(1, (p.largest_operand_bytes() - fixed) // max(per_sample, 1))
    half = p.dtype in (torch.float16, torch.bfloat16)
    if p.direction is Direction.BACKWARD_WEIGHTS and half and not _has_mm_out_dtype():
        fit = p.n  # chunk sums would round to the dtype in between: keep one GEMM
    return min(p.n, fit, MAX_CHUNK_SAMPLES)


class TritonPatchSolver(PaddedPatchSolver):
    id = "patch_triton"
    devices = frozenset({"cuda"})

    def problem_reasons(self, p: ConvProblem) -> list[str]:
        reasons = patch_class_reasons(p)
        if all(r == 1 for r in p.kernel):
            # A 1x1 "patch" (stride 1) is the pointwise solvers' job: they need no copy.
            reasons.append(f"kernel {p.kernel} is 1x1 (pointwise solvers cover it)")
        if not triton_available():
            reasons.append("triton is not installed")
        return reasons

    def permute_slowdown(self, p: ConvProblem) -> float:
        if patches_are_views(p):
            return WORD_COPY_SLOWDOWN
        if p.direction is Direction.BACKWARD_DATA:
            run = p.kernel[-1] * p.element_size
            if p.layout is Layout.CHANNELS_LAST:
                run *= p.c
            if run % VECTOR_BYTES:
                return TRITON_UNALIGNED_SCATTER_SLOWDOWN[p.layout]
        return TRITON_PERMUTE_SLOWDOWN

    def _dy_rows_copied(self, p: ConvProblem) -> bool:
        return False  # the rows path's dY rows are counted below, chunk-sized

    def workspace_bytes(self, p: ConvProblem) -> int:
        if not uses_rows_path(p):
            return super().workspace_bytes(p)
        pixels = chunk_samples(p) * transposed_pixels(p)
        return pixels * (padded_reduction(p) + p.k) * p.element_size

    def copied_bytes(self, p: ConvProblem) -> int:
        moved = super().copied_bytes(p)
        if uses_rows_path(p):
            # y or dY crosses between rows and channels-first once, read and written.
            moved += int(2 * p.gemm_m * p.k * p.element_size * TRANSPOSE_SLOWDOWN)
        return moved

    def gemm_is_aligned(self, p: ConvProblem) -> bool:
        return True  # padded reduction; an unaligned bmm is replaced by the rows path

    def gemm_launches(self, p: ConvProblem) -> int:
        if not uses_rows_path(p):
            return super().gemm_launches(p)
        return 3 * -(-p.n // chunk_samples(p))  # gather or scatter, GEMM, transpose

    # ---- the two data movements (Triton) ------------------------------------

    def gather(
        self, x: torch.Tensor, p: ConvProblem, ld: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        from gemmconv.kernels.patch_permute import gather_patches
        from gemmconv.kernels.strided_copy import pad_rows

        col = x.new_empty(x.shape[0] * math.prod(p.output_spatial), ld) if out is None else out
        x_rows = _patch_rows_view(x, p)
        if x_rows is not None:
            # Point-output: every row of col is a whole row of x. Copied in 8-byte words
            # (a 588-element bf16 row is 147 of them) instead of 2-byte patch runs.
            return pad_rows(col, x_rows)
        channels_last = p.layout is Layout.CHANNELS_LAST
        return gather_patches(x, p.output_spatial, p.kernel, channels_last, out=col)

    def scatter(self, dcol: torch.Tensor, p: ConvProblem, dx: torch.Tensor) -> None:
        from gemmconv.kernels.patch_permute import scatter_patches
        from gemmconv.kernels.strided_copy import pad_rows

        dx_rows = _patch_rows_view(dx, p)
        if dx_rows is not None:
            pad_rows(dx_rows, dcol[:, : p.gemm_k])
            return
        channels_last = p.layout is Layout.CHANNELS_LAST
        scatter_patches(dcol, p.output_spatial, p.kernel, channels_last, dx)

    # ---- channels-first through rows ----------------------------------------

    def forward(self, p: ConvProblem, t: ConvTensors, out: torch.Tensor | None) -> torch.Tensor:
        y = result_buffer(p, t.input, out)
        y3 = batched_view(y)
        if not uses_rows_path(p) or y3 is None or rows_view(y) is not None:
            return super().forward(p, t, out=y)
        from gemmconv.kernels.strided_copy import strided_copy

        ld, pixels, step = padded_reduction(p), transposed_pixels(p), chunk_samples(p)
        wt = padded_weight_rows(t.weight, p.layout, ld).t()
        col_buf = t.input.new_empty(step * pixels, ld)
        y_buf = t.input.new_empty(step * pixels, p.k)
        for start in range(0, p.n, step):
            count = min(step, p.n - start)
            col = self.gather(t.input[start : start + count], p, ld, out=col_buf[: count * pixels])
            rows = y_buf[: count * pixels]
            if t.bias is None:
                torch.mm(col, wt, out=rows)
            else:
                torch.addmm(t.bias, col, wt, out=rows)
            dest = y3[start : start + count].transpose(1, 2)
            strided_copy(dest, rows.view(count, pixels, p.k))
        return y

    def backward_data(
        self, p: ConvProblem, t: ConvTensors, out: torch.Tensor | None
    ) -> torch.Tensor:
        dy3 = batched_view(t.grad_output)
        if not uses_rows_path(p) or dy3 is None or rows_view(t.grad_output) is not None:
            return super().backward_data(p, t, out)
        dx = result_buffer(p, t.grad_output, out)
        zero_outside(dx, covered_extent(p))
        ld, pixels, step = padded_reduction(p), transposed_pixels(p), chunk_samples(p)
        wp = padded_weight_rows(t.weight, p.layout, ld)
        dy_buf = t.grad_output.new_empty(step * pixels, p.k)
        dcol_buf = t.grad_output.new_empty(step * pixels, ld)
        for start in range(0, p.n, step):
            count = min(step, p.n - start)
            dy_rows = _dy_rows(dy3, start, count, dy_buf)
            dcol = torch.mm(dy_rows, wp, out=dcol_buf[: count * pixels])
            self.scatter(dcol, p, dx[start : start + count])
        return dx

    def backward_weights(
        self, p: ConvProblem, t: ConvTensors, out: torch.Tensor | None
    ) -> torch.Tensor:
        dy3 = batched_view(t.grad_output)
        if not uses_rows_path(p) or dy3 is None or rows_view(t.grad_output) is not None:
            return super().backward_weights(p, t, out)
        dw = result_buffer(p, t.input, out)
        ld, pixels, step = padded_reduction(p), transposed_pixels(p), chunk_samples(p)
        col_buf = t.input.new_empty(step * pixels, ld)
        dy_buf = t.grad_output.new_empty(step * pixels, p.k)
        # Chunk products are summed in fp32 (half types: cuBLAS's fp32 result, not a
        # rounded one) or in the dtype itself; one chunk is one GEMM, rounded once.
        half = p.dtype in (torch.float16, torch.bfloat16)
        total = None
        for start in range(0, p.n, step):
            count = min(step, p.n - start)
            col = self.gather(t.input[start : start + count], p, ld, out=col_buf[: count * pixels])
            dy_rows = _dy_rows(dy3, start, count, dy_buf)
            if step >= p.n or not half:
                part = torch.mm(dy_rows.t(), col)
            else:
                part = _fp32_product(dy_rows.t(), col)
            total = part if total is None else total.add_(part)
        store_weight_rows(dw, total[:, : p.gemm_k].to(dw.dtype), p.layout)
        return dw
