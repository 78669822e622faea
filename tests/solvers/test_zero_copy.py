"""The point-output paths with x spatial == kernel make no copy of x, y or dx.

A TorchDispatchMode records every aten op a solver runs and the storage each
argument lives in, so the test sees exactly which memory the GEMM reads and writes.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gemmconv import ConvProblem, Direction, Layout, get_solver

from solver_cases import nan_output, operands

COPY_OPS = {"copy_", "clone", "_to_copy", "contiguous", "permute_copy", "index_put_", "cat"}


class OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, list[int], list[int]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ptrs = [a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)]
        outs = [
            v.untyped_storage().data_ptr() for v in kwargs.values() if isinstance(v, torch.Tensor)
        ]
        self.ops.append((func.overloadpacket.__name__, ptrs, outs))
        return func(*args, **kwargs)


def _point_problem(layout, direction, spatial=(6, 5)):
    return ConvProblem.from_sizes(
        n=4,
        c=3,
        k=8,
        spatial=spatial,
        kernel=(6, 5),
        stride=(6, 5),
        layout=layout,
        dtype=torch.float32,
        direction=direction,
    )


def _storage(t):
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("layout", list(Layout), ids=lambda v: v.value)
def test_forward_reads_x_in_place(layout):
    p = _point_problem(layout, Direction.FORWARD)
    t = operands(p, "cpu", seed=1)
    out = nan_output(p, "cpu")
    with OpRecorder() as rec:
        get_solver("point_output").run(p, t, out=out)
    names = [name for name, _, _ in rec.ops]
    assert not COPY_OPS & set(names), names
    gemms = [op for op in rec.ops if op[0] in ("mm", "addmm")]
    assert len(gemms) == 1
    _, args, outs = gemms[0]
    assert _storage(t.input) in args, "the GEMM did not read x's own memory"
    assert outs == [_storage(out)], "the GEMM did not write y in place"


@pytest.mark.parametrize("layout", list(Layout), ids=lambda v: v.value)
def test_backward_data_writes_dx_in_place(layout):
    p = _point_problem(layout, Direction.BACKWARD_DATA)
    t = operands(p, "cpu", seed=2)
    out = nan_output(p, "cpu")
    with OpRecorder() as rec:
        get_solver("point_output").run(p, t, out=out)
    names = [name for name, _, _ in rec.ops]
    assert not COPY_OPS & set(names), names
    assert "zero_" not in names, "nothing is uncovered when x spatial == kernel"
    (gemm,) = [op for op in rec.ops if op[0] == "mm"]
    assert gemm[2] == [_storage(out)]
    assert _storage(t.grad_output) in gemm[1]


def test_channels_first_weight_gradient_reads_x_in_place():
    # fp64, because the CPU runs fp32 weight-gradient reductions in fp64 (a copy).
    p = ConvProblem.from_sizes(
        n=4,
        c=3,
        k=8,
        spatial=(6, 5),
        kernel=(6, 5),
        stride=(6, 5),
        dtype=torch.float64,
        direction=Direction.BACKWARD_WEIGHTS,
    )
    t = operands(p, "cpu", seed=3)
    out = nan_output(p, "cpu")
    with OpRecorder() as rec:
        get_solver("point_output").run(p, t, out=out)
    (gemm,) = [op for op in rec.ops if op[0] == "mm"]
    assert _storage(t.input) in gemm[1]
    assert gemm[2] == [_storage(out)]
    assert not COPY_OPS & {name for name, _, _ in rec.ops}


def test_larger_input_is_cropped_and_its_remainder_zeroed():
    p = _point_problem(Layout.CHANNELS_FIRST, Direction.BACKWARD_DATA, spatial=(9, 7))
    t = operands(p, "cpu", seed=4)
    out = nan_output(p, "cpu")
    dx = get_solver("point_output").run(p, t, out=out)
    assert torch.all(dx[:, :, 6:, :] == 0) and torch.all(dx[:, :, :, 5:] == 0)
    assert not torch.isnan(dx).any()
