"""The eager road (gemmconv.roads.eager): plain eager calls skip the custom-op dispatcher and
get the same answers; anything that traces, transforms or intercepts takes the ops."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import gemmconv
from gemmconv.core.problem import ConvProblem
from gemmconv.measuring.verify import tolerance
from gemmconv.roads import eager
from gemmconv.selection import dispatch

from conftest import GemmconvOpLog


def _operands(seed: int, channels_last: bool = False, bias: bool = True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(3, 4, 12, 12, generator=gen, dtype=torch.float64) * 2 - 1
    w = torch.rand(6, 4, 3, 3, generator=gen, dtype=torch.float64) * 2 - 1
    b = torch.rand(6, generator=gen, dtype=torch.float64) * 2 - 1 if bias else None
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    return x, w, b


def _grads(conv, x, w, b, **kw):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    b = None if b is None else b.detach().requires_grad_()
    y = conv(x, w, b, **kw)
    dy = torch.rand(y.shape, generator=torch.Generator().manual_seed(7), dtype=y.dtype)
    leaves = [t for t in (x, w, b) if t is not None]
    return y, torch.autograd.grad(y, leaves, dy)


@pytest.mark.parametrize("channels_last", [False, True], ids=["cf", "cl"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize(
    "kw", [{"stride": 3}, {"stride": 1}, {"stride": 2, "padding": 1}], ids=["patch", "s1", "pad"]
)
def test_eager_road_matches_torch_in_every_direction(channels_last, bias, kw):
    x, w, b = _operands(1, channels_last, bias)
    if kw == {"stride": 1}:
        w = w[:, :, :1, :1].contiguous()  # a 1x1: the pointwise solver
    eager.clear()
    y, grads = _grads(gemmconv.conv2d, x, w, b, **kw)
    assert eager._calls, "the call did not take the eager road"
    y_ref, grads_ref = _grads(F.conv2d, x, w, b, **kw)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    assert y.stride() == y_ref.stride()
    for got, want in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_second_call_reuses_the_first_calls_plan(monkeypatch):
    x, w, b = _operands(2)
    gemmconv.conv2d(x, w, b, stride=3)
    built = []
    original = eager._new_call
    monkeypatch.setattr(eager, "_new_call", lambda *a: built.append(a) or original(*a))
    for seed in (3, 4):
        x2, w2, b2 = _operands(seed)
        y = gemmconv.conv2d(x2, w2, b2, stride=3)
        torch.testing.assert_close(y, F.conv2d(x2, w2, b2, stride=3), rtol=1e-12, atol=1e-12)
    assert built == []
    gemmconv.conv2d(x.to(memory_format=torch.channels_last), w, b, stride=3)
    assert len(built) == 1  # other strides: another plan


def test_calls_the_road_does_not_cover_take_the_ops_and_agree():
    x, w, b = _operands(5)
    eager.clear()
    # A list argument (unhashable) and 'same' with an even kernel (pads the input first).
    for kw in ({"stride": [3, 3]}, {"padding": "same"}):
        weight = w if "stride" in kw else w[:, :, :2, :2].contiguous()
        y, grads = _grads(gemmconv.conv2d, x, weight, b, **kw)
        y_ref, grads_ref = _grads(F.conv2d, x, weight, b, **kw)
        torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
        for got, want in zip(grads, grads_ref, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert all(call is None for call in eager._calls.values())


def test_a_dispatch_mode_sees_the_custom_ops():
    x, w, b = _operands(6)
    gemmconv.conv2d(x, w, b, stride=3)  # the eager road first, then under a mode
    x.requires_grad_()
    with GemmconvOpLog() as log:
        gemmconv.conv2d(x, w, b, stride=3).sum().backward()
    assert log.calls == ["conv_forward", "conv_backward_data"]


def test_tracing_takes_the_ops():
    x, w, b = _operands(7)

    def f(x):
        return gemmconv.conv2d(x, w, b, stride=3)

    traced = torch.jit.trace(f, (x,), check_trace=False)
    assert "gemmconv::conv_forward" in str(traced.graph)
    gm = torch.fx.experimental.proxy_tensor.make_fx(f)(x)
    assert "gemmconv.conv_forward" in gm.code


def test_forward_mode_and_meta_tensors_close_the_road():
    x, w, b = _operands(8)
    eager.clear()
    with torch.autograd.forward_ad.dual_level():
        assert eager.convolve(2, x, w, b, 3, 0, 1, 1) is None
    assert not eager._calls  # closed before the key: nothing was looked up
    meta = x.to("meta")
    assert eager.convolve(2, meta, w.to("meta"), None, 3, 0, 1, 1) is None
    assert list(eager._calls.values()) == [None]  # the meta device: the op road, kept
    y = gemmconv.conv2d(meta, w.to("meta"), None, stride=3)
    assert y.device.type == "meta" and y.shape == (3, 6, 4, 4)


@pytest.mark.parametrize(
    "bad", [{"stride": 3.0}, {"stride": (3, 3.0)}, {"padding": False}, {"groups": True}]
)
def test_arguments_equal_to_a_checked_call_but_of_other_kinds_are_refused(bad):
    # 3.0 == 3 and False == 0 hash alike, so they find the checked call's entry; torch
    # refuses floats and bools there, and so must the road.
    x, w, b = _operands(11)
    good = {"stride": 3, "padding": 0, "groups": 1}
    gemmconv.conv2d(x, w, b, **good)
    gemmconv.conv2d(x, w, b, **{**good, "stride": (3, 3)})
    call = {**good, **bad}
    with pytest.raises(TypeError) as torch_error:
        F.conv2d(x, w, b, **call)
    with pytest.raises(TypeError, match="expected an integer") as ours:
        gemmconv.conv2d(x, w, b, **call)
    assert ours.type is torch_error.type


def test_equal_arguments_built_afresh_take_the_checked_call(monkeypatch):
    x, w, b = _operands(12)
    eager.clear()
    gemmconv.conv2d(x, w, b, stride=(3, 3))
    (call,) = eager._calls.values()
    typed_checks = []
    same_kinds = eager._same_kinds
    monkeypatch.setattr(eager, "_same_kinds", lambda *a: typed_checks.append(a) or same_kinds(*a))
    stride = tuple([3] * 2)  # equal, of the same kinds, another object
    for _ in range(2):
        y = gemmconv.conv2d(x, w, b, stride=stride)
        torch.testing.assert_close(y, F.conv2d(x, w, b, stride=3), rtol=1e-12, atol=1e-12)
    assert list(eager._calls.values()) == [call]
    # Checked by type once, then found by identity (as a second module of the same
    # configuration, with its own tuples, would be).
    assert len(typed_checks) == 1 and call.accepted[-1][0] is stride
    with pytest.raises(TypeError, match="expected an integer"):
        gemmconv.conv2d(x, w, b, stride=(3, 3.0))


@pytest.mark.parametrize(
    ("dims", "kw"),
    [
        (2, {}),
        (2, {"stride": 2}),
        (2, {"stride": (2, 1), "padding": 1}),
        (2, {"padding": "same", "dilation": 2}),
        (2, {"groups": 2}),
        (1, {"stride": 3, "padding": 1}),
        (3, {"dilation": (1, 2, 1)}),
    ],
)
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
def test_vendor_calls_on_the_road_match_torch(monkeypatch, dims, kw, batched):
    monkeypatch.setenv("GEMMCONV_SOLVER", "vendor")
    gen = torch.Generator().manual_seed(13)
    x = torch.rand(2, 4, *(9,) * dims, generator=gen, dtype=torch.float64)
    w = torch.rand(6, 4 // kw.get("groups", 1), *(3,) * dims, generator=gen, dtype=torch.float64)
    b = torch.rand(6, generator=gen, dtype=torch.float64)
    if not batched:
        x = x[0]
    conv = {1: gemmconv.conv1d, 2: gemmconv.conv2d, 3: gemmconv.conv3d}[dims]
    reference = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[dims]
    eager.clear()
    for _ in range(2):  # the first call builds the road's entry, the second uses it
        y, grads = _grads(conv, x, w, b, **kw)
        (call,) = eager._calls.values()
        assert call is not None and call.vendor_forward
        y_ref, grads_ref = _grads(reference, x, w, b, **kw)
        torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
        for got, want in zip(grads, grads_ref, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_vendor_arguments_are_the_shortest_that_say_the_same():
    shortest = eager._shortest_arguments
    assert shortest([1, 1], [0, 0], [1, 1], 1) == ()
    assert shortest([16, 16], [0, 0], [1, 1], 1) == (16,)
    assert shortest([2, 1], [0, 0], [1, 1], 1) == ((2, 1),)
    assert shortest([1, 1], [1, 1], [1, 1], 1) == (1, 1)
    assert shortest([1, 1, 1], [0, 0, 0], [1, 2, 1], 1) == (1, 0, (1, 2, 1))
    assert shortest([1], [0], [1], 2) == (1, 0, 1, 2)


def test_errors_on_the_eager_road_are_torchs():
    x, w, b = _operands(9)
    with pytest.raises(RuntimeError, match="bias of shape"):
        gemmconv.conv2d(x, w, b[:3], stride=3)
    with pytest.raises(TypeError, match="input is a list"):
        gemmconv.conv2d([1.0], w, b)
    with pytest.raises(TypeError, match="bias is a str"):
        gemmconv.conv2d(x, w, "bias")


def test_saved_tensors_modified_in_place_are_caught_as_by_torch():
    x, w, b = _operands(10)
    w = w.detach().requires_grad_()
    xg = x.clone().requires_grad_()
    y = gemmconv.conv2d(xg * 1.0, w, b, stride=3)
    with torch.no_grad():
        w.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_unbatched_and_autocast_on_the_eager_road():
    x, w, b = _operands(11)
    y = gemmconv.conv2d(x[0], w, b, stride=3)
    torch.testing.assert_close(y, F.conv2d(x[0], w, b, stride=3), rtol=1e-12, atol=1e-12)
    xf, wf, bf = x.float(), w.float(), b.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_ours = gemmconv.conv2d(xf, wf, bf, stride=3)
        y_torch = F.conv2d(xf, wf, bf, stride=3)
    assert y_ours.dtype == y_torch.dtype == torch.bfloat16
    torch.testing.assert_close(y_ours.float(), y_torch.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    ("spatial", "kernel", "fused"),
    [(16, 4, True), (64, 16, False)],
    ids=["saving-below-the-node", "saving-above-the-node"],
)
def test_a_vendor_forward_keeps_torchs_fused_backward_unless_gemm_saves_more(
    spatial, kernel, fused, caplog
):
    """Both problems send the forward and dW to the vendor and dX to `patch`. Where
    the estimated saving of `patch` over the vendor on dX (2.6 us for the 4x4 patch) is
    below what gemmconv's autograd node costs the CPU's host (autograd_node_us), the
    call is torch's convolution with its fused backward, and the dispatch log says so
    at INFO, as it reports every fallback to the vendor; where it is above (111 us for
    the 16x16 patch), gemmconv's node runs dX on `patch`. Gradients match float64
    either way."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, spatial, spatial, generator=gen).to(memory_format=torch.channels_last)
    w = torch.randn(8, 3, kernel, kernel, generator=gen)
    choices = gemmconv.explain(x, w, None, kernel)
    assert [c.solver for c in choices.values()] == ["vendor", "patch", "vendor"]
    saving_us = 1e3 * (choices["backward_data"].estimates_ms["vendor"]
                       - choices["backward_data"].estimates_ms["patch"])  # fmt: skip
    node_us = gemmconv.core.device_rates.CPU.autograd_node_us
    assert (saving_us < node_us) == fused
    reports = _train_and_check(x, w, kernel, fused, gen, caplog)
    if fused:
        assert "backward_data patch" in reports[0] and f"({node_us:.0f} us)" in reports[0]


