"""gemmconv.conv1d/2d/3d against torch.nn.functional on the same inputs: values, gradients,
output memory format, non-contiguous inputs, edge sizes, and the choice of solver."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gemmconv
from gemmconv.measuring.verify import reference, rms_range, tolerance  # noqa: F401

CONV = {
    1: (gemmconv.conv1d, F.conv1d),
    2: (gemmconv.conv2d, F.conv2d),
    3: (gemmconv.conv3d, F.conv3d),
}
CL = {2: torch.channels_last, 3: torch.channels_last_3d}


def _rand(*shape, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1).to(dtype)


def _compare(dims, x, w, b, dtype=torch.float64, **kw):
    """Forward and every gradient of gemmconv vs torch on the same leaves."""
    ours, theirs = CONV[dims]
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in (x, w, b)]
    leaves_ref = [
        t.detach().clone().requires_grad_(True) if t is not None else None for t in (x, w, b)
    ]
    y = ours(leaves[0], leaves[1], leaves[2], **kw)
    y_ref = theirs(leaves_ref[0], leaves_ref[1], leaves_ref[2], **kw)
    assert y.shape == y_ref.shape
    assert y.dtype == y_ref.dtype
    tol = tolerance(dtype, "cpu")
    assert rms_range(y, y_ref) <= tol
    grad = _rand(*y.shape, dtype=dtype, seed=99)
    y.backward(grad)
    y_ref.backward(grad)
    for mine, ref in zip(leaves, leaves_ref):
        if mine is not None:
            assert rms_range(mine.grad, ref.grad) <= tol
    return y, y_ref


# ---- eligible and ineligible problems, all dims ---------------------------------

CASES = [
    # (label, dims, input shape, weight shape, kwargs, forward solver expected)
    ("point_s_eq_r", 2, (3, 3, 14, 14), (5, 3, 14, 14), dict(stride=14), "point_output"),
    ("point_s_gt_r", 2, (3, 3, 20, 27), (5, 3, 14, 14), dict(stride=14), "point_output"),
    ("point_3d", 3, (2, 3, 2, 6, 6), (4, 3, 2, 6, 6), dict(stride=(2, 6, 6)), "point_output"),
    # One window a dimension: the stride changes nothing (a fully-convolutional head's
    # 7x7 layer on 7x7 maps, torch's default stride 1), so the problem is a point one.
    ("one_window", 2, (3, 3, 7, 7), (5, 3, 7, 7), {}, "point_output"),
    ("one_window_3d", 3, (2, 3, 2, 6, 11), (4, 3, 2, 6, 6), dict(stride=(1, 2, 6)), "point_output"),
    ("patch_rem", 2, (2, 3, 17, 19), (6, 3, 4, 4), dict(stride=4), "patch"),
    ("patch_1d", 1, (2, 3, 23), (4, 3, 5), dict(stride=5), "patch"),
    ("patch_3d", 3, (2, 2, 5, 8, 9), (4, 2, 2, 4, 4), dict(stride=(2, 4, 4)), "patch"),
    ("pointwise", 2, (2, 8, 5, 7), (6, 8, 1, 1), {}, "pointwise"),
    ("pointwise_1d", 1, (2, 8, 9), (6, 8, 1), {}, "pointwise"),
    ("strided_pw", 2, (2, 8, 7, 9), (6, 8, 1, 1), dict(stride=2), "strided_pointwise"),
    (
        "strided_pw_3d",
        3,
        (2, 4, 5, 7, 3),
        (6, 4, 1, 1, 1),
        dict(stride=(2, 3, 1)),
        "strided_pointwise",
    ),
    ("general_3x3", 2, (2, 4, 9, 9), (6, 4, 3, 3), dict(padding=1), None),
    ("groups", 2, (2, 4, 8, 8), (6, 2, 3, 3), dict(groups=2, stride=2), None),
    ("dilated", 1, (2, 3, 20), (4, 3, 3), dict(dilation=3, padding=2), None),
    ("same", 2, (2, 3, 9, 8), (4, 3, 4, 3), dict(padding="same"), None),
    ("valid", 3, (1, 2, 5, 6, 7), (3, 2, 2, 3, 2), dict(padding="valid"), None),
]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("layout", ["cf", "cl"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_torch(case, layout, bias):
    _, dims, xs, ws, kw, _ = case
    x, w = _rand(*xs, seed=1), _rand(*ws, seed=2)
    b = _rand(ws[0], seed=3) if bias else None
    if layout == "cl":
        if dims == 1:
            x = x.transpose(1, 2).contiguous().transpose(1, 2)
        else:
            x = x.contiguous(memory_format=CL[dims])
    y, y_ref = _compare(dims, x, w, b, **kw)
    if dims > 1:
        fmt = CL[dims]
        assert y.is_contiguous(memory_format=fmt) == y_ref.is_contiguous(memory_format=fmt)
    assert y.is_contiguous() == y_ref.is_contiguous()


@pytest.mark.parametrize("case", [c for c in CASES if c[5]], ids=[c[0] for c in CASES if c[5]])
def test_eligible_problems_go_to_their_gemm_solver(case, monkeypatch):
    # Whether a GEMM beats the vendor depends on size (on a tiny problem the vendor's
    # single launch wins): with the vendor out of the way and a batch large enough
    # that work, not launches, decides, an eligible problem must go to the GEMM
    # solver of its class. explain() runs nothing, so the tensors hold no data.
    monkeypatch.setenv("GEMMCONV_DISABLE", "vendor")
    _, dims, xs, ws, kw, expected = case
    x = torch.empty(256, *xs[1:])
    choice = gemmconv.explain(x, torch.empty(ws), None, **kw)
    assert set(choice) == {"forward", "backward_data", "backward_weights"}
    for direction in choice.values():
        assert direction.solver == expected
        assert expected not in direction.rejected


def test_ineligible_problem_goes_to_vendor_or_im2col_and_names_reasons():
    choice = gemmconv.explain(_rand(2, 4, 9, 9), _rand(6, 4, 3, 3), None, stride=2, padding=1)
    fwd = choice["forward"]
    assert fwd.solver in {"im2col", "vendor"}
    assert "stride (2, 2) != kernel (3, 3)" in fwd.rejected["patch"]
    assert "padding (1, 1) != 0" in fwd.rejected["patch"]
    assert any("not 1x1" in r for r in fwd.rejected["pointwise"])


def test_weight_channels_last_makes_channels_last_output_like_torch():
    x = _rand(2, 3, 8, 8)
    w = _rand(4, 3, 4, 4).contiguous(memory_format=torch.channels_last)
    y, y_ref = _compare(2, x, w, None, stride=4)
    assert y_ref.is_contiguous(memory_format=torch.channels_last)
    assert y.is_contiguous(memory_format=torch.channels_last)


# ---- non-contiguous inputs ------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda t: t[:, :, 1:, :-1],
        lambda t: t.permute(0, 1, 3, 2),
        lambda t: t[::2],
        lambda t: t[:, 1:],
    ],
    ids=["slice", "permute", "batch_step", "channel_slice"],
)
@pytest.mark.parametrize("kind", ["patch", "pointwise", "strided"])
def test_non_contiguous_inputs(make, kind):
    base = _rand(4, 5, 17, 15)
    x = make(base)
    c = x.shape[1]
    kernel, stride = {"patch": (4, 4), "pointwise": (1, 1), "strided": (1, 2)}[kind]
    w = _rand(6, c, kernel, kernel)
    _compare(2, x, w, _rand(6), stride=stride)


# ---- edge sizes -------------------------------------------------------------------


@pytest.mark.parametrize(
    "xs,ws,kw",
    [
        ((1, 3, 14, 14), (5, 3, 14, 14), dict(stride=14)),  # N = 1
        ((3, 1, 8, 8), (5, 1, 4, 4), dict(stride=4)),  # C = 1
        ((3, 3, 8, 8), (1, 3, 4, 4), dict(stride=4)),  # K = 1
        ((2, 3, 13, 11), (4, 3, 3, 5), dict(stride=(3, 5))),  # odd, remainders
        ((2, 3, 9, 9), (4, 3, 1, 1), dict(stride=2)),  # 1x1 stride 2, odd size
        ((1, 1, 1, 1), (1, 1, 1, 1), {}),  # everything one
    ],
    ids=["n1", "c1", "k1", "odd", "s2_odd", "all_ones"],
)
def test_edge_sizes(xs, ws, kw):
    _compare(2, _rand(*xs), _rand(*ws), _rand(ws[0]), **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_dtypes_match_torch_within_tolerance(dtype):
    x, w, b = (
        _rand(4, 3, 28, 28, dtype=dtype),
        _rand(8, 3, 14, 14, dtype=dtype),
        _rand(8, dtype=dtype),
    )
    y = gemmconv.conv2d(x, w, b, stride=14)
    assert y.dtype == dtype
    problem = gemmconv.ConvProblem.from_tensors(x, w, b, stride=14)
    ref = reference(problem, gemmconv.ConvTensors(input=x, weight=w, bias=b))
    assert rms_range(y, ref) <= tolerance(dtype, "cpu")


def test_unbatched_input():
    _compare(2, _rand(3, 16, 16), _rand(4, 3, 4, 4), None, stride=4)


# ---- gradients only where needed --------------------------------------------------


def _count_directions(monkeypatch):
    """The directions gemmconv's ops compute, as a list filled while the test runs."""
    import gemmconv.roads.ops

    calls = []

    def spy(name, direction_of):
        original = getattr(gemmconv.roads.ops, name)

        def counted(plan, *args):
            calls.append(direction_of(plan))
            return original(plan, *args)

        monkeypatch.setattr(gemmconv.roads.ops, name, counted)

    def planned(plan):
        return plan.problem.direction.value

    spy("run_forward", planned)
    spy("run_forward_keeping_columns", planned)
    spy("run_backward", planned)
    spy("weight_gradient_from_columns", lambda plan: "backward_weights")
    # The eager road's dW from kept columns calls the prepared run itself.
    from gemmconv.solvers.patch.prepared import ColumnKeepingForward

    from_columns = ColumnKeepingForward.weight_gradient

    def weight_gradient(self, dy, col):
        calls.append("backward_weights")
        return from_columns(self, dy, col)

    monkeypatch.setattr(ColumnKeepingForward, "weight_gradient", weight_gradient)
    return calls


