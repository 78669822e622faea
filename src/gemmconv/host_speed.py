"""How fast this process's host issues work to a CUDA device: the host time of one small
torch op, by which the cost table scales its host costs (gemmconv.device_rates).

The op is a ViT-B/16 patch gather at batch 2 written as a strided torch copy, the one
``scripts/launch_cost.py`` times beside a prepared Triton launch: its device time (1.2 MB
moved) is a few microseconds, below its host time on every host measured, so a stream
of back-to-back calls times the host. Hosts of the same GPU kind differ by about 2x
(bench/NOTES.md), which moves the best solver where host and device time are close.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

WARMUP_CALLS = 20
CALLS = 200
REPS = 5


def host_op(device: torch.device) -> Callable[[], None]:
    """The reference op on ``device``, its operands allocated once."""
    images = torch.zeros(2, 3, 224, 224, device=device, dtype=torch.bfloat16)
    columns = torch.empty(2 * 14 * 14, 768, device=device, dtype=torch.bfloat16)
    patches = images.view(2, 3, 14, 16, 14, 16).permute(0, 2, 4, 1, 3, 5)
    rows = columns.view(2, 14, 14, 3, 16, 16)

    def op() -> None:
        rows.copy_(patches)

    return op


def per_call_us(
    fn: Callable[[], None], device: torch.device, calls: int = CALLS, reps: int = REPS
) -> float:
    """Microseconds per call of ``fn`` in blocks of ``calls`` back-to-back calls, each
    block ended by one synchronisation: the fastest block of ``reps``."""
    for _ in range(WARMUP_CALLS):
        fn()
    torch.cuda.synchronize(device)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def measure_host_op_us(index: int = 0) -> float:
    """Host microseconds of one reference op on CUDA device ``index`` (about 10 ms)."""
    device = torch.device("cuda", index)
    return per_call_us(host_op(device), device)


__all__ = ["host_op", "measure_host_op_us", "per_call_us"]
