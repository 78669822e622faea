"""The host's cost of one prepared Triton launch, direct and the ordinary way (CUDA).

Times ``gather_patches`` (ViT-B/16's patch gather at a small batch, a few microseconds
of copying; the reference launch by which gemmconv.host_speed scales the cost table's
host costs) back to back, first as it runs (the direct route, where no launch hook is
set), then with a launch hook installed that does nothing, which sends every launch
through Triton's ordinary ``kernel[grid](...)``; a torch copy of the same bytes is
timed beside them. Prints microseconds per call, the minimum over repetitions of 500
calls each with one synchronisation after them (the host's time, since the kernels
are shorter), and the launch as a process measures it before its first decision. This
is what DeviceRates.host_triton_launch_us stands for.

    PYTHONPATH=src python scripts/launch_cost.py
"""

from __future__ import annotations

import torch
import triton

from gemmconv.host_speed import measure_reference_launch_us, per_call_us, reference_launch

CALLS, REPS = 500, 7


def main() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    gather = reference_launch(device)
    x = torch.randn(2, 3, 224, 224, device=device, dtype=torch.bfloat16)
    col = torch.empty(2 * 14 * 14, 768, device=device, dtype=torch.bfloat16)

    def torch_copy() -> None:
        col.view(2, 14, 14, 3, 16, 16).copy_(x.view(2, 3, 14, 16, 14, 16).permute(0, 2, 4, 1, 3, 5))

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
    print(f"  torch copy of the same bytes     {per_call_us(torch_copy, device, CALLS, REPS):7.1f}")
    first_use = measure_reference_launch_us(device.index)
    print(f"  the launch, as measured at first use {first_use:5.1f}")


if __name__ == "__main__":
    main()
