"""Timing of a callable, two ways: device time and the time of back-to-back calls.

``time_ms`` measures device time (a diagnostic): warm-up, one measurement per
repetition, median. On CUDA each repetition is bracketed by a pair of events on the
current stream, so the time is the GPU's own time for the kernels the callable
launched, each launch counted once. Between repetitions, outside the timed region,
the L2 cache is flushed by writing a buffer larger than it, so every repetition reads
its operands from memory as a real step of a model would. On the CPU each repetition is timed with
``time.perf_counter`` and nothing is flushed.

On CUDA a spin kernel is queued ahead of each timed repetition, long enough to cover
twice the host time of one call (measured once after the warm-up), so the events see
the device's time and not Python's launch overhead. ``setup`` runs before every
repetition (and warm-up call), outside the timed region: use it to reset an output
or rotate inputs.

``time_interleaved`` measures what a caller pays: each repetition times a block of
``k`` back-to-back calls of one callable and divides by ``k``; nothing runs ahead of
the block (the device is idle when the first call is launched) and nothing
synchronises inside it, so the host's launch work counts as it does for a user. On
CUDA the block is bracketed by two events, on the CPU by time.perf_counter. Several
callables are interleaved repetition by repetition, in a fresh random order each
time (interleaved_orders), so none always runs first or always after the same other;
each may rotate over several operand sets.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

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


# ---- back-to-back calls ------------------------------------------------------------

# A block of back-to-back calls lasts about this long by default (calls of one callable
# per repetition, between the bounds below).
DEFAULT_BLOCK_MS = {"cuda": 5.0, "cpu": 20.0}
_CALLS_PER_BLOCK = (1, 100)


def time_interleaved(
    calls: dict[str, Sequence[Callable[[], object]]],
    device: torch.device,
    *,
    reps: int,
    warmup: int = 2,
    calls_per_rep: int | None = None,
    block_ms: float | None = None,
    shuffled: bool = True,
    settings: Mapping[str, Callable[[], contextlib.AbstractContextManager]] | None = None,
) -> dict[str, Timing]:
    """Per name, milliseconds per call: ``reps`` repetitions of a block of back-to-back
    calls (rotating over that name's callables, one per operand set), the names
    interleaved in interleaved_orders' order (``shuffled=False``: rotated). A block
    holds ``calls_per_rep`` calls, else as many as last about ``block_ms`` (default
    DEFAULT_BLOCK_MS), judged from one synchronised pass. ``settings`` maps a name to
    a context its calls run in (a selection mode), entered around each of its blocks,
    its warm-up and its sizing pass, never inside a block."""
    settings = settings or {}

    def setting(name: str) -> contextlib.AbstractContextManager:
        made = settings.get(name)
        return contextlib.nullcontext() if made is None else made()

    if reps < 1:
        raise ValueError(f"reps={reps}: expected at least 1")
    if warmup < 0:
        raise ValueError(f"warmup={warmup}: expected 0 or more")
    device = torch.device(device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for name, fns in calls.items():
        with setting(name):
            for _ in range(warmup):
                for fn in fns:
                    fn()
    target_ms = block_ms if block_ms is not None else DEFAULT_BLOCK_MS[device.type]
    block = {}
    for name, fns in calls.items():
        with setting(name):
            block[name] = calls_per_rep or _calls_per_block(fns, target_ms, sync)
    names = list(calls)
    marks: dict[str, list] = {name: [] for name in names}
    for order in interleaved_orders(names, reps, shuffled=shuffled):
        for name in order:
            fns, k = calls[name], block[name]
            with setting(name):
                sync()  # the device is idle: no head start for the block
                if cuda:
                    start, end = (
                        torch.cuda.Event(enable_timing=True),
                        torch.cuda.Event(enable_timing=True),
                    )
                    start.record()
                    for i in range(k):
                        fns[i % len(fns)]()
                    end.record()
                    marks[name].append((start, end))
                else:
                    begin = time.perf_counter()
                    for i in range(k):
                        fns[i % len(fns)]()
                    marks[name].append((begin, time.perf_counter()))
    sync()
    result = {}
    for name in names:
        k = block[name]
        if cuda:
            samples = tuple(s.elapsed_time(e) / k for s, e in marks[name])
        else:
            samples = tuple((e - s) * 1000.0 / k for s, e in marks[name])
        result[name] = Timing.from_samples(samples)
    return result


def interleaved_orders(
    names: Sequence[str], reps: int, seed: int = 0, shuffled: bool = True
) -> Iterator[list[str]]:
    """Per repetition, ``names`` in a fresh random order (seeded, so a run repeats), so
    that each runs right after each other about equally often. A rotation would not
    do: it keeps the cyclic order, so one name nearly always follows the same other and
    pays for what that one left in the host's caches (on the CPU machine a patch-embed
    step right after torch's Conv3d ran 13-33 us slower than right after itself).
    ``shuffled=False`` gives that rotation, as the timings before the shuffle ran, to
    compare with them."""
    order = list(names)
    if not shuffled:
        for rep in range(reps):
            shift = rep % max(len(order), 1)
            yield order[shift:] + order[:shift]
        return
    shuffle = random.Random(seed).shuffle
    for _ in range(reps):
        shuffle(order)
        yield list(order)


def _calls_per_block(fns: Sequence[Callable[[], object]], target_ms: float, sync) -> int:
    """Calls that fill a block of about ``target_ms``, from one synchronised pass."""
    sync()
    begin = time.perf_counter()
    for fn in fns:
        fn()
    sync()
    per_call_ms = (time.perf_counter() - begin) * 1000.0 / len(fns)
    low, high = _CALLS_PER_BLOCK
    return min(high, max(low, round(target_ms / max(per_call_ms, 1e-6))))


__all__ = ["DEFAULT_BLOCK_MS", "Timing", "interleaved_orders", "time_interleaved", "time_ms"]
