"""Which step makes a CUDA solver's dX wrong after in-place ops on y and batched gradients.

tests/roads/test_in_place_and_batched.py::test_in_place_ops_and_batched_gradients_on_cuda
failed for point_output on an H100 at ee1bb25 (dX rms_range 0.148 against float32's
0.000977; the seven other solvers passed). This runs its 2-D cases four ways (plain; y
modified in place; batched gradients first; batched after) for point_output, patch and
pointwise, against torch in float64 on the CPU, so the step that breaks it shows:

    PYTHONPATH=src python3 bench/probes/in_place_cuda.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from gemmconv.measuring.verify import rms_range

TESTS = Path(__file__).resolve().parents[2] / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "roads")]
import test_in_place_and_batched as cases  # noqa: E402  (needs the tests on the path)

F64 = torch.float64
VARIANTS = ("plain", "in_place", "batched_then_plain", "plain_then_batched")


def gradients(case, variant: str, device: str, dtype: torch.dtype, forward) -> tuple:
    """y and its gradients for one dY, after the variant's in-place ops and batched calls."""
    x, w, b = (
        None if t is None else t.detach().to(device, dtype).requires_grad_()
        for t in case.operands(9)
    )
    leaves = tuple(t for t in (x, w, b) if t is not None)
    y = forward(x, w, b)
    if variant != "plain":
        y += 1
        F.relu(y, inplace=True)
    gen = torch.Generator().manual_seed(10)
    v = torch.rand(3, *y.shape, generator=gen, dtype=F64).to(device, dtype)
    if variant == "batched_then_plain":
        torch.autograd.grad(y, leaves, v, is_grads_batched=True, retain_graph=True)
    plain = torch.autograd.grad(y, leaves, v[0], retain_graph=True)
    if variant == "plain_then_batched":
        torch.autograd.grad(y, leaves, v, is_grads_batched=True)
    return (y, *plain)


def main() -> None:
    for solver in ("point_output", "patch", "pointwise"):
        os.environ["GEMMCONV_SOLVER"] = solver
        for case in (c for c in cases._cases([solver], torch.float32) if c.dims == 2):
            for variant in VARIANTS:
                ours = gradients(
                    case, variant, "cuda", torch.float32, cases._gemmconv_forward(case, "eager")
                )
                reference = gradients(case, variant, "cpu", F64, cases._torch_forward(case))
                errors = [f"{rms_range(a.double().cpu(), b):.2g}" for a, b in zip(ours, reference)]
                print(f"{case} {variant}: y, dx, dw(, db) rms_range {errors}", flush=True)


if __name__ == "__main__":
    main()
