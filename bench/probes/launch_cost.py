"""The host's cost of one prepared Triton launch, direct and the ordinary way (CUDA).

Times ``gather_patches`` (ViT-B/16's patch gather at a small batch, a few microseconds
of copying) back to back, first as it runs (the direct route, where no launch hook is
set), then with a launch hook installed that does nothing, which sends every launch
through Triton's ordinary ``kernel[grid](...)``; a torch copy of the same bytes is
timed beside them. Prints microseconds per call, the minimum over repetitions of 500
calls each with one synchronisation after them (the host's time, since the kernels
are shorter). This is what DeviceRates.host_triton_launch_us stands for.

    PYTHONPATH=src python bench/probes/launch_cost.py
"""

from __future__ import annotations

import time

import torch
import triton

from gemmconv.kernels.patch_permute import gather_patches


def _per_call_us(fn, calls: int = 500, reps: int = 7) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    x = torch.randn(2, 3, 224, 224, device="cuda", dtype=torch.bfloat16)
    outs, kernel = (14, 14), (16, 16)
    col = torch.empty(2 * 14 * 14, 768, device="cuda", dtype=torch.bfloat16)

    def gather() -> None:
        gather_patches(x, outs, kernel, False, out=col)

    def torch_copy() -> None:
        col.view(2, 14, 14, 3, 16, 16).copy_(x.view(2, 3, 14, 16, 14, 16).permute(0, 2, 4, 1, 3, 5))

    direct = _per_call_us(gather)
    hooks = triton.knobs.runtime.launch_enter_hook

    def nothing(metadata) -> None:
        return None

    hooks.add(nothing)
    try:
        ordinary = _per_call_us(gather)
    finally:
        hooks.remove(nothing)
    print(f"triton {triton.__version__}, torch {torch.__version__}: us per call")
    print(f"  prepared Triton launch, direct   {direct:7.1f}")
    print(f"  prepared Triton launch, ordinary {ordinary:7.1f}")
    print(f"  torch copy of the same bytes     {_per_call_us(torch_copy):7.1f}")


if __name__ == "__main__":
    main()