def _train_and_check(x, w, stride, fused, gen, caplog) -> list[str]:
    """Call the convolution with x and w needing gradients: its node must be torch's
    fused backward where ``fused`` (the dispatch log reporting it once at INFO) and
    gemmconv's otherwise, and its gradients must match float64. Returns the reports."""
    x, w = x.requires_grad_(), w.requires_grad_()
    with caplog.at_level(logging.INFO, logger="gemmconv.dispatch"):
        y = gemmconv.conv2d(x, w, stride=stride)
    node = type(y.grad_fn).__name__
    assert node == ("ConvolutionBackward0" if fused else "_EagerConvolutionBackward"), node
    reports = [
        r.getMessage() for r in caplog.records if "its fused backward in place of" in r.getMessage()
    ]
    assert len(reports) == fused
    dy = torch.randn(y.shape, generator=gen)
    grads = torch.autograd.grad(y, (x, w), dy)
    leaves = [t.detach().double().requires_grad_() for t in (x, w)]
    refs = torch.autograd.grad(F.conv2d(*leaves, stride=stride), leaves, dy.double())
    for got, want in zip(grads, refs, strict=True):
        # An element near zero carries the rounding of its reduction's terms, which grows
        # with the gradient's scale (dW sums 6272 products at 8x28x28, |dW| up to ~300):
        # the absolute floor is fp32's tolerance of that scale, not a fixed number.
        atol = tolerance(torch.float32, "cpu") * want.abs().max().item()
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=atol)
    # explain() of these operands, which need gradients, says the same as the log.
    explanation = gemmconv.explain(x, w, None, stride)
    assert len(explanation.notes) == fused
    if fused:
        assert explanation.notes[0] in reports[0] and explanation.notes[0] in repr(explanation)
    return reports


