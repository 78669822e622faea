"""The host a benchmark ran on, and what that host charges a backward before any kernel.

The same code on two H100 machines gave public backward calls up to 340 us apart
wherever a call was host-bound, the reshape + linear rewrite's too, while device times
agreed within 5% (bench/results/h100.md against h100_slow_host.md). On CUDA every
backward call goes through autograd's hand-off to the device's worker thread and back;
a one-op backward of torch's own measures that hand-off on the host at hand, so each
report says what kind of host its figures are from.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path

import torch


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform module says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def backward_handoff_us(device: torch.device, calls: int = 200) -> dict[str, float]:
    """Median host microseconds of one ``torch.autograd.grad`` through a one-op graph of
    torch's own (``x * 2``, 16 elements) on ``device``: ``device_thread`` as torch runs
    it by default, ``calling_thread`` with ``torch.autograd.set_multithreading_enabled``
    off. The two are timed in alternating blocks, so a drift of the host shows in both.
    On the CPU both run on the calling thread."""
    if calls < 1:
        raise ValueError(f"calls={calls}: expected at least 1")
    x = torch.ones(16, device=device, requires_grad=True)
    with torch.enable_grad():  # a caller under no_grad still gets a graph to time
        y = x * 2
    grad = torch.ones_like(y)
    times: dict[str, list[float]] = {"device_thread": [], "calling_thread": []}
    block = max(1, min(20, calls))
    # One untimed block of each first: the engine starts its device thread on first use.
    for timed in (False, True):
        done = 0
        while done < (calls if timed else block):
            for name, threaded in (("device_thread", True), ("calling_thread", False)):
                with torch.autograd.set_multithreading_enabled(threaded):
                    for _ in range(block):
                        start = time.perf_counter()
                        torch.autograd.grad(y, x, grad, retain_graph=True)
                        if timed:
                            times[name].append((time.perf_counter() - start) * 1e6)
            done += block
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {name: statistics.median(values) for name, values in times.items()}


def host_fields(device: torch.device, quick: bool = False) -> dict:
    """A results file's description of the host: CPU model, cores and the backward
    hand-off (backward_handoff_us; fewer calls when ``quick``)."""
    return {
        "host_cpu": cpu_model(),
        "host_cores": os.cpu_count(),
        "backward_handoff_us": backward_handoff_us(device, calls=20 if quick else 200),
    }


def host_lines(results: dict) -> list[str]:
    """A report's paragraph on the host and the blank line after it; none for results
    recorded without one."""
    handoff = results.get("backward_handoff_us")
    if not handoff:
        return []
    host = f"Host: {results['host_cpu']}, {results['host_cores']} cores."
    if results.get("device") == "cpu":
        # The CPU's backward runs on the calling thread either way: one figure says it.
        return [
            f"{host} A one-op backward of torch's own took {handoff['calling_thread']:.1f} us "
            "of host time a call.",
            "",
        ]
    return [
        f"{host} A one-op backward of torch's own took {handoff['device_thread']:.1f} us of "
        f"host time a call through autograd's device thread and "
        f"{handoff['calling_thread']:.1f} us on the calling thread. Every backward timed "
        "here pays that hand-off, torch's and the rewrite's as gemmconv's, so host-bound "
        "backward figures move with it between machines.",
        "",
    ]


__all__ = ["backward_handoff_us", "cpu_model", "host_fields", "host_lines"]
