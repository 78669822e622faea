"""Patch class as implicit GEMMs in Triton: no column buffer, no copies of x, y or dY.

All three directions run gemmconv.kernels.patch_gemm, which gathers the patches
inside the GEMM's loads (in the problem's column order), masks the unaligned
reduction tail instead of padding it, stores y in the requested layout with the bias
fused, scatters dx in the backward-data epilogue, and splits the weight gradient's
reduction into fp32 partials.
"""

from __future__ import annotations

import math

import torch

from gemmconv.core.device_rates import DeviceRates, rates_for
from gemmconv.core.precision import convolutions_allow_tf32
from gemmconv.core.problem import ConvProblem, Direction
from gemmconv.kernels import SPLIT_PROGRAMS_PER_SM, split_programs
from gemmconv.solvers.base import ConvTensors, gemm_flop_ms
from gemmconv.solvers.patch import implicit_prepared
from gemmconv.solvers.patch.cost import gathered_run_bytes
from gemmconv.solvers.patch.family import PatchFamilySolver
from gemmconv.solvers.patch.mapping import (
    channels_last_columns,
    column_layout,
    covered_extent,
    patches_are_views,
)
from gemmconv.solvers.views import result_buffer, store_weight_rows, weight_rows, zero_outside

# Fraction of cuBLAS's matrix rate the Triton GEMM with gathered A loads reaches on
# long contiguous runs and a 16-byte-aligned reduction: 0.47-0.54 on an H200
# (tests/data/h200_suite.json: ViT-B/16, SAM ViT-H and VideoMAE channels-last
# forward, 0.14-0.18 ms for 0.08 ms of cuBLAS-rate flops); fitted to those rows. An
# unaligned reduction costs the device's unaligned_slowdown as for cuBLAS (masked
# tails, no 16-byte loads: CLIP-L/14 and point 2D, C*R = 588, ran 0.13-0.16).
IMPLICIT_GEMM_EFFICIENCY = 0.5
# The split weight-gradient kernel reached 3-4% of the bf16 matrix rate on an H200
# (same file: ViT-B/16 1.73 ms, CLIP-L/14 3.83 ms, point 3D 1.22 ms for 0.04-0.11 ms
# of cuBLAS-rate flops); fitted to those rows.
IMPLICIT_WGRAD_EFFICIENCY = 0.035
# Gathered loads reached the rates above only on contiguous runs of this many bytes;
# shorter runs waste the rest of each memory transaction. Fitted to the same file:
# channels-first rows (runs of R bytes) ran at 0.3-0.6x of their channels-last twins
# (runs of R*C), ViT-B/16 (32-byte runs) at 0.6x, DiT-XL/2 (4-byte runs) at 0.5x.
FULL_RATE_RUN_BYTES = 64
# Its forward stores the output tile by tile at about 1.4 TB/s on an H200, 3x slower
# than a plain copy (tests/data/h200_suite.json: DiT-XL/2 channels-last forward
# wrote its 151 MB output in 0.105 ms); fitted to that row.
IMPLICIT_OUTPUT_STORE_SLOWDOWN = 3.0
# One dense patch a sample (point 2D and 3D) runs the kernels' whole-row path: no index
# map, each row loaded in vectors of its alignment (kernels/patch_gemm.py). In the H200
# suite at 22a735c (tests/data/h200_suite.json) point 2D bf16, 588-element rows in
# 8-byte vectors, ran its forward in 56 us, backward-data in 45 and the weight
# gradient in 73; point 3D, 16-byte vectors, 107, 83 and 119-131: these fractions of
# the table's matrix rate reproduce them (an H100 reached 0.29-0.38 of its measured
# rate, bench/results/whole_row_h100.txt).
WHOLE_ROW_EFFICIENCY = {
    Direction.FORWARD: 0.35,
    Direction.BACKWARD_DATA: 0.45,
    Direction.BACKWARD_WEIGHTS: 0.32,
}
# Rows whose vectors would be narrower than this were not measured: they keep the
# device's unaligned slowdown.
WHOLE_ROW_MEASURED_VECTOR_BYTES = 8