@pytest.fixture
def blas_ahead_of_onednn_on_1x1(monkeypatch):
    """Price the CPU as a host whose BLAS runs a 1x1's GEMM ahead of oneDNN's 1x1
    convolution (the CPU entry's vendor_pointwise before its fit to the 2-core EPYC,
    where oneDNN ran them 1.2-2.5x faster), so that `pointwise` wins the estimates and
    the rule between its saving and the node's cost is what decides."""
    import dataclasses

    from gemmconv.core import device_rates

    factors = {**device_rates.CPU.factors, "vendor_pointwise": 0.8}
    monkeypatch.setattr(device_rates, "CPU", dataclasses.replace(device_rates.CPU,
                        factors=factors))  # fmt: skip


@pytest.mark.usefixtures("blas_ahead_of_onednn_on_1x1")
@pytest.mark.parametrize(
    ("size", "fused"),
    [(16, True), (28, False)],
    ids=["saving-below-the-node", "saving-above-the-node"],
)
def test_a_gemm_forward_that_saves_less_than_the_node_leaves_training_calls_to_torch(
    size, fused, caplog, monkeypatch
):
    """A channels-last 1x1 (64 -> 64 channels) chooses `pointwise` in every direction
    on such a CPU. At 4x16x16 it saves 17 us a direction over the vendor by the estimates,
    51 for a training call's forward, dX and dW together, less than gemmconv's autograd
    node costs the CPU's host (60 us): a call that needs gradients is torch's
    convolution with its fused backward, reported at INFO, while inference still runs
    `pointwise`. At 8x28x28 (124 us a direction) gemmconv's node serves the call.
    Results match float64 either way."""
    gen = torch.Generator().manual_seed(6)
    n = 4 if size == 16 else 8
    x = torch.randn(n, 64, size, size, generator=gen).to(memory_format=torch.channels_last)
    w = torch.randn(64, 64, 1, 1, generator=gen)
    choices = gemmconv.explain(x, w, None, 1)
    assert {c.solver for c in choices.values()} == {"pointwise"}
    saving_us = 1e3 * sum(c.estimates_ms["vendor"] - c.estimates_ms["pointwise"]
                          for c in choices.values())  # fmt: skip
    assert (saving_us < gemmconv.core.device_rates.CPU.autograd_node_us) == fused
    solvers_run = []
    run_forward = eager.ops.run_forward

    def recording_run_forward(plan, *operands):
        solvers_run.append(plan.solver.id)
        return run_forward(plan, *operands)

    monkeypatch.setattr(eager.ops, "run_forward", recording_run_forward)
    with torch.no_grad():
        gemmconv.conv2d(x, w)
    assert solvers_run == ["pointwise"]
    reports = _train_and_check(x, w, 1, fused, gen, caplog)
    if fused:
        assert (
            "forward pointwise, backward_data pointwise, backward_weights pointwise" in reports[0]
        )


