"""How many device kernels one public call launches (the suite's ``api_kernels``).

The suite's target is at most three launches a direction on every row (gather or
scatter, GEMM, layout): each launch costs the host a few microseconds and the device a
gap, so a call that launches more is slower than its kernels' time says.
A kernel count needs the device's own record, which torch.profiler's CUDA activity
gives: every kernel and memset the call queued, whoever issued it (gemmconv's Triton
launches, cuBLAS, torch's copies, autograd's engine). There is none on the CPU, where
the count is None.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

log = logging.getLogger("gemmconv.kernel_count")

# The suite's target: gather or scatter, GEMM, layout.
MAX_KERNELS = 3
# Kernels cuBLAS runs inside one GEMM call on some shapes, which the call makes as one
# launch: a memset before its cooperative kernels and the split-K sum after. An H100
# ran the rewrite's F.linear with a bias as "Memset (Device)" then the GEMM, and a
# weight gradient as the GEMM then "splitKreduce_kernel" (bench/NOTES.md).
GEMM_HELPER_KERNELS = ("Memset", "splitKreduce")


def device_kernels(events: Iterable[object]) -> list[str]:
    """The names of the kernels (memsets included) among torch.profiler ``events``, in
    their order: those the device ran, as opposed to the host-side records of the same
    call."""
    from torch.autograd import DeviceType

    return [
        str(getattr(e, "name", "?"))
        for e in events
        if getattr(e, "device_type", None) == DeviceType.CUDA
    ]


def launches(names: Iterable[str]) -> int:
    """The launches behind device kernels ``names``: each kernel, except cuBLAS's
    helpers, which belong to the GEMM they came with (GEMM_HELPER_KERNELS)."""
    return sum(1 for n in names if not any(h in n for h in GEMM_HELPER_KERNELS))


def launched_kernels(call: Callable[[], object], device: torch.device) -> list[str] | None:
    """The device kernels one ``call`` launches, by name (it has run before, so nothing
    it compiles or allocates on first use is counted); None off CUDA, or where the
    profiler cannot record the device (it is logged: a count is a report, never a
    reason for a run to fail)."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize(device)
        return device_kernels(prof.events())
    except Exception as e:  # the profiler fails in many ways; a count never fails a row
        log.warning("no kernel count: the profiler failed (%s: %s)", type(e).__name__, e)
        return None


def kernels_per_call(call: Callable[[], object], device: torch.device) -> int | None:
    """How many device kernels one ``call`` launches (launched_kernels); None where
    they are not known."""
    names = launched_kernels(call, device)
    return None if names is None else len(names)


__all__ = [
    "GEMM_HELPER_KERNELS",
    "MAX_KERNELS",
    "device_kernels",
    "kernels_per_call",
    "launched_kernels",
    "launches",
]