@pytest.mark.parametrize(
    "x_grad,w_grad,expected",
    [
        (True, True, {"forward", "backward_data", "backward_weights"}),
        (False, True, {"forward", "backward_weights"}),
        (True, False, {"forward", "backward_data"}),
    ],
)
@pytest.mark.usefixtures("work_costs_only")
def test_only_needed_gradients_are_computed(monkeypatch, x_grad, w_grad, expected):
    # Forced onto a GEMM solver: otherwise a direction the vendor takes anyway may
    # leave the call to torch's fused backward (eager._Call.vendor_serves).
    monkeypatch.setenv("GEMMCONV_SOLVER", "patch")
    calls = _count_directions(monkeypatch)
    x = _rand(2, 3, 8, 8).requires_grad_(x_grad)
    w = _rand(4, 3, 4, 4).requires_grad_(w_grad)
    gemmconv.conv2d(x, w, stride=4).sum().backward()
    assert set(calls) == expected
    assert (x.grad is not None) == x_grad and (w.grad is not None) == w_grad


# ---- problems only the vendor path takes --------------------------------------------


def test_empty_batch_goes_to_vendor_and_matches_torch():
    x, w, b = _rand(0, 3, 8, 8), _rand(4, 3, 4, 4), _rand(4)
    choice = gemmconv.explain(x, w, b, stride=4)
    assert {c.solver for c in choice.values()} == {"vendor"}
    y = gemmconv.conv2d(x, w, b, stride=4)
    assert y.shape == F.conv2d(x, w, b, stride=4).shape == (0, 4, 2, 2)


