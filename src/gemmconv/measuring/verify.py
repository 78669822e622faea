"""Verification against a float64 reference, after MIOpen's driver.

Error is MIOpen's rms_range: ||a - b||_2 / (sqrt(n) * max(|a|max, |b|max)). A result
passes when its error is within the dtype's tolerance and no more than twice the
vendor convolution's error on the same inputs. That ratio only counts above one
unit roundoff of the format the GEMM computes in: below it both errors are rounding
noise (measured on an H200: cuBLAS fp32 GEMMs at 0.5-0.7 eps where cuDNN's weight
gradient reached 0.2-0.3 eps, and with TF32 allowed cuDNN often picks a full-fp32
algorithm while a GEMM uses TF32). NaN or Inf where the reference is finite never
passes.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from gemmconv.core.precision import convolutions_allow_tf32
from gemmconv.core.problem import ConvProblem, Direction, dtype_name
from gemmconv.solvers import ConvTensors
from gemmconv.solvers.vendor import VendorSolver

# Unit roundoff of each format; TF32 keeps fp16's 10 mantissa bits.
EPSILON = {
    torch.float16: 2.0**-10,
    torch.bfloat16: 2.0**-7,
    torch.float32: 2.0**-23,
    torch.float64: 2.0**-52,
}
TF32_EPSILON = 2.0**-10

# Allowed rms_range as a multiple of epsilon. fp16/bf16 results are rounded once at
# the end (fp32 accumulation), which costs well under one epsilon; fp32 and fp64
# accumulate rounding over the reduction, which grows like sqrt(Kred).
TOLERANCE_EPS = {
    torch.float16: 1.0,
    torch.bfloat16: 1.0,
    torch.float32: 16.0,
    torch.float64: 4096.0,
}
VENDOR_RATIO = 2.0
# The vendor ratio applies to errors above this many unit roundoffs (see above).
FLOOR_EPS = 1.0


def effective_epsilon(dtype: torch.dtype, device_type: str) -> float:
    if dtype == torch.float32 and device_type == "cuda" and convolutions_allow_tf32():
        return TF32_EPSILON
    return EPSILON[dtype]


def tolerance(dtype: torch.dtype, device_type: str) -> float:
    if dtype == torch.float32 and device_type == "cuda" and convolutions_allow_tf32():
        return TF32_EPSILON
    return TOLERANCE_EPS[dtype] * EPSILON[dtype]


def rms_range(a: torch.Tensor, b: torch.Tensor) -> float:
    # Computed in float64 on a's device: large GPU results are not copied to the host.
    a64 = a.detach().to(dtype=torch.float64)
    b64 = b.detach().to(device=a64.device, dtype=torch.float64)
    if a64.shape != b64.shape:
        raise ValueError(f"shapes differ: {tuple(a64.shape)} vs {tuple(b64.shape)}")
    if a64.numel() == 0:
        return 0.0
    if not torch.isfinite(a64).all() or not torch.isfinite(b64).all():
        return math.inf
    scale = max(a64.abs().max().item(), b64.abs().max().item())
    if scale == 0.0:
        return 0.0
    return (torch.linalg.vector_norm(a64 - b64) / (math.sqrt(a64.numel()) * scale)).item()


def reference(
    problem: ConvProblem, tensors: ConvTensors, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The direction's result in float64 from the same (rounded) inputs, computed by the
    vendor path on ``device`` (the CPU by default; the GPU's own float64 convolution
    for problems too large for the host), on channels-first copies: torch 2.14's CPU
    float64 weight gradient of a grouped channels-last problem whose size-1 spatial
    dimension has a stride out of order swapped kernel taps (a randomized property-test
    run found it; channels-first operands were right)."""
    device = torch.device(device)

    def f64(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        wide = torch.empty(t.shape, dtype=torch.float64, device=device)
        return wide.copy_(t.detach())  # one copy, channels-first whatever t's strides

    wide = dataclasses.replace(problem, dtype=torch.float64, device_type=device.type)
    t64 = ConvTensors(
        input=f64(tensors.input),
        weight=f64(tensors.weight),
        bias=f64(tensors.bias),
        grad_output=f64(tensors.grad_output),
    )
    return VendorSolver().run(wide, t64)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The outcome of a verification: ``ok``, the result's rms_range ``error``, the
    ``tolerance`` it was held to, and the vendor's error on the same inputs."""

    ok: bool
    error: float
    tolerance: float
    vendor_error: float | None

    def __str__(self) -> str:
        detail = f"rms={self.error:.3g}, tol={self.tolerance:.3g}"
        if self.vendor_error is not None:
            detail += f", vendor rms={self.vendor_error:.3g}"
        return f"Verifies OK ({detail})" if self.ok else f"FAILED ({detail})"


def judge(
    problem: ConvProblem,
    result: torch.Tensor,
    ref: torch.Tensor,
    vendor_result: torch.Tensor | None = None,
) -> Verdict:
    """Compare a result with the reference (and the vendor's result when given)."""
    error = rms_range(result, ref)
    tol = tolerance(problem.dtype, problem.device_type)
    vendor_error = None if vendor_result is None else rms_range(vendor_result, ref)
    ok = error <= tol
    if vendor_error is not None:
        floor = FLOOR_EPS * effective_epsilon(problem.dtype, problem.device_type)
        ok = ok and error <= max(VENDOR_RATIO * vendor_error, floor)
    return Verdict(ok=ok, error=error, tolerance=tol, vendor_error=vendor_error)


def verify(
    problem: ConvProblem,
    tensors: ConvTensors,
    result: torch.Tensor,
    compare_vendor: bool = True,
) -> Verdict:
    """Check ``result`` of ``problem`` on ``tensors`` against a float64 reference.

    The error is MIOpen's rms_range; the result passes within the dtype's tolerance
    and, with ``compare_vendor``, no more than twice the error of torch's own
    convolution on the same inputs (above one unit roundoff). NaN or Inf where the
    reference is finite never passes. Returns a ``Verdict``; ``str(verdict)`` reads
    ``Verifies OK (rms=..., tol=...)`` or ``FAILED (...)``."""
    ref = reference(problem, tensors)
    vendor_result = VendorSolver().run(problem, tensors) if compare_vendor else None
    return judge(problem, result, ref, vendor_result)


__all__ = [
    "Direction",
    "Verdict",
    "dtype_name",
    "judge",
    "reference",
    "rms_range",
    "tolerance",
    "verify",
]
