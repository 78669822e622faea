"""Foreseeing a long command-line run on the CPU, to warn before it starts.

The time is estimated from the problem's flops and conservative CPU rates: the
slowest direction measured, so an estimate errs long rather than short. torch's own
half-precision convolutions are the trap: on a CPU without native bf16/fp16
instructions they fall to kernels one or two orders of magnitude slower than fp32 (on
2-core CPU machines of this project, torch's bf16 weight gradient of the demo case,
9500x3x14x14 -> 1280, 14.3 GFLOP, took 44 s a call, and its fp16 weight gradient ran
at 0.22 GFLOP/s). GPUs are fast enough that no estimate is made there.
"""

from __future__ import annotations

import dataclasses

import torch

from gemmconv.core.problem import ConvProblem

# GFLOP/s of torch's convolution (the vendor path) in its slowest direction.
CPU_VENDOR_GFLOPS = {torch.float32: 4.0, torch.bfloat16: 0.3, torch.float16: 0.2}
# GFLOP/s of a gemmconv solver (a GEMM plus copies) in its slowest direction.
CPU_GEMM_GFLOPS = {torch.float32: 20.0, torch.bfloat16: 10.0, torch.float16: 3.0}
# GFLOP/s of the float64 reference convolution that verification runs.
CPU_REFERENCE_GFLOPS = 5.0

# Runs foreseen to last longer than this get a warning before they start.
LONG_RUN_SECONDS = 60.0


@dataclasses.dataclass(frozen=True)
class Calls:
    """How many convolutions of one problem a run makes, by who computes them."""

    gemm: int = 0  # a gemmconv solver
    vendor: int = 0  # torch's own convolution
    reference: int = 0  # the float64 reference


def cpu_seconds(problem: ConvProblem, calls: Calls) -> float:
    """Foreseen seconds of ``calls`` on ``problem`` on the CPU (0 on other devices)."""
    if problem.device_type != "cpu":
        return 0.0
    gflop = problem.flops() / 1e9
    return gflop * (
        calls.gemm / CPU_GEMM_GFLOPS.get(problem.dtype, CPU_REFERENCE_GFLOPS)
        + calls.vendor / CPU_VENDOR_GFLOPS.get(problem.dtype, CPU_REFERENCE_GFLOPS)
        + calls.reference / CPU_REFERENCE_GFLOPS
    )


def long_run_warning(seconds: float, how_to_shorten: str) -> str | None:
    """A one-line warning when ``seconds`` is over LONG_RUN_SECONDS, else None."""
    if seconds <= LONG_RUN_SECONDS:
        return None
    return (
        f"warning: this run may take up to {duration_text(seconds)} on the CPU (estimated "
        f"from its flops at the slowest CPU rates measured); {how_to_shorten}"
    )


def duration_text(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


__all__ = ["Calls", "LONG_RUN_SECONDS", "cpu_seconds", "duration_text", "long_run_warning"]
