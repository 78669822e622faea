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


def device_kernels(events: Iterable[object]) -> int:
    """The kernels (memsets included) among torch.profiler ``events``: those the device
    ran, as opposed to the host-side records of the same call."""
    from torch.autograd import DeviceType

    return sum(1 for e in events if getattr(e, "device_type", None) == DeviceType.CUDA)


def kernels_per_call(call: Callable[[], object], device: torch.device) -> int | None:
    """The device kernels one ``call`` launches (it has run before, so nothing it
    compiles or allocates on first use is counted); None off CUDA, or where the
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


__all__ = ["MAX_KERNELS", "device_kernels", "kernels_per_call"]
