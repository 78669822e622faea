"""The vendor's backward directions give exactly what torch's own convolution backward
gives with every real operand, dX in the layout torch's has: backward-data runs as
a transposed convolution (no stand-in input whose layout could steer cuDNN), the
weight gradient as convolution_backward with a shape-only weight."""

from __future__ import annotations

import pytest
import torch

from gemmconv.core.memory_format import Layout
from gemmconv.core.problem import ConvProblem, Direction
from gemmconv.measuring.measure import operands
from gemmconv.solvers.vendor import VendorSolver

# (spatial, kernel, stride, padding, dilation, groups): patch, overlapping, skipped
# positions at the far end (output_padding), dilated, grouped.
GEOMETRIES = [
    ((8, 8), 2, 2, 0, 1, 1),
    ((9, 7), 3, 2, 1, 1, 1),
    ((11, 10), 3, 3, 0, 1, 2),
    ((10, 9), 3, 1, 2, 2, 1),
    ((13,), 4, 3, 1, 1, 1),
    ((5, 6, 7), 2, 2, 0, 1, 1),
]


def _problem(geometry, layout: Layout, direction: Direction, device: str, dtype) -> ConvProblem:
    spatial, kernel, stride, padding, dilation, groups = geometry
    return ConvProblem.from_sizes(
        3, 4, 6, spatial, kernel, stride=stride, padding=padding, dilation=dilation,
        groups=groups, layout=layout, dtype=dtype, device_type=device, direction=direction,
    )  # fmt: skip


def _torchs_gradient(p: ConvProblem, t, direction: Direction) -> torch.Tensor:
    data = direction is Direction.BACKWARD_DATA
    dx, dw, _ = torch.ops.aten.convolution_backward(
        t.grad_output, t.input, t.weight, None, list(p.stride), list(p.padding),
        list(p.dilation), False, [0] * p.dims, p.groups, [data, not data, False],
    )  # fmt: skip
    return dx if data else dw


def _check(geometry, layout, direction, device, dtype):
    p = _problem(geometry, layout, direction, device, dtype)
    t = operands(p, torch.device(device), seed=7, every_operand=True)
    expected = _torchs_gradient(p, t, direction)
    # The vendor gets only what its direction reads, as the solvers do.
    given = type(t)(grad_output=t.grad_output)
    if direction is Direction.BACKWARD_DATA:
        given.weight = t.weight
    else:
        given.input = t.input
    result = VendorSolver().run(p, given)
    assert result.shape == expected.shape
    if direction is Direction.BACKWARD_DATA:
        # dX's layout is the one torch's backward gives (dW's follows the weight torch is
        # handed, which the vendor's direction does not read).
        assert result.stride() == expected.stride(), (result.stride(), expected.stride())
    assert torch.equal(result, expected)


CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    ],
)


@pytest.mark.parametrize("direction", [Direction.BACKWARD_DATA, Direction.BACKWARD_WEIGHTS],
                         ids=["bwd_data", "bwd_weights"])  # fmt: skip
@pytest.mark.parametrize("layout", list(Layout), ids=lambda v: v.value)
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"{len(g[0])}d-k{g[1]}s{g[2]}")
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_vendor_backward_equals_torchs_with_real_operands(device, geometry, layout, direction):
    # fp32 on the CPU; on CUDA bf16, the dtype of the suite's rows.
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    _check(geometry, layout, direction, device, dtype)
