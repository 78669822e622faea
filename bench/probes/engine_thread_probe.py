"""Whether Python runs slower inside a backward on autograd's device thread (a diagnostic).

gemmconv's eager backward is a Python autograd node. On CUDA the engine runs it on the
device's worker thread, where torch.profiler put the node's own host time at 118 us
while the same solver's bare run issued in 101 us in all, its ops included
(bench/probes/results/backward_gap_h100.txt, section 3). This times a fixed piece of pure
Python (and the same with one small tensor op in it) three ways: called directly on
the main thread, inside a backward on the engine's worker thread, and inside a
backward kept on the calling thread (torch.autograd.set_multithreading_enabled(False)).
Each backward times its own body with time.perf_counter; printed: the median us of the
body, and of the whole torch.autograd.grad call around it.

    PYTHONPATH=src python bench/probes/engine_thread_probe.py
"""

from __future__ import annotations

import statistics
import threading
import time

import torch

_BODY_TIMES: list[float] = []
_THREADS: set[int] = set()


def python_work(rounds: int = 200) -> int:
    """About as much interpreted work as a convolution's backward path: small calls,
    attribute and dict lookups, tuple building."""
    table = {i: (i, i + 1) for i in range(16)}
    total = 0
    for i in range(rounds):
        a, b = table[i & 15]
        total += len((a, b, i)) + max(a, b)
    return total


class _Timed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, with_op):  # type: ignore[override]
        ctx.with_op = with_op
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        start = time.perf_counter()
        python_work()
        out = grad.mul(2.0) if ctx.with_op else grad
        _BODY_TIMES.append((time.perf_counter() - start) * 1e6)
        _THREADS.add(threading.get_ident())
        return out, None


def _measure(device: torch.device, with_op: bool, calling_thread: bool, calls: int) -> tuple:
    x = torch.randn(1024, device=device, requires_grad=True)
    y = _Timed.apply(x, with_op)
    dy = torch.ones_like(y)
    _BODY_TIMES.clear()
    _THREADS.clear()
    walls = []
    for _ in range(calls):
        start = time.perf_counter()
        if calling_thread:
            with torch.autograd.set_multithreading_enabled(False):
                torch.autograd.grad(y, x, dy, retain_graph=True)
        else:
            torch.autograd.grad(y, x, dy, retain_graph=True)
        walls.append((time.perf_counter() - start) * 1e6)
    main = threading.get_ident() in _THREADS
    return statistics.median(_BODY_TIMES[20:]), statistics.median(walls[20:]), main


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    calls = 400
    direct = []
    for _ in range(calls):
        start = time.perf_counter()
        python_work()
        direct.append((time.perf_counter() - start) * 1e6)
    print(f"{device}, torch {torch.__version__}; median us over {calls - 20} calls")
    print(f"  python work called on the main thread: body {statistics.median(direct[20:]):7.1f}")
    for with_op in (False, True):
        for calling_thread in (False, True):
            body, wall, on_main = _measure(device, with_op, calling_thread, calls)
            where = "calling thread" if calling_thread else "engine's thread"
            op = " + one tensor op" if with_op else ""
            print(f"  in a backward on the {where}{op}: body {body:7.1f}  "
                  f"autograd.grad {wall:7.1f}  (ran on the main thread: {on_main})")  # fmt: skip
    if device.type == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
