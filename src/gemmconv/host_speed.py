"""How fast this process's host issues gemmconv's work to a CUDA device: the host time of
one prepared Triton launch, by which the cost table scales its host costs
(gemmconv.device_rates).

The launch is ViT-B/16's patch gather at batch 2 (1.2 MB moved, a few microseconds of
device time, below its host time on every host measured), so a stream of back-to-back
launches times the host; its geometry is not specialised, so the kernel compiled for it
serves every patch gather of the process. A Triton launch, not a torch op: hosts of one
GPU kind differ by 2x in it while a torch op's cost barely moves (an H100 host: a
direct launch 17.7 us, a torch copy of the same bytes 9.6; an H200 host 9.0 and 10.3,
``bench/results/launch_cost_*.txt``), and the solvers' Python path to their launches
follows the launch (point 2D's patch_triton forward 0.121 ms a call on that H100, 0.065
on an H200 host like the second).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

WARMUP_CALLS = 20
CALLS = 200
REPS = 5


def reference_launch(device: torch.device) -> Callable[[], None]:
    """The reference launch on ``device``, its operands allocated once."""
    from gemmconv.kernels.patch_permute import gather_patches

    images = torch.zeros(2, 3, 224, 224, device=device, dtype=torch.bfloat16)
    columns = torch.empty(2 * 14 * 14, 768, device=device, dtype=torch.bfloat16)

    def op() -> None:
        gather_patches(images, (14, 14), (16, 16), False, out=columns)

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


def measure_reference_launch_us(index: int = 0) -> float:
    """Host microseconds of one reference launch on CUDA device ``index`` (about 10 ms,
    and the gather kernel's compilation where Triton's cache does not hold it)."""
    device = torch.device("cuda", index)
    return per_call_us(reference_launch(device), device)


__all__ = ["reference_launch", "measure_reference_launch_us", "per_call_us"]
