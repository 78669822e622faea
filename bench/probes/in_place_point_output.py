"""Where point_output's CUDA gradients went wrong after in-place ops on y.

On an H100 the CUDA in-place test (tests/roads/test_in_place_and_batched.py) found dX, dW
and db of point_output off (rms_range 0.15) after ``y += 1; relu_(y)`` for the
channels-first and token-major cases with a bias. This prints, per in-place op and with
the bias on and off, how far the dY the node receives is from the expected one, and how
far its dX, dW and db are from float64 of that same dY; it found every dY exact
(bench/probes/results/in_place_point_output_h100.txt: the test's reference had an
element 5e-4 from relu's kink, which TF32 moved across):

    PYTHONPATH=src python3 bench/probes/in_place_point_output.py
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

import gemmconv
from gemmconv.roads import eager

DEVICE = os.environ.get("PROBE_DEVICE", "cuda")
OPS = {
    "none": lambda y: y,
    "add_": lambda y: y.add_(1),
    "relu_": lambda y: F.relu(y, inplace=True),
    "add_relu_": lambda y: F.relu(y.add_(1), inplace=True),
    "mul_": lambda y: y.mul_(2),
    "relu_out_of_place": lambda y: F.relu(y + 1),
}


def main() -> None:
    os.environ["GEMMCONV_SOLVER"] = "point_output"
    received: list[torch.Tensor] = []
    backward = eager._EagerConvolution.backward

    def recording(ctx, grad_output):
        received.append(grad_output.detach().clone())
        print(f"    node dY strides {grad_output.stride()} offset {grad_output.storage_offset()}"
              f" contiguous {grad_output.is_contiguous()}")  # fmt: skip
        return backward(ctx, grad_output)

    eager._EagerConvolution.backward = staticmethod(recording)
    gen = torch.Generator().manual_seed(0)
    for bias_on in (True, False):
        for layout in ("cf", "token"):
            for name, op in OPS.items():
                x = torch.rand(8, 16, 4, 3, generator=gen) * 2 - 1
                w = torch.rand(24, 16, 4, 3, generator=gen) * 2 - 1
                b = torch.rand(24, generator=gen) * 2 - 1 if bias_on else None
                if layout == "token":
                    w = w.to(memory_format=torch.channels_last)
                leaves = [t.to(DEVICE).requires_grad_() for t in (x, w) + ((b,) if bias_on else ())]
                y = gemmconv.conv2d(*leaves, stride=(4, 3))
                print(f"{layout} bias={bias_on} {name}: y strides {y.stride()}")
                out = op(y)
                v = torch.rand(out.shape, generator=gen).to(DEVICE)
                received.clear()
                ours = torch.autograd.grad(out, leaves, v)
                ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
                ref_y = F.conv2d(*ref_leaves, stride=(4, 3))
                ref_out = OPS[name](ref_y + 0)  # grad at ref_y: the conv output's
                expected_dy = torch.autograd.grad(ref_out, ref_y, v.double(), retain_graph=True)[0]
                ref = torch.autograd.grad(ref_out, ref_leaves, v.double())
                dy = received[0] if received else None
                if dy is None:
                    print("    the node was not called")
                    continue
                errors = [f"{(a.double() - r).abs().max().item():.2g}" for a, r in zip(ours, ref)]
                from_dy = torch.autograd.grad(
                    F.conv2d(*ref_leaves, stride=(4, 3)), ref_leaves, dy.double()
                )
                node = [f"{(a.double() - r).abs().max().item():.2g}" for a, r in zip(ours, from_dy)]
                dy_error = (dy.double() - expected_dy).abs().max().item()
                print(f"    dY off expected by {dy_error:.2g};"
                      f" grads off float64 {errors}; off float64 of the node's dY {node}",
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