def _costed_programs(rates: DeviceRates) -> int:
    """The programs the cost model assumes: by the rates' multiprocessor count, or
    where they carry none, as on the device this process runs kernels on."""
    if rates.multiprocessors is not None:
        return SPLIT_PROGRAMS_PER_SM * rates.multiprocessors
    return split_programs(torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def _whole_rows_in_measured_vectors(p: ConvProblem) -> bool:
    """Whether the whole-row path loads ``p``'s rows in vectors as wide as those measured
    (the largest power of two dividing a row's bytes, up to 16)."""
    row_bytes = p.gemm_k * p.element_size
    return patches_are_views(p) and row_bytes % WHOLE_ROW_MEASURED_VECTOR_BYTES == 0


class ImplicitGemmSolver(PatchFamilySolver):
    needs_triton = True

    # ---- cost ---------------------------------------------------------------

    def triton_launches(self, p: ConvProblem) -> int:
        return self.gemm_launches(p)  # its GEMM is a Triton kernel

    def host_launches(self, p: ConvProblem) -> int:
        # The weight gradient also sums its fp32 partials and rounds them into dW.
        extra = 2 if p.direction is Direction.BACKWARD_WEIGHTS else 0
        return super().host_launches(p) + extra

    def _partials_bytes(self, p: ConvProblem, rates: DeviceRates) -> int:
        """The weight gradient's fp32 partials and their sum."""
        if p.direction is not Direction.BACKWARD_WEIGHTS:
            return 0
        from gemmconv.kernels.patch_gemm import wgrad_splits

        splits = wgrad_splits(p.gemm_m, p.k, p.gemm_k, p.dtype, _costed_programs(rates))
        return (splits + 1) * p.k * p.gemm_k * 4

    def workspace_bytes(self, p: ConvProblem) -> int:
        return self._partials_bytes(p, rates_for(p.device_type))

    def copied_bytes(self, p: ConvProblem) -> int:
        # The fp32 partials are written once and read once by their sum.
        return 2 * self.workspace_bytes(p)

    def efficiency(self, p: ConvProblem) -> float:
        """Fraction of the device's matrix rate the Triton kernel reaches."""
        if patches_are_views(p):
            return WHOLE_ROW_EFFICIENCY[p.direction]
        if p.direction is Direction.BACKWARD_WEIGHTS:
            base = IMPLICIT_WGRAD_EFFICIENCY
        else:
            base = IMPLICIT_GEMM_EFFICIENCY
        return base * min(1.0, gathered_run_bytes(p) / FULL_RATE_RUN_BYTES)

    def estimate_ms(self, p: ConvProblem, rates: DeviceRates | None = None) -> float:
        rates = rates or rates_for(p.device_type)
        flop_ms = gemm_flop_ms(p, rates) / self.efficiency(p)
        if not (self.gemm_is_aligned(p) or _whole_rows_in_measured_vectors(p)):
            flop_ms *= rates.unaligned_slowdown
        moved = p.min_bytes()
        if p.direction is Direction.FORWARD:
            output_bytes = math.prod(p.output_shape) * p.element_size
            moved += (IMPLICIT_OUTPUT_STORE_SLOWDOWN - 1.0) * output_bytes
        byte_ms = moved / rates.bytes_per_ms()
        extra_ms = 2 * self._partials_bytes(p, rates) / rates.bytes_per_ms()
        launches = 2 if p.direction is Direction.BACKWARD_WEIGHTS else 1
        return max(flop_ms, byte_ms) + extra_ms + launches * rates.launch_us / 1000.0

    # ---- the three directions ----------------------------------------------

    def prepare(self, p: ConvProblem, tensors: ConvTensors):
        return implicit_prepared.prepare(self, p, tensors)

    def forward(self, p: ConvProblem, t: ConvTensors, out: torch.Tensor | None) -> torch.Tensor:
        from gemmconv.kernels.patch_gemm import patch_gemm_forward

        y = result_buffer(p, t.input, out)
        wm = weight_rows(t.weight, column_layout(p)).contiguous()
        return patch_gemm_forward(t.input, wm, t.bias, p.kernel, channels_last_columns(p), out=y,
                                  allow_tf32=convolutions_allow_tf32())  # fmt: skip

    def backward_data(
        self, p: ConvProblem, t: ConvTensors, out: torch.Tensor | None
    ) -> torch.Tensor:
        from gemmconv.kernels.patch_gemm import patch_gemm_backward_data

        dx = result_buffer(p, t.grad_output, out)
        zero_outside(dx, covered_extent(p))
        wm = weight_rows(t.weight, column_layout(p)).contiguous()
        return patch_gemm_backward_data(t.grad_output, wm, p.kernel, channels_last_columns(p),
                                        dx, allow_tf32=convolutions_allow_tf32())  # fmt: skip

    def backward_weights(
        self, p: ConvProblem, t: ConvTensors, out: torch.Tensor | None
    ) -> torch.Tensor:
        from gemmconv.kernels.patch_gemm import patch_gemm_weight_grad, wgrad_splits

        x = t.input
        dw = result_buffer(p, x, out)
        splits = wgrad_splits(p.gemm_m, p.k, p.gemm_k, p.dtype, split_programs(x.device))
        rows32 = patch_gemm_weight_grad(t.grad_output, x, p.kernel, channels_last_columns(p),
                                        splits, allow_tf32=convolutions_allow_tf32())  # fmt: skip
        store_weight_rows(dw, rows32, column_layout(p))  # the copy rounds to dW's dtype
        return dw
