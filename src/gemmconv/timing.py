"""Device-correct timing of a callable: warm-up, one measurement per repetition, median.

On CUDA each repetition is bracketed by a pair of events on the current stream, so the
time is the GPU's own time for the kernels the callable launched, each launch counted
once. Between repetitions, outside the timed region, the L2 cache is flushed by
writing a buffer larger than it, so every repetition reads its operands from memory as
a real step of a model would. On the CPU each repetition is timed with
``time.perf_counter`` and nothing is flushed.

On CUDA a spin kernel is queued ahead of each timed repetition, long enough to cover
twice the host time of one call (measured once after the warm-up), so the events see
the device's time and not Python's launch overhead; host time is measured apart
(bench/overhead.py).

``setup`` runs before every repetition (and warm-up call), outside the timed region:
use it to reset an output or rotate inputs.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import torch

# Larger than the L2 of any current GPU (H200: 60 MiB); writing it evicts everything else.
_MIN_FLUSH_BYTES = 256 * 1024 * 1024

_flush_buffers: dict[int, torch.Tensor] = {}


@dataclasses.dataclass(frozen=True)
class Timing:
    """Per-repetition times in milliseconds and their summary."""

    median_ms: float
    min_ms: float
    mean_ms: float
    reps: int
    samples: tuple[float, ...]

    @property
    def total_ms(self) -> float:
        """Time of all timed repetitions together (each launch counted once)."""
        return sum(self.samples)

    @classmethod
    def from_samples(cls, samples: tuple[float, ...]) -> Timing:
        if not samples:
            raise ValueError("samples=(): expected at least one measured repetition")
        return cls(
            median_ms=statistics.median(samples),
            min_ms=min(samples),
            mean_ms=statistics.fmean(samples),
            reps=len(samples),
            samples=tuple(samples),
        )

    def __str__(self) -> str:
        return f"{self.median_ms:.4g} ms (median of {self.reps}, min {self.min_ms:.4g})"


def time_ms(
    fn: Callable[[], object],
    *,
    device: torch.device | str,
    warmup: int = 5,
    reps: int = 25,
    flush_l2: bool = True,
    setup: Callable[[], object] | None = None,
) -> Timing:
    """Time ``fn()`` on ``device``: ``warmup`` untimed calls, then ``reps`` timed ones."""
    if reps < 1:
        raise ValueError(f"reps={reps}: expected at least 1")
    if warmup < 0:
        raise ValueError(f"warmup={warmup}: expected 0 or more")
    device = torch.device(device)
    if device.type == "cuda":
        return _time_cuda(fn, device, warmup, reps, flush_l2, setup)
    if device.type == "cpu":
        return _time_cpu(fn, warmup, reps, setup)
    raise ValueError(f"device={str(device)!r}: expected a cpu or cuda device")


def _time_cpu(
    fn: Callable[[], object], warmup: int, reps: int, setup: Callable[[], object] | None
) -> Timing:
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    samples = []
    for _ in range(reps):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000.0)
    return Timing.from_samples(tuple(samples))


def _time_cuda(
    fn: Callable[[], object],
    device: torch.device,
    warmup: int,
    reps: int,
    flush_l2: bool,
    setup: Callable[[], object] | None,
) -> Timing:
    index = device.index if device.index is not None else torch.cuda.current_device()
    with torch.cuda.device(index):
        flush = _flush_buffer(index) if flush_l2 else None
        for _ in range(warmup):
            if setup is not None:
                setup()
            fn()
        torch.cuda.synchronize()
        spin_cycles = head_start_cycles(_host_seconds(fn, setup))
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(reps)
        ]
        for start, end in events:
            if setup is not None:
                setup()
            if flush is not None:
                flush.zero_()
            # A spin kernel ahead of the timed region lets the host queue fn's launches
            # before the device reaches them, so the events measure device time, not
            # Python launch overhead (which a busy training step hides the same way).
            torch.cuda._sleep(spin_cycles)
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return Timing.from_samples(tuple(start.elapsed_time(end) for start, end in events))


_MIN_HEAD_START_CYCLES = 1_000_000  # about 0.5 ms at the H200's 1.98 GHz
# A bound for a first call that compiles (warmup=0): its host time says nothing.
_MAX_HEAD_START_CYCLES = 40_000_000
# No current GPU clocks its SMs above 2 GHz, so this many cycles last at least as long
# as the host time they are meant to cover.
_CYCLES_PER_SECOND_BOUND = 2.0e9


def head_start_cycles(host_seconds: float) -> int:
    """Spin cycles that cover twice ``host_seconds`` of launching, within bounds.

    A fixed 0.5 ms head start was not enough: patch_triton's channels-first rows path
    takes 0.5-0.95 ms of host time per call on the H200's host against 0.2 ms on the
    device, so its timings read up to 0.6 ms, and varied from process to process with
    the host's speed (bench/results/h200_find_gap_*.json)."""
    cycles = int(2.0 * host_seconds * _CYCLES_PER_SECOND_BOUND)
    return min(max(cycles, _MIN_HEAD_START_CYCLES), _MAX_HEAD_START_CYCLES)


def _host_seconds(fn: Callable[[], object], setup: Callable[[], object] | None) -> float:
    """The host time of one call of ``fn`` with nothing queued before it."""
    if setup is not None:
        setup()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed


def _flush_buffer(index: int) -> torch.Tensor:
    buffer = _flush_buffers.get(index)
    if buffer is None:
        l2 = getattr(torch.cuda.get_device_properties(index), "L2_cache_size", 0)
        size = max(_MIN_FLUSH_BYTES, 4 * int(l2))
        buffer = torch.empty(size, dtype=torch.uint8, device=torch.device("cuda", index))
        _flush_buffers[index] = buffer
    return buffer


__all__ = ["Timing", "time_ms"]
