"""Timing: one measurement per repetition, each launch counted once, setup excluded."""

from __future__ import annotations

import collections
import time

import pytest
import torch

from gemmconv.measuring.timing import (
    Timing,
    head_start_cycles,
    interleaved_orders,
    time_interleaved,
    time_ms,
)

CPU = torch.device("cpu")


def _spin(ms: float):
    """A callable that busy-waits ``ms`` of wall time (deterministic, unlike sleep)."""

    def run() -> None:
        end = time.perf_counter() + ms / 1000.0
        while time.perf_counter() < end:
            pass

    return run


def test_cpu_sequence_time_is_the_sum_of_its_parts():
    a, b = _spin(1.0), _spin(2.0)

    def both() -> None:
        a()
        b()

    ta = time_ms(a, device="cpu", warmup=1, reps=7)
    tb = time_ms(b, device="cpu", warmup=1, reps=7)
    tab = time_ms(both, device="cpu", warmup=1, reps=7)
    parts = ta.min_ms + tb.min_ms
    # Each part is counted once: not zero times (ratio < 1) and not twice (ratio ~ 2).
    assert 0.97 <= tab.min_ms / parts <= 1.4, (ta, tb, tab)
    assert ta.min_ms >= 1.0 and tb.min_ms >= 2.0


def test_samples_are_per_repetition_and_sum_to_the_total():
    t = time_ms(_spin(0.5), device="cpu", warmup=0, reps=5)
    assert t.reps == len(t.samples) == 5
    assert t.total_ms == pytest.approx(sum(t.samples))
    assert t.total_ms >= 5 * 0.5
    assert t.min_ms <= t.median_ms <= max(t.samples)
    assert t.mean_ms == pytest.approx(t.total_ms / 5)


def test_setup_runs_before_every_call_and_is_not_timed():
    calls = {"setup": 0, "fn": 0}

    def setup() -> None:
        calls["setup"] += 1
        _spin(5.0)()

    def fn() -> None:
        calls["fn"] += 1
        _spin(0.5)()

    t = time_ms(fn, device="cpu", warmup=2, reps=4, setup=setup)
    assert calls == {"setup": 6, "fn": 6}
    assert t.min_ms < 5.0  # the 5 ms setup lies outside every timed region


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"reps": 0}, "reps=0"), ({"warmup": -1}, "warmup=-1"), ({"device": "meta"}, "meta")],
)
def test_bad_arguments_are_named(kwargs, match):
    args = {"device": "cpu", **kwargs}
    with pytest.raises(ValueError, match=match):
        time_ms(lambda: None, **args)


def test_head_start_covers_twice_the_host_time_within_bounds():
    # 1 ms of host time needs 2 ms of spin: 4M cycles at the 2 GHz bound.
    assert head_start_cycles(1e-3) == 4_000_000
    assert head_start_cycles(0.0) == 1_000_000  # never below the 0.5 ms floor
    assert head_start_cycles(10.0) == 40_000_000  # a compiling first call is capped
    assert head_start_cycles(2e-3) > head_start_cycles(1e-3)


def test_timing_from_no_samples_is_an_error():
    with pytest.raises(ValueError, match="samples"):
        Timing.from_samples(())


@pytest.mark.gpu
def test_cuda_sequence_time_is_the_sum_of_its_parts():
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(2048, 8192, device="cuda", dtype=torch.bfloat16, generator=g)
    out_a = torch.empty(4096, 4096, device="cuda", dtype=torch.bfloat16)
    out_b = torch.empty(2048, 2048, device="cuda", dtype=torch.bfloat16)

    def fa() -> None:
        torch.matmul(a, a, out=out_a)

    def fb() -> None:
        torch.matmul(b, b.t(), out=out_b)

    def both() -> None:
        fa()
        fb()

    ta = time_ms(fa, device="cuda", reps=50)
    tb = time_ms(fb, device="cuda", reps=50)
    tab = time_ms(both, device="cuda", reps=50)
    assert tab.median_ms == pytest.approx(ta.median_ms + tb.median_ms, rel=0.15), (ta, tb, tab)