@pytest.mark.usefixtures("blas_ahead_of_onednn_on_1x1")
def test_a_modules_solvers_say_which_training_calls_run_torchs_convolution():
    """The 1x1 above whose GEMMs save less than the node, as a gemmconv.nn module: its
    table names `pointwise`, and its notes say that calls needing gradients run torch's
    convolution: for a given input as that input needs them, after a forward (whose
    input's need is not kept) with and without dx; none for a frozen module's input
    that needs none."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(4, 64, 16, 16, generator=gen).to(memory_format=torch.channels_last)
    conv = gemmconv.nn.Conv2d(64, 64, 1, bias=False)
    assert {c.solver for c in conv.solvers(x).values()} == {"pointwise"}
    (note,) = conv.solvers(x).notes
    assert note.startswith("eager calls that need dW run torch's convolution")
    (note,) = conv.solvers(x.requires_grad_()).notes
    assert note.startswith("eager calls that need dx and dW run torch's convolution")
    y = conv(x)
    assert type(y.grad_fn).__name__ == "ConvolutionBackward0"
    after = conv.solvers()
    assert [n.split(" run ")[0] for n in after.notes] == [
        "eager calls that need dW",
        "eager calls that need dx and dW",
    ]
    assert all(n in repr(after) for n in after.notes)
    conv.requires_grad_(False)
    assert conv.solvers(x.detach()).notes == []


@pytest.mark.usefixtures("work_costs_only")
def test_every_direction_on_the_vendor_is_torchs_fused_call_whatever_the_node_costs(
    monkeypatch,
):
    monkeypatch.setenv("GEMMCONV_SOLVER", "vendor")
    x, w, b = (t.requires_grad_() for t in _operands(3))
    y = gemmconv.conv2d(x, w, b, stride=3)
    assert type(y.grad_fn).__name__ == "ConvolutionBackward0"


def test_only_the_needed_gradients_decide_between_torchs_backward_and_gemmconvs():
    """The 16x16 patch sends dX to `patch`, saving more than the node costs, and dW to
    the vendor: a call that needs dX crosses gemmconv's node, one that needs only dW
    (a patch embed's pixels need no gradient) keeps torch's fused backward."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 64, 64, generator=gen).to(memory_format=torch.channels_last)
    w = torch.randn(8, 3, 16, 16, generator=gen, requires_grad=True)
    dy = torch.randn(2, 8, 4, 4, generator=gen)
    for x_needs_grad, node in (
        (True, "_EagerConvolutionBackward"),
        (False, "ConvolutionBackward0"),
    ):
        leaf = x.detach().requires_grad_(x_needs_grad)
        y = gemmconv.conv2d(leaf, w, stride=16)
        assert type(y.grad_fn).__name__ == node
        (dw,) = torch.autograd.grad(y, w, dy)
        w64 = w.detach().double().requires_grad_()
        (want,) = torch.autograd.grad(F.conv2d(x.double(), w64, stride=16), w64, dy.double())
        torch.testing.assert_close(dw.double(), want, rtol=1e-4, atol=1e-4)


def test_non_strict_export_takes_the_ops(monkeypatch):
    # It sets torch.compiler.is_compiling(), which the road does not ask: it traces
    # under dispatch modes, which close the road.
    x, w, b = _operands(14)
    gemmconv.conv2d(x, w, b, stride=3)  # the road's entry exists before the export
    answers = []
    road = eager.convolve
    monkeypatch.setattr(eager, "convolve", lambda *a: answers.append(road(*a)) or answers[-1])

    class Embed(torch.nn.Module):
        def forward(self, x):
            return gemmconv.conv2d(x, w, b, stride=3)

    program = torch.export.export(Embed(), (x,), strict=False)
    assert answers == [None]
    targets = [node.target for node in program.graph.nodes if node.op == "call_function"]
    assert targets == [torch.ops.aten.convolution.default]  # the ops' portable form


def test_a_strided_bias_takes_the_dense_ones_entry_and_is_read_through_its_strides():
    x, w, b = _operands(15)
    eager.clear()
    gemmconv.conv2d(x, w, b, stride=3)
    strided = torch.stack([b, torch.full_like(b, float("nan"))], dim=1)[:, 0]
    assert strided.stride() == (2,)
    y = gemmconv.conv2d(x, w, strided, stride=3)
    assert len(eager._calls) == 1  # its strides are not in the key
    torch.testing.assert_close(y, F.conv2d(x, w, b, stride=3), rtol=1e-12, atol=1e-12)


def test_an_entry_remembers_a_bounded_few_argument_objects():
    x, w, b = _operands(16)
    eager.clear()
    first = (3, 3)
    gemmconv.conv2d(x, w, b, stride=first)
    (call,) = eager._calls.values()
    for _ in range(3 * eager._ACCEPTED_MAX):
        gemmconv.conv2d(x, w, b, stride=tuple([3] * 2))
    assert 1 < len(call.accepted) <= eager._ACCEPTED_MAX
    assert call.accepted[0][0] is first  # the checked call's, kept


def test_operands_left_by_a_finished_torch_func_transform_convolve_as_torchs(monkeypatch):
    """The road calls autograd's C apply itself (torch's Python wrapper, up to torch
    2.13, unwrapped such operands first; the road does it too): a weight captured
    inside torch.func.grad and used after it gives torch's result and gradients."""
    monkeypatch.setenv("GEMMCONV_SOLVER", "patch")
    x, w, b = _operands(17)
    leaked = []

    def captured(t):
        leaked.append(t)
        return t.sum()

    torch.func.grad(captured)(w)
    (dead,) = leaked
    assert torch._C._functorch.is_functorch_wrapped_tensor(dead)
    x = x.requires_grad_()
    results = []
    for conv in (gemmconv.conv2d, F.conv2d):
        y = conv(x, dead, b, stride=3)
        results.append((y, *torch.autograd.grad(y.sum(), (x, dead), allow_unused=True)))
    ((call,),) = [[c for c in eager._calls.values() if c is not None]]
    assert call.plan.solver.id == "patch"
    (y, dx, dw), (y_ref, dx_ref, dw_ref) = results
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-12, atol=1e-12)
    assert dw is None and dw_ref is None  # autograd sees no path to a dead wrapper


