"""The host's cost of one prepared Triton launch, direct and the ordinary way (CUDA).

Times ``gather_patches`` (ViT-B/16's patch gather at a small batch, a few microseconds
of copying) back to back, first as it runs (the direct route, where no launch hook is
set), then with a launch hook installed that does nothing, which sends every launch
through Triton's ordinary ``kernel[grid](...)``; a torch copy of the same bytes (the
reference op by which gemmconv.host_speed scales the cost table's host costs) is
timed beside them. Prints microseconds per call, the minimum over repetitions of 500
calls each with one synchronisation after them (the host's time, since the kernels
are shorter). This is what DeviceRates.host_triton_launch_us stands for.

    PYTHONPATH=src python scripts/launch_cost.py
"""

from __future__ import annotations

import torch
import triton

from gemmconv.host_speed import host_op, measure_host_op_us, per_call_us
from gemmconv.kernels.patch_permute import gather_patches

CALLS, REPS = 500, 7


def main() -> None:
    x = torch.randn(2, 3, 224, 224, device="cuda", dtype=torch.bfloat16)
    outs, kernel = (14, 14), (16, 16)
    col = torch.empty(2 * 14 * 14, 768, device="cuda", dtype=torch.bfloat16)

    def gather() -> None:
        gather_patches(x, outs, kernel, False, out=col)

    device = x.device
    direct = per_call_us(gather, device, CALLS, REPS)
    hooks = triton.knobs.runtime.launch_enter_hook

    def nothing(metadata) -> None:
        return None

    hooks.add(nothing)
    try:
        ordinary = per_call_us(gather, device, CALLS, REPS)
    finally:
        hooks.remove(nothing)
    print(f"triton {triton.__version__}, torch {torch.__version__}: us per call")
    print(f"  prepared Triton launch, direct   {direct:7.1f}")
    print(f"  prepared Triton launch, ordinary {ordinary:7.1f}")
    copy = per_call_us(host_op(device), device, CALLS, REPS)
    print(f"  torch copy of the same bytes     {copy:7.1f}")
    print(f"  the same, as measured at first use {measure_host_op_us(device.index or 0):5.1f}")


if __name__ == "__main__":
    main()