@pytest.mark.gpu
def test_cuda_flush_keeps_operands_out_of_l2():
    # A copy that fits in L2 runs faster warm than after a flush; the flushed time
    # must not be below the warm time (the flush really evicts, and is not timed).
    src = torch.randn(4 * 1024 * 1024, device="cuda")  # 16 MiB, fits in an H200's L2
    dst = torch.empty_like(src)
    warm = time_ms(lambda: dst.copy_(src), device="cuda", reps=50, flush_l2=False)
    cold = time_ms(lambda: dst.copy_(src), device="cuda", reps=50, flush_l2=True)
    assert cold.median_ms >= warm.median_ms * 0.95
    # The copy moves 32 MiB (~8 us at 4 TB/s); the 256 MiB flush write (~65 us) would
    # show if it were inside the timed region.
    assert cold.median_ms < 0.04


# ---- back-to-back calls ------------------------------------------------------


def test_interleaved_orders_are_seeded_shuffles_that_mix_who_runs_after_whom():
    names = ["torch", "linear", "gemmconv"]
    orders = list(interleaved_orders(names, 300))
    assert len(orders) == 300 and all(sorted(o) == sorted(names) for o in orders)
    assert orders == list(interleaved_orders(names, 300))  # seeded: a run repeats
    assert orders != list(interleaved_orders(names, 300, seed=1))
    sequence = [name for order in orders for name in order]
    follows = collections.Counter(zip(sequence, sequence[1:], strict=False))
    # A rotation keeps the cyclic order, so each name would mostly follow one same
    # other; shuffled, each ordered pair of different names comes up about equally
    # often (100 times within rounds, 33 across them).
    pairs = [(first, then) for first in names for then in names if first != then]
    assert all(110 <= follows[pair] <= 160 for pair in pairs), follows


def test_interleaved_orders_can_rotate_as_the_timings_before_the_shuffle():
    orders = list(interleaved_orders(["a", "b", "c"], 4, shuffled=False))
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    log = []
    calls = {name: [lambda name=name: log.append(name)] for name in "ab"}
    time_interleaved(calls, CPU, reps=2, warmup=0, calls_per_rep=1, shuffled=False)
    assert log == ["a", "b", "b", "a"]


def test_interleaved_blocks_shuffle_and_time_back_to_back_calls():
    log = []

    def recorder(name, seconds=0.0):
        def call():
            log.append(name)
            if seconds:
                time.sleep(seconds)

        return call

    calls = {"a": [recorder("a", 0.004)], "b": [recorder("b0"), recorder("b1")]}
    times = time_interleaved(calls, CPU, reps=3, warmup=1, calls_per_rep=2)
    # Warm-up: one pass over each implementation's operand sets; then per repetition a
    # block of 2 calls per implementation, in interleaved_orders' order, the sets
    # alternating.
    blocks = {"a": ["a", "a"], "b": ["b0", "b1"]}
    expected = [blocks[name] for order in interleaved_orders(["a", "b"], 3) for name in order]
    assert log == ["a", "b0", "b1"] + [call for block in expected for call in block]
    assert times["a"].reps == 3 and times["b"].reps == 3
    assert 4.0 <= times["a"].median_ms < 40.0  # the sleep, per call, not per block
    assert times["b"].median_ms < times["a"].median_ms


def test_calls_per_block_follows_the_call_time():
    counts = {"no-op": 0, "slow": 0}

    def no_op():
        counts["no-op"] += 1

    def slow():
        counts["slow"] += 1
        time.sleep(0.03)

    time_interleaved({"no-op": [no_op], "slow": [slow]}, CPU, reps=1, warmup=0)
    # One sizing call each, then a block of about 20 ms: one slow call, and as many
    # no-op calls as the bound allows (100).
    assert counts == {"no-op": 1 + 100, "slow": 1 + 1}
    # Blocks of about 75 ms hold two slow calls (of 30 to 50 ms each).
    counts["slow"] = 0
    time_interleaved({"slow": [slow]}, CPU, reps=1, warmup=0, block_ms=75.0)
    assert counts["slow"] == 1 + 2


@pytest.mark.parametrize(
    "kwargs, message",
    [({"reps": 0}, "reps=0: expected at least 1"), ({"reps": 1, "warmup": -1}, "warmup=-1")],
)
def test_timing_arguments_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        time_interleaved({"a": [lambda: None]}, CPU, **kwargs)