def _forward_and_weight_gradient(x, w, dy, stride):
    """y, dW and what y's node saved, from one gemmconv call that needs dW alone."""
    w = w.detach().requires_grad_()
    y = gemmconv.conv2d(x, w, stride=stride)
    saved = y.grad_fn.saved_tensors
    (dw,) = torch.autograd.grad(y, w, dy)
    return y, dw, saved


@pytest.mark.parametrize(
    ("forward_solver", "kept", "switched"),
    [("im2col", True, True), ("vendor", False, False), ("patch", True, False)],
)
def test_a_forward_needing_dw_gathers_the_columns_its_weight_gradient_multiplies(
    monkeypatch, forward_solver, kept, switched
):
    # dW is a column GEMM (patch); the forward was decided otherwise. Where it gathers no
    # columns and is not the vendor's, a call that needs dW runs patch's forward, which
    # keeps its columns for dW: one gather for both GEMMs, as the rewrite makes. (16
    # pixels a sample and 64-element rows: patch's GEMMs read aligned rows.)
    monkeypatch.setenv("GEMMCONV_SOLVER", "patch")
    dispatch.clear_cache()
    generator = torch.Generator().manual_seed(5)
    x = torch.rand(3, 4, 16, 16, generator=generator) * 2 - 1
    w = torch.rand(6, 4, 4, 4, generator=generator) * 2 - 1
    dy = torch.rand(3, 6, 4, 4, generator=generator) * 2 - 1
    forward = ConvProblem.from_tensors(x, w, None, (4, 4), (0, 0), (1, 1), 1)
    with dispatch.trial(forward, forward_solver):
        y, dw, saved = _forward_and_weight_gradient(x, w, dy, 4)
        notes = gemmconv.explain(x, w.requires_grad_(), stride=4).notes
        w.requires_grad_(False)
    assert (saved[2] is not None) == kept
    said = [n for n in notes if "run the forward with patch" in n]
    assert len(said) == switched, notes
    x64, w64 = x.double(), w.double().requires_grad_()
    y64 = F.conv2d(x64, w64, stride=4)
    (dw64,) = torch.autograd.grad(y64, w64, dy.double())
    assert torch.allclose(y.double(), y64, atol=1e-5)
    assert torch.allclose(dw.double(), dw64, atol=1e-5)


