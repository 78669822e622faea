"""Per-call host overhead of gemmconv against torch, on problems too small to hide it.

Times (time.perf_counter, the median and the minimum of many calls after a warm-up)
the forward and the forward + backward of tiny convolutions through torch.nn.functional.conv*,
gemmconv.functional.conv* and gemmconv.nn.Conv*, and for a patch convolution the
reshape + F.linear rewrite's module too, and prints a Markdown table. The problems are
so small that the arithmetic costs almost nothing: what is measured is the Python and
dispatcher work around it. On a shared machine the minimum is the steadier figure:
other processes only ever add time.

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
from gemmconv.bench.linear_patch_embed import LinearPatchEmbed, is_patch_conv


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    input_shape: tuple[int, ...]
    out_channels: int
    kernel: int | tuple[int, ...]
    stride: int | tuple[int, ...]
    channels_last: bool = False
    bias: bool = True

    @property
    def dims(self) -> int:
        return len(self.input_shape) - 2


CASES = (
    Case("patch 4x4, 2x3x16x16 -> 8", (2, 3, 16, 16), 8, 4, 4),
    Case("patch 4x4, channels-last", (2, 3, 16, 16), 8, 4, 4, channels_last=True),
    Case("1x1, 2x8x8x8 -> 8", (2, 8, 8, 8), 8, 1, 1),
    Case("1x1, channels-last", (2, 8, 8, 8), 8, 1, 1, channels_last=True),
    Case("1x1 no bias, 2x8x8x8 -> 8", (2, 8, 8, 8), 8, 1, 1, bias=False),
    # Qwen2-VL's patch embed (kernel = stride = 2x14x14, one patch a sample), narrower.
    Case("Qwen2-VL-shaped 3-D, 4x3x2x14x14 -> 64", (4, 3, 2, 14, 14), 64, (2, 14, 14), (2, 14, 14)),
)
_FUNCTIONAL = {2: (F.conv2d, gemmconv.conv2d), 3: (F.conv3d, gemmconv.conv3d)}
_MODULES = {2: (torch.nn.Conv2d, gemmconv.nn.Conv2d), 3: (torch.nn.Conv3d, gemmconv.nn.Conv3d)}
_CHANNELS_LAST = {2: torch.channels_last, 3: torch.channels_last_3d}


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
    torch_module, gemmconv_module = _MODULES[case.dims]
    conv = torch_module(
        case.input_shape[1], case.out_channels, case.kernel, case.stride, bias=case.bias
    ).to(device)
    if case.channels_last:
        x = x.to(memory_format=_CHANNELS_LAST[case.dims])
        conv = conv.to(memory_format=_CHANNELS_LAST[case.dims])
    module = gemmconv_module(
        case.input_shape[1], case.out_channels, case.kernel, case.stride, bias=case.bias
    ).to(device)
    module.load_state_dict(conv.state_dict())
    if case.channels_last:
        module = module.to(memory_format=_CHANNELS_LAST[case.dims])
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

    torch_function, gemmconv_function = _FUNCTIONAL[case.dims]
    callers = {
        f"torch F.conv{case.dims}d": functional_pair(torch_function),
        f"gemmconv.conv{case.dims}d": functional_pair(gemmconv_function),
        f"torch nn.Conv{case.dims}d": module_pair(conv),
        f"gemmconv.nn.Conv{case.dims}d": module_pair(module),
    }
    if is_patch_conv(conv):
        callers["reshape + linear module"] = module_pair(LinearPatchEmbed(conv))
    return callers


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
