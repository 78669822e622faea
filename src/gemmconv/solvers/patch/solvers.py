"""The patch-class solvers, each a choice of strategies over the shared mapping."""

from __future__ import annotations

import math

import torch

from gemmconv.core.device_rates import DeviceRates
from gemmconv.core.problem import ConvProblem
from gemmconv.solvers.base import chunked_form_reasons
from gemmconv.solvers.patch.column_gemm import ChannelsFirst, ColumnGemmSolver
from gemmconv.solvers.patch.columns import TORCH_COPY_COLUMNS, TRITON_COPY_COLUMNS, VIEW_COLUMNS
from gemmconv.solvers.patch.implicit import ImplicitGemmSolver
from gemmconv.solvers.patch.mapping import padded_reduction


class PatchSolver(ColumnGemmSolver):
    """Columns as a view of x where its memory allows, else torch's copy; one GEMM."""

    id = "patch"
    columns = VIEW_COLUMNS
    # Its forward runs the invariant GEMM (solvers/invariant.py) on either device.
    batch_invariant_devices = frozenset({"cpu", "cuda"})
    # Its columns are a view or torch's copy: under the switch on CUDA only the chunks'
    # operands meet the 32-bit limit.
    chunked_invariant_operands = True


class PointOutputSolver(PatchSolver):
    """The patch mapping restricted to one output pixel per sample (x spatial in
    [R, 2R-1]). With x spatial == R it runs with no copy in any direction: col and
    dx are x's and dx's own memory viewed as [N, Kred]."""

    id = "point_output"

    def strategy_reasons(self, p: ConvProblem) -> list[str]:
        if math.prod(p.output_spatial) == 1:
            return []
        return [
            f"output spatial {p.output_spatial} is not all ones "
            f"(input {p.spatial} not within [kernel, 2*kernel-1])"
        ]


class PaddedPatchSolver(ColumnGemmSolver):
    """An explicit column buffer padded to 16-byte rows, filled by torch's copy.

    Where the column matrix is copied anyway, padding costs nothing extra; where it
    would be a zero-copy view (point-output), the padded copy costs a pass over x
    that the faster GEMM may or may not repay: a separate solver, so that find and
    the cost model decide."""

    id = "patch_padded"
    columns = TORCH_COPY_COLUMNS
    pads_reduction = True

    def strategy_reasons(self, p: ConvProblem) -> list[str]:
        if padded_reduction(p) != p.gemm_k:
            return []
        return [f"reduction {p.gemm_k} x {p.element_size} bytes is already 16-byte aligned"]

    def invariance_reasons(self, p: ConvProblem) -> list[str]:
        # Its zero columns change the GEMM's reduction length, and so the library's
        # blocking of it: where the unpadded solvers also apply, which one a batch size
        # chose would change the bits.
        return [f"its padded reduction ({padded_reduction(p)} for {p.gemm_k}) is summed "
                "otherwise than the unpadded solvers'"]  # fmt: skip

    def estimate_ms(self, p: ConvProblem, rates: DeviceRates | None = None) -> float:
        estimate = super().estimate_ms(p, rates)
        if p.device_type != "cuda":
            # The alignment cliff is a GPU GEMM property: on the CPU padding only
            # adds its copy, so never rank this ahead of the unpadded mapping there.
            estimate += PatchSolver().estimate_ms(p, rates)
        return estimate


class TritonPatchSolver(ColumnGemmSolver):
    """The padded column buffer filled by one Triton pass (torch's copy through a
    permuted view ran at a third of a plain copy's rate on an H200); padded only where
    the reduction is unaligned. Channels-first y and dY go through rows where the
    per-sample bmm would be unaligned."""

    id = "patch_triton"
    devices = frozenset({"cuda"})
    # Its forward runs CUDA's invariant GEMM on its padded columns, which are already
    # that GEMM's canonical rows (solvers/invariant.py): the same bits as patch's. Its
    # Triton gather keeps the 32-bit limit; where a batch exceeds it, patch serves.
    batch_invariant_devices = frozenset({"cuda"})

    needs_triton = True
    columns = TRITON_COPY_COLUMNS
    pads_reduction = True
    channels_first = ChannelsFirst.ROWS

    def strategy_reasons(self, p: ConvProblem) -> list[str]:
        if any(r != 1 for r in p.kernel):
            return []
        # A 1x1 "patch" (stride 1) is the pointwise solvers' job: they need no copy.
        return [f"kernel {p.kernel} is 1x1 (pointwise solvers cover it)"]


class ImplicitPatchSolver(ImplicitGemmSolver):
    id = "patch_implicit"
    dtypes = frozenset({torch.float16, torch.bfloat16, torch.float32})
    devices = frozenset({"cuda"})
    # Triton GEMMs only; the split weight-gradient reduction sums fp32 partials in a
    # fixed order (no atomics), so it is reproducible.
    uses_cublas = False
    # Its forward's tiles and reduction order are fixed by the dtype and the geometry,
    # never by the row count (kernels/patch_gemm.forward_launch), and it has no split-K.
    batch_invariant_devices = frozenset({"cuda"})

    def cuda_invariance_reasons(self, p: ConvProblem) -> list[str]:
        # CUDA's invariant form is this kernel's wherever it is not the chunked cuBLAS
        # GEMM (chunked_form_reasons: half-precision patches, or any problem while
        # cuBLAS is refused).
        if chunked_form_reasons(p):
            return []
        return ["CUDA's batch-invariant form of this problem is the chunked cuBLAS GEMM of "
                "the column and pointwise solvers"]  # fmt: skip