def test_under_batch_invariance_the_forward_needing_dw_keeps_its_own_solver(monkeypatch):
    monkeypatch.setenv("GEMMCONV_SOLVER", "patch")
    dispatch.clear_cache()
    x, w, dy = torch.rand(2, 4, 16, 16), torch.rand(6, 4, 4, 4), torch.rand(2, 6, 4, 4)
    forward = ConvProblem.from_tensors(x, w, None, (4, 4), (0, 0), (1, 1), 1)
    with gemmconv.batch_invariant(), dispatch.trial(forward, "im2col"):
        _, _, saved = _forward_and_weight_gradient(x, w, dy, 4)
    assert saved[2] is None


def test_a_weight_gradient_reading_x_as_its_columns_leaves_the_forward_alone(monkeypatch):
    # point_output on one patch a sample multiplies x's own memory: no gather to share.
    monkeypatch.setenv("GEMMCONV_SOLVER", "point_output")
    dispatch.clear_cache()
    x, w, dy = torch.rand(5, 4, 4, 4), torch.rand(6, 4, 4, 4), torch.rand(5, 6, 1, 1)
    forward = ConvProblem.from_tensors(x, w, None, (4, 4), (0, 0), (1, 1), 1)
    with dispatch.trial(forward, "im2col"):
        _, dw, saved = _forward_and_weight_gradient(x, w, dy, 4)
        notes = gemmconv.explain(x, w.requires_grad_(), stride=4).notes
        w.requires_grad_(False)
    assert saved[2] is None
    assert not any("run the forward with" in n for n in notes), notes
    dw64 = torch.einsum("nk,nr->kr", dy.double().flatten(1), x.double().flatten(1))
    assert torch.allclose(dw.double().flatten(1), dw64, atol=1e-5)


