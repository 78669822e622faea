"""Double backward (``create_graph=True``) through gemmconv: second-order gradients,
as a gradient penalty takes them, equal torch's in float64 for every solver family,
both layouts, groups, dilation and 'same' padding; gradgradcheck passes; and the
second-order pass runs on gemmconv's own ops (autograd.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gemmconv
from gemmconv.core.memory_format import Layout

from conftest import GemmconvOpLog, random_in

CONV = {
    1: (gemmconv.conv1d, F.conv1d),
    2: (gemmconv.conv2d, F.conv2d),
    3: (gemmconv.conv3d, F.conv3d),
}

# (label, input shape, weight shape, conv keyword arguments, the solver the case runs
# on): one case per solver family, with groups, dilation and the
# asymmetric padding that 'same' gives an even kernel among them.
CASES = [
    ("patch_2d", (2, 3, 9, 10), (5, 3, 4, 4), {"stride": 4}, "patch"),
    ("point_2d", (3, 3, 6, 6), (4, 3, 6, 6), {"stride": 6}, "point_output"),
    ("pointwise_2d", (2, 6, 5, 4), (4, 6, 1, 1), {}, "pointwise"),
    ("im2col_grouped", (2, 6, 5, 4), (4, 3, 1, 1), {"groups": 2}, "im2col"),
    ("strided_pw_2d", (2, 6, 5, 7), (3, 6, 1, 1), {"stride": 2}, "strided_pointwise"),
    ("patch_1d", (2, 3, 11), (4, 3, 5), {"stride": 5}, "patch"),
    ("patch_3d", (2, 2, 4, 6, 6), (3, 2, 2, 3, 3), {"stride": (2, 3, 3)}, "patch"),
    (
        "vendor_dilated_grouped",
        (2, 4, 7, 7),
        (4, 2, 3, 3),
        {"padding": 2, "dilation": 2, "groups": 2},
        "vendor",
    ),
    ("im2col_same_even", (2, 3, 6, 5), (4, 3, 2, 2), {"padding": "same"}, "im2col"),
]
LAYOUTS = [Layout.CHANNELS_FIRST, Layout.CHANNELS_LAST]

# torch's own conv warns that 'same' with an even kernel copies the input padded.
pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")


def _leaves(x_shape, w_shape, layout, seed):
    g = torch.Generator().manual_seed(seed)
    x = random_in(x_shape, layout, torch.float64, "cpu", g).requires_grad_(True)
    w = random_in(w_shape, layout, torch.float64, "cpu", g).requires_grad_(True)
    b = random_in((w_shape[0],), Layout.CHANNELS_FIRST, torch.float64, "cpu", g)
    return x, w, b.requires_grad_(True)


def _penalised_gradients(conv, x, w, b, kwargs):
    """The gradients of loss + |d loss/dx|^2 + |d loss/dw|^2 with respect to x, w and b:
    the second-order graph a gradient penalty builds."""
    loss = conv(x, w, b, **kwargs).tanh().sum()
    gx, gw = torch.autograd.grad(loss, (x, w), create_graph=True)
    total = loss + gx.square().sum() + gw.square().sum()
    return torch.autograd.grad(total, (x, w, b))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: v.value)
@pytest.mark.parametrize("label,x_shape,w_shape,kwargs,solver", CASES, ids=[c[0] for c in CASES])
def test_gradient_penalty_matches_torch(
    label, x_shape, w_shape, kwargs, solver, layout, monkeypatch
):
    x, w, b = _leaves(x_shape, w_shape, layout, seed=3)
    ours, theirs = CONV[len(x_shape) - 2]
    # The case exercises the solver it is named for in every direction (on problems
    # this small the cost model would send most of them to the vendor's one launch).
    monkeypatch.setenv("GEMMCONV_SOLVER", solver)
    choices = gemmconv.explain(x, w, b, **kwargs)
    assert {c.solver for c in choices.values()} == {solver}
    got = _penalised_gradients(ours, x, w, b, kwargs)
    want = _penalised_gradients(theirs, x, w, b, kwargs)
    for name, a, e in zip(("x", "w", "b"), got, want, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: v.value)
@pytest.mark.parametrize(
    "label,x_shape,w_shape,kwargs,solver",
    [c for c in CASES if c[0] in ("patch_2d", "im2col_grouped", "im2col_same_even")],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_gradgradcheck(label, x_shape, w_shape, kwargs, solver, layout):
    x, w, b = _leaves(x_shape, w_shape, layout, seed=4)
    conv = CONV[len(x_shape) - 2][0]
    assert torch.autograd.gradgradcheck(
        lambda x, w, b: conv(x, w, b, **kwargs), (x, w, b), fast_mode=True
    )


def test_second_order_pass_runs_gemmconv_ops(monkeypatch):
    # Forced: a problem this small would otherwise go to the vendor forward with
    # torch's fused backward (eager._Call.vendor_serves), and no gemmconv op at all.
    monkeypatch.setenv("GEMMCONV_SOLVER", "patch")
    x, w, b = _leaves((2, 3, 8, 8), (6, 3, 4, 4), Layout.CHANNELS_FIRST, seed=5)
    gx, gw = torch.autograd.grad(
        gemmconv.conv2d(x, w, b, stride=4).tanh().sum(), (x, w), create_graph=True
    )
    # dy here is tanh'(y), itself a function of w, so d|gx|^2/dw runs the backward of
    # backward-data in its weight (backward-weights) and in dy (a forward op, whose
    # own backward then reaches w through y).
    with GemmconvOpLog() as log:
        (gw_of_gx,) = torch.autograd.grad(gx.square().sum(), (w,), retain_graph=True)
    assert {"conv_backward_weights", "conv_forward"} <= set(log.calls)
    assert gw_of_gx.shape == w.shape
    # d|gw|^2/dx: the backward of backward-weights in its input is backward-data.
    with GemmconvOpLog() as log:
        (gx_of_gw,) = torch.autograd.grad(gw.square().sum(), (x,))
    assert "conv_backward_data" in log.calls
    assert gx_of_gw.shape == x.shape


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: v.value)
@pytest.mark.parametrize("label,x_shape,w_shape,kwargs,solver", CASES, ids=[c[0] for c in CASES])
def test_gradient_penalty_matches_torch_on_cuda(label, x_shape, w_shape, kwargs, solver, layout):
    """The same second-order gradients on CUDA in float64, whichever solvers the GPU's
    cost model picks there, against torch's on the CPU."""
    x, w, b = _leaves(x_shape, w_shape, layout, seed=6)
    ours, theirs = CONV[len(x_shape) - 2]
    want = _penalised_gradients(theirs, x, w, b, kwargs)
    on_gpu = [t.detach().cuda().requires_grad_(True) for t in (x, w, b)]
    got = _penalised_gradients(ours, *on_gpu, kwargs)
    for name, a, e in zip(("x", "w", "b"), got, want, strict=True):
        torch.testing.assert_close(
            a.cpu(), e, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}"
        )
