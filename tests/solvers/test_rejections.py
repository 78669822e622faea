"""Each solver refuses what it cannot do, and says why."""

from __future__ import annotations

import pytest
import torch

from gemmconv import ConvProblem, Direction, get_solver
from gemmconv.solvers import SOLVERS


def _p(**kw):
    base = dict(n=2, c=3, k=4, spatial=(8, 8), kernel=(4, 4), stride=(4, 4))
    base.update(kw)
    return ConvProblem.from_sizes(**base)


REJECTIONS = [
    ("point_output", _p(), "output spatial (2, 2) is not all ones"),
    ("point_output", _p(spatial=(8, 8), stride=(8, 8)), "stride (8, 8) != kernel (4, 4)"),
    ("patch", _p(stride=(2, 2)), "stride (2, 2) != kernel (4, 4)"),
    ("patch", _p(padding=(1, 1)), "padding (1, 1) != 0"),
    ("patch", _p(dilation=(2, 1), spatial=(12, 8)), "dilation (2, 1) != 1"),
    ("patch", _p(groups=3, k=6), "groups 3 != 1"),
    ("pointwise", _p(), "kernel (4, 4) is not 1x1"),
    ("pointwise", _p(kernel=(1, 1), stride=(2, 2)), "stride (2, 2) != 1"),
    ("pointwise", _p(kernel=(1, 1), stride=(1, 1), padding=(1, 0)), "padding (1, 0) != 0"),
    ("pointwise", _p(kernel=(1, 1), stride=(1, 1), groups=3, k=6), "groups 3 != 1"),
    (
        "strided_pointwise",
        _p(kernel=(1, 1), stride=(1, 1)),
        "stride (1, 1) is 1 in every dimension",
    ),
    ("strided_pointwise", _p(), "kernel (4, 4) is not 1x1"),
    ("patch", _p(n=0), "empty problem (N=0"),
    ("im2col", _p(n=0), "empty problem (N=0"),
]


@pytest.mark.parametrize("solver_id,problem,reason", REJECTIONS, ids=[r[2] for r in REJECTIONS])
def test_solver_rejects_with_reason(solver_id, problem, reason):
    reasons = get_solver(solver_id).not_supported_reasons(problem)
    assert any(reason in r for r in reasons), reasons
    assert not get_solver(solver_id).is_applicable(problem)


def test_declared_capabilities_turn_into_reasons():
    solver = get_solver("patch")
    cls = type(solver)
    problem = _p(dtype=torch.int32)
    assert torch.int32 not in cls.dtypes
    assert "dtype int32 not supported" in solver.not_supported_reasons(problem)


def test_vendor_accepts_everything():
    vendor = get_solver("vendor")
    for problem in [p for _, p, _ in REJECTIONS]:
        assert vendor.not_supported_reasons(problem) == []


def test_core_solver_ids_keep_their_registry_order():
    core = ["point_output", "pointwise", "strided_pointwise", "patch", "im2col", "vendor"]
    assert [s.id for s in SOLVERS if s.id in core] == core
    assert SOLVERS[-1].id == "vendor"


def test_every_direction_is_declared():
    for solver in SOLVERS:
        assert set(solver.directions) == set(Direction)


def test_unknown_solver_id_names_the_choices():
    with pytest.raises(ValueError, match="solver='nope'.*point_output"):
        get_solver("nope")


@pytest.mark.parametrize(
    ("sizes", "stride"),
    [
        (dict(spatial=(7, 7), kernel=7, stride=1), (7, 7)),  # one window: the kernel's size
        (dict(spatial=(7, 13), kernel=7, stride=(1, 9)), (7, 7)),  # 13 < 2 * 7: one window
        (dict(spatial=(7, 14), kernel=7, stride=(1, 8)), (7, 8)),  # 14: stride 7 gives two
        (dict(spatial=(8, 8), kernel=7, stride=1), (1, 1)),  # two windows: it matters
        (dict(spatial=(7, 7), kernel=7, stride=1, padding=1), (1, 1)),  # padded
        (dict(spatial=(7, 7), kernel=3, stride=1, dilation=3), (1, 1)),  # dilated
    ],
)
def test_a_stride_that_changes_nothing_is_stored_as_the_kernel(sizes, stride):
    problem = ConvProblem.from_sizes(n=2, c=3, k=4, **sizes)
    assert problem.stride == stride
    before = [
        (s + 2 * p - d * (r - 1) - 1) // u + 1
        for s, r, u, p, d in zip(
            problem.spatial, problem.kernel, _as_given(sizes, "stride", problem.dims),
            problem.padding, problem.dilation,
        )
    ]  # fmt: skip
    assert list(problem.output_spatial) == before


def _as_given(sizes: dict, name: str, dims: int) -> tuple[int, ...]:
    value = sizes[name]
    return (value,) * dims if isinstance(value, int) else tuple(value)