def test_with_every_gemm_solver_disabled_the_vendor_gives_torchs_answer(monkeypatch):
    gemm_ids = [s for s in gemmconv.solver_ids() if s != "vendor"]
    monkeypatch.setenv("GEMMCONV_DISABLE", ",".join(gemm_ids))
    x, w, b = _rand(2, 4, 9, 9), _rand(6, 4, 3, 3), _rand(6)
    choice = gemmconv.explain(x, w, b, stride=2, padding=1)
    assert {c.solver for c in choice.values()} == {"vendor"}
    _compare(2, x, w, b, stride=2, padding=1)


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_meta_tensors_give_torchs_shapes_forward_and_backward(dims):
    # Shape inference with no data (e.g. building a model on the meta device): the
    # autocast check once raised for the meta device, which has no autocast.
    fn = {1: gemmconv.conv1d, 2: gemmconv.conv2d, 3: gemmconv.conv3d}[dims]
    ref = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[dims]
    x = torch.empty(2, 3, *([8] * dims), device="meta", requires_grad=True)
    w = torch.empty(5, 3, *([4] * dims), device="meta", requires_grad=True)
    b = torch.empty(5, device="meta", requires_grad=True)
    y = fn(x, w, b, stride=4)
    assert y.device.type == "meta"
    assert y.shape == ref(x, w, b, stride=4).shape
    y.sum().backward()
    assert (x.grad.shape, w.grad.shape, b.grad.shape) == (x.shape, w.shape, b.shape)