def test_a_weight_gradient_whose_forward_gemm_reads_unaligned_rows_leaves_the_forward_alone(
    monkeypatch,
):
    # patch on 3 x 14 x 14 patches of one output pixel in 2 (its rows 588 bf16 elements,
    # not whole 16-byte vectors): cuBLAS runs such rows slowly, an implicit GEMM not.
    monkeypatch.setenv("GEMMCONV_SOLVER", "patch")
    dispatch.clear_cache()
    x = torch.rand(2, 3, 28, 14, dtype=torch.bfloat16)
    w = torch.rand(8, 3, 14, 14, dtype=torch.bfloat16)
    dy = torch.rand(2, 8, 2, 1, dtype=torch.bfloat16)
    forward = ConvProblem.from_tensors(x, w, None, (14, 14), (0, 0), (1, 1), 1)
    with dispatch.trial(forward, "im2col"):
        _, _, saved = _forward_and_weight_gradient(x, w, dy, 14)
    assert saved[2] is None


def _cuda_problem(n, c, spatial, kernel, k, dtype, layout="channels_first"):
    from gemmconv.core.memory_format import Layout

    return ConvProblem.from_sizes(
        n=n, c=c, k=k, spatial=spatial, kernel=kernel, stride=kernel,
        layout=Layout(layout), dtype=dtype, device_type="cuda",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("forward_solver", "problem", "expected"),
    [
        # Qwen2-VL's embed at one patch: 1176 bf16 elements a row, whole 16-byte vectors.
        (
            "patch_implicit",
            ((1, 3, (2, 14, 14), (2, 14, 14), 1280), torch.bfloat16),
            "point_output",
        ),
        ("patch", ((1, 3, (2, 14, 14), (2, 14, 14), 1280), torch.bfloat16), "point_output"),
        ("point_output", ((1, 3, (2, 14, 14), (2, 14, 14), 1280), torch.bfloat16), "point_output"),
        # Point 2D's rows, 588 bf16 elements: cuBLAS reads them slowly, the implicit GEMM not.
        ("patch_implicit", ((4, 3, (14, 14), (14, 14), 1280), torch.bfloat16), None),
        ("vendor", ((1, 3, (2, 14, 14), (2, 14, 14), 1280), torch.bfloat16), None),
        ("im2col", ((1, 3, (2, 14, 14), (2, 14, 14), 1280), torch.bfloat16), None),
        ("patch_triton", ((1, 3, (2, 14, 14), (2, 14, 14), 1280), torch.bfloat16), None),
        # Not one patch a sample: no rows of x to multiply.
        ("patch_implicit", ((2, 3, (32, 32), (16, 16), 768), torch.bfloat16), None),
    ],
)
def test_the_nodes_gemm_follows_forwards_that_are_it_or_lose_to_it(
    forward_solver, problem, expected
):
    # A training call runs the C++ node's one GEMM where the forward chose it, chose it
    # under another name, or chose the implicit GEMM on its host price over rows cuBLAS
    # reads aligned (rows_solver); not after the vendor, im2col or a copied gather.
    from gemmconv.solvers import get_solver

    (n, c, spatial, kernel, k), dtype = problem
    p = _cuda_problem(n, c, spatial, kernel, k, dtype)
    assert eager.rows_solver(p, get_solver(forward_solver)) == expected


def test_a_channels_last_1x1_after_the_implicit_gemm_takes_the_pointwise_gemm():
    from gemmconv.solvers import get_solver

    p = _cuda_problem(8, 64, (14, 14), (1, 1), 128, torch.bfloat16, "channels_last")
    assert eager.rows_solver(p, get_solver("patch_implicit")) == "pointwise"
