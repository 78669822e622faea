"""Per-call host overhead of gemmconv against torch, on problems too small to hide it.

Times (time.perf_counter, the median and the minimum of many calls after a warm-up)
the forward and the forward + backward of tiny convolutions through torch.nn.functional.conv*,
gemmconv.functional.conv* and gemmconv.nn.Conv*, and prints a Markdown table. The
problems are so small that the arithmetic costs almost nothing: what is measured is
the Python and dispatcher work around it. On a shared machine the minimum is the
steadier figure: other processes only ever add time.

    PYTHONPATH=src python bench/overhead.py [--iters 2000] [--device cpu]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import gemmconv
import gemmconv.nn


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    input_shape: tuple[int, ...]
    out_channels: int
    kernel: int
    stride: int
    channels_last: bool = False
    bias: bool = True


CASES = (
    Case("patch 4x4, 2x3x16x16 -> 8", (2, 3, 16, 16), 8, 4, 4),
    Case("patch 4x4, channels-last", (2, 3, 16, 16), 8, 4, 4, channels_last=True),
    Case("1x1, 2x8x8x8 -> 8", (2, 8, 8, 8), 8, 1, 1),
    Case("1x1, channels-last", (2, 8, 8, 8), 8, 1, 1, channels_last=True),
    Case("1x1 no bias, 2x8x8x8 -> 8", (2, 8, 8, 8), 8, 1, 1, bias=False),
)


def _times_us(
    fn: Callable[[], object], iters: int, sync: Callable[[], None]
) -> tuple[float, float]:
    """(median, minimum) microseconds per call."""
    for _ in range(max(10, iters // 10)):  # warm-up: dispatch caches, allocator
        fn()
    sync()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6, min(times) * 1e6


def _callers(case: Case, device: str) -> dict[str, tuple[Callable, Callable]]:
    """Per implementation: (forward-only call, forward + backward call)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(case.input_shape, generator=gen).to(device)
    conv = torch.nn.Conv2d(
        case.input_shape[1], case.out_channels, case.kernel, case.stride, bias=case.bias
    ).to(device)
    if case.channels_last:
        x = x.to(memory_format=torch.channels_last)
        conv = conv.to(memory_format=torch.channels_last)
    module = gemmconv.nn.Conv2d(
        case.input_shape[1], case.out_channels, case.kernel, case.stride, bias=case.bias
    ).to(device)
    module.load_state_dict(conv.state_dict())
    if case.channels_last:
        module = module.to(memory_format=torch.channels_last)
    w, b = conv.weight, conv.bias
    x_grad = x.detach().clone().requires_grad_(True)

    def functional_pair(fn) -> tuple[Callable, Callable]:
        def forward() -> object:
            with torch.no_grad():
                return fn(x, w, b, case.stride)

        def forward_backward() -> object:
            fn(x_grad, w, b, case.stride).sum().backward()

        return forward, forward_backward

    def module_pair(m) -> tuple[Callable, Callable]:
        def forward() -> object:
            with torch.no_grad():
                return m(x)

        def forward_backward() -> object:
            m(x_grad).sum().backward()

        return forward, forward_backward

    return {
        "torch F.conv2d": functional_pair(F.conv2d),
        "gemmconv.conv2d": functional_pair(gemmconv.conv2d),
        "torch nn.Conv2d": module_pair(conv),
        "gemmconv.nn.Conv2d": module_pair(module),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--label", default="", help="machine description for the heading")
    args = parser.parse_args()
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    torch.set_num_threads(1)  # the overhead, not the thread pool's wake-up, is measured
    print(f"# Per-call overhead, {args.device}{', ' + args.label if args.label else ''}")
    print()
    print(f"torch {torch.__version__}; median (min) of {args.iters} calls; microseconds per call.")
    print()
    print("| problem | implementation | forward (us) | forward+backward (us) |")
    print("|---|---|---:|---:|")
    for case in CASES:
        for impl, (forward, forward_backward) in _callers(case, args.device).items():
            fwd, fwd_min = _times_us(forward, args.iters, sync)
            both, both_min = _times_us(forward_backward, args.iters // 2, sync)
            cells = f"{fwd:.1f} ({fwd_min:.1f}) | {both:.1f} ({both_min:.1f})"
            print(f"| {case.name} | {impl} | {cells} |")


if __name__ == "__main__":
    main()
