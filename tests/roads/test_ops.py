"""The custom ops: opcheck, fake/real agreement on shapes and strides, values against a
float64 reference, torch.compile without graph breaks or recompiles, autocast,
checkpointing, and backward ops run only for the gradients that are needed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend
from torch.library import opcheck

import gemmconv
from gemmconv.core.memory_format import Layout
from gemmconv.measuring.verify import rms_range, tolerance
from gemmconv.roads import ops

from conftest import GemmconvOpLog, random_in

CONV = {
    1: (gemmconv.conv1d, F.conv1d),
    2: (gemmconv.conv2d, F.conv2d),
    3: (gemmconv.conv3d, F.conv3d),
}

# (label, input shape, weight shape, stride, padding): every solver family plus the
# vendor fallback (padded 3x3).
CASES = [
    ("patch_2d", (2, 3, 9, 10), (5, 3, 4, 4), [4, 4], [0, 0]),
    ("point_2d", (3, 3, 6, 6), (4, 3, 6, 6), [6, 6], [0, 0]),
    ("pointwise_2d", (2, 6, 5, 4), (3, 6, 1, 1), [1, 1], [0, 0]),
    ("strided_pw_2d", (2, 6, 5, 7), (3, 6, 1, 1), [2, 2], [0, 0]),
    ("patch_1d", (2, 3, 11), (4, 3, 5), [5], [0]),
    ("patch_3d", (2, 2, 4, 6, 6), (3, 2, 2, 3, 3), [2, 3, 3], [0, 0, 0]),
    ("vendor_2d", (2, 3, 6, 6), (4, 3, 3, 3), [1, 1], [1, 1]),
]
LAYOUTS = [Layout.CHANNELS_FIRST, Layout.CHANNELS_LAST]


def _operands(x_shape, w_shape, layout, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = random_in(x_shape, layout, dtype, "cpu", g)
    w = random_in(w_shape, layout, dtype, "cpu", g)
    b = random_in((w_shape[0],), Layout.CHANNELS_FIRST, dtype, "cpu", g)
    return x, w, b


def _dims(shape) -> int:
    return len(shape) - 2


# opcheck is slow (it traces every op under AOT dispatch), so each case runs in one
# layout, alternating, and patch_2d in both.
OPCHECK_CASES = [(*c, LAYOUTS[i % 2]) for i, c in enumerate(CASES)] + [(*CASES[0], LAYOUTS[1])]


@pytest.mark.parametrize(
    "label,x_shape,w_shape,stride,padding,layout",
    OPCHECK_CASES,
    ids=[f"{c[0]}-{c[-1].value}" for c in OPCHECK_CASES],
)
def test_opcheck_each_op(label, x_shape, w_shape, stride, padding, layout):
    x, w, b = _operands(x_shape, w_shape, layout)
    dims = _dims(x_shape)
    dilation = [1] * dims
    x.requires_grad_(True), w.requires_grad_(True), b.requires_grad_(True)
    opcheck(torch.ops.gemmconv.conv_forward.default, (x, w, b, stride, padding, dilation, 1))
    opcheck(torch.ops.gemmconv.conv_forward.default, (x, w, None, stride, padding, dilation, 1))
    y_shape = CONV[dims][1](x, w, b, stride, padding).shape
    g = torch.Generator().manual_seed(1)
    # dy and the operands require grad, so opcheck also checks the backward ops' own
    # autograd formulas (double backward).
    dy = random_in(y_shape, layout, torch.float32, "cpu", g).requires_grad_(True)
    channels_last = layout is Layout.CHANNELS_LAST
    args = (stride, padding, dilation, 1, channels_last)
    opcheck(
        torch.ops.gemmconv.conv_backward_data.default,
        (dy, w, list(x_shape), *args),
    )
    opcheck(
        torch.ops.gemmconv.conv_backward_weights.default,
        (dy, x, list(w_shape), *args),
    )


@pytest.mark.parametrize(
    "x_layout,w_layout",
    [(a, b) for a in LAYOUTS for b in LAYOUTS],
    ids=lambda v: v.value,
)
@pytest.mark.parametrize("label,x_shape,w_shape,stride,padding", CASES, ids=[c[0] for c in CASES])
def test_fake_matches_real_and_torch_layout(
    label, x_shape, w_shape, stride, padding, x_layout, w_layout
):
    """Shapes and strides of the real op equal the fake op's and F.conv*'s, for every
    combination of input and weight layout (channels-last wins, as in torch; a 1-D
    convolution with a transposed weight gives a channels-last output, as torch's)."""
    g = torch.Generator().manual_seed(2)
    x = random_in(x_shape, x_layout, torch.float32, "cpu", g)
    w = random_in(w_shape, w_layout, torch.float32, "cpu", g)
    dims = _dims(x_shape)
    args = (stride, padding, [1] * dims, 1)
    real = torch.ops.gemmconv.conv_forward(x, w, None, *args)
    with torch._subclasses.FakeTensorMode() as mode:
        fake = torch.ops.gemmconv.conv_forward(
            mode.from_tensor(x), mode.from_tensor(w), None, *args
        )
    torch_y = CONV[dims][1](x, w, None, stride, padding)
    assert real.shape == fake.shape == torch_y.shape
    assert real.stride() == fake.stride()
    assert real.is_contiguous() == torch_y.is_contiguous()


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: v.value)
@pytest.mark.parametrize("label,x_shape,w_shape,stride,padding", CASES, ids=[c[0] for c in CASES])
def test_values_and_gradients_match_float64(label, x_shape, w_shape, stride, padding, layout):
    dims = _dims(x_shape)
    ours, theirs = CONV[dims]
    x, w, b = _operands(x_shape, w_shape, layout, seed=3)
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
    leaves64 = [t.double().requires_grad_(True) for t in (x, w, b)]
    y = ours(*leaves, stride=stride, padding=padding)
    y64 = theirs(*leaves64, stride=stride, padding=padding)
    dy = random_in(
        y.shape, Layout.CHANNELS_FIRST, torch.float32, "cpu", torch.Generator().manual_seed(4)
    )
    y.backward(dy)
    y64.backward(dy.double())
    tol = tolerance(torch.float32, "cpu")
    assert rms_range(y, y64) <= tol
    for mine, ref in zip(leaves, leaves64, strict=True):
        assert rms_range(mine.grad, ref.grad) <= tol


# ---- torch.compile ----------------------------------------------------------------


def _patch_embed_loss(x, w, b):
    return gemmconv.conv2d(x, w, b, stride=4).flatten(2).transpose(1, 2).square().mean()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_dynamic_batch_no_recompile(backend):
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(_patch_embed_loss, backend=counter, fullgraph=True, dynamic=True)
    g = torch.Generator().manual_seed(5)
    w = random_in((6, 3, 4, 4), Layout.CHANNELS_FIRST, torch.float32, "cpu", g).requires_grad_()
    b = random_in((6,), Layout.CHANNELS_FIRST, torch.float32, "cpu", g).requires_grad_()
    for n in (2, 3, 5):
        x = random_in((n, 3, 8, 12), Layout.CHANNELS_FIRST, torch.float32, "cpu", g)
        x.requires_grad_(True)
        loss = compiled(x, w, b)
        grads = torch.autograd.grad(loss, (x, w, b))
        x_ref, w_ref, b_ref = (t.detach().double().requires_grad_() for t in (x, w, b))
        ref = F.conv2d(x_ref, w_ref, b_ref, stride=4).flatten(2).transpose(1, 2).square().mean()
        ref_grads = torch.autograd.grad(ref, (x_ref, w_ref, b_ref))
        assert rms_range(loss, ref) <= tolerance(torch.float32, "cpu")
        for mine, theirs in zip(grads, ref_grads, strict=True):
            assert rms_range(mine, theirs) <= tolerance(torch.float32, "cpu")
    assert counter.frame_count == 1, "a new batch size recompiled"


def test_compile_mark_dynamic_channels_last_module():
    counter = CompileCounterWithBackend("aot_eager")
    conv = gemmconv.nn.Conv2d(3, 8, kernel_size=2, stride=2).to(memory_format=torch.channels_last)
    compiled = torch.compile(conv, backend=counter, fullgraph=True)
    g = torch.Generator().manual_seed(6)
    for n in (2, 4, 7):
        x = random_in((n, 3, 6, 6), Layout.CHANNELS_LAST, torch.float32, "cpu", g)
        torch._dynamo.mark_dynamic(x, 0)
        y = compiled(x)
        assert y.is_contiguous(memory_format=torch.channels_last)
        assert rms_range(
            y, F.conv2d(x.double(), conv.weight.double(), conv.bias.double(), stride=2)
        ) <= (tolerance(torch.float32, "cpu"))
    assert counter.frame_count == 1


def test_a_compiled_call_leaves_the_tensor_checks_to_the_fake_implementation(monkeypatch):
    # Traced, the checks against the tensors would make guards every compiled call
    # checks; the op's fake implementation makes the same checks without them.
    import gemmconv.core.arguments
    import gemmconv.functional

    def traced(*args):
        raise AssertionError("the trace ran the tensor checks")

    # Both names the trace could reach them by (ops keeps its own for the fake).
    monkeypatch.setattr(gemmconv.functional, "check_against_tensors", traced, raising=False)
    monkeypatch.setattr(gemmconv.core.arguments, "check_against_tensors", traced)
    torch._dynamo.reset()
    x, w, b = _operands((2, 3, 8, 8), (4, 3, 2, 2), Layout.CHANNELS_FIRST, seed=9)
    y = torch.compile(_patch_embed_loss, backend="eager", fullgraph=True)(x, w, b)
    assert torch.isfinite(y)
    with pytest.raises(RuntimeError, match=r"conv2d: input of shape \(2, 5, 8, 8\) has 5 channels"):
        ops.conv_forward(
            torch.empty(2, 5, 8, 8, device="meta"), torch.empty(4, 3, 2, 2, device="meta"),
            None, [2, 2], [0, 0], [1, 1], 1,
        )  # fmt: skip


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        pytest.param(lambda x, w: gemmconv.conv2d(x, w[:, :2], stride=2), RuntimeError,
                     r"conv2d: input of shape \(2, 3, 8, 8\) has 3 channels", id="channels"),
        pytest.param(lambda x, w: gemmconv.conv2d(x, w, stride=0), RuntimeError,
                     r"conv2d: stride=\(0, 0\); expected every value > 0", id="stride"),
        pytest.param(lambda x, w: gemmconv.conv2d(x, w, stride=0.5), TypeError,
                     r"conv2d: stride=0.5 of type float", id="kind"),
        pytest.param(lambda x, w: gemmconv.conv2d(x > 0, w, stride=2), NotImplementedError,
                     r"conv2d: input dtype torch.bool is not supported", id="bool"),
    ],
)  # fmt: skip
def test_a_compiled_call_refuses_a_bad_call_with_the_eager_message(call, error, message):
    # Checks made in the fake implementation reach the caller through dynamo's own
    # error (a RuntimeError, as torch's convolution's do under torch.compile); a bool
    # input, whose NotImplementedError dynamo would take as "run eagerly", is checked
    # in the trace.
    torch._dynamo.reset()
    x, w, _ = _operands((2, 3, 8, 8), (4, 3, 2, 2), Layout.CHANNELS_FIRST, seed=10)
    with pytest.raises(error, match=message):
        call(x, w)
    with pytest.raises(error, match=message):
        torch.compile(call, backend="eager")(x, w)


# ---- autocast, checkpointing, needed gradients -----------------------------------


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_autocast_gives_the_dtype_torch_gives(dims):
    ours, theirs = CONV[dims]
    k = (2,) * dims
    x, w, b = _operands((2, 3, *(4,) * dims), (5, 3, *k), Layout.CHANNELS_FIRST, seed=7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ours(x, w, b, stride=2)
        y_torch = theirs(x, w, b, stride=2)
    assert y.dtype == y_torch.dtype == torch.bfloat16
    ref = theirs(x.bfloat16().double(), w.bfloat16().double(), b.bfloat16().double(), stride=2)
    assert rms_range(y, ref) <= tolerance(torch.bfloat16, "cpu")


def test_autocast_leaves_float64_alone_like_torch():
    x, w, b = (t.double() for t in _operands((2, 3, 4, 4), (5, 3, 2, 2), Layout.CHANNELS_FIRST))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert gemmconv.conv2d(x, w, b, stride=2).dtype == F.conv2d(x, w, b, stride=2).dtype


def test_a_solver_runs_with_autocast_off_and_it_comes_back_on_even_when_it_raises():
    """ops switches the device's autocast flag off around a solver's run (its GEMMs
    must not be re-cast) and on again after it, the same way on an exception."""
    x, w, b = _operands((2, 3, 8, 8), (6, 3, 4, 4), Layout.CHANNELS_FIRST)
    plan = ops.forward_plan(x, w, b, [4, 4], [0, 0], [1, 1], 1)
    inside = []

    def run(fail: bool) -> str:
        inside.append(torch.is_autocast_enabled("cpu"))
        if fail:
            raise ValueError("solver failed")
        return "result"

    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ops._without_autocast(plan, run, False) == "result"
        with pytest.raises(ValueError, match="solver failed"):
            ops._without_autocast(plan, run, True)
        assert torch.is_autocast_enabled("cpu")
    assert inside == [False, False]
    assert not torch.is_autocast_enabled("cpu")
    assert ops._without_autocast(plan, run, False) == "result" and inside[-1] is False


def test_gradient_checkpointing_matches_plain_backward():
    x, w, b = _operands((2, 3, 8, 8), (6, 3, 4, 4), Layout.CHANNELS_FIRST, seed=8)

    def block(x, w, b):
        return gemmconv.conv2d(x, w, b, stride=4).tanh()

    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    torch.utils.checkpoint.checkpoint(block, *leaves, use_reentrant=False).sum().backward()
    plain = [t.clone().requires_grad_() for t in (x, w, b)]
    block(*plain).sum().backward()
    for a, p in zip(leaves, plain, strict=True):
        assert torch.equal(a.grad, p.grad)


@pytest.mark.parametrize(
    "x_grad,w_grad,expected",
    [
        (True, True, ["conv_forward", "conv_backward_data", "conv_backward_weights"]),
        (False, True, ["conv_forward", "conv_backward_weights"]),
        (True, False, ["conv_forward", "conv_backward_data"]),
    ],
)
def test_only_needed_backward_ops_run(x_grad, w_grad, expected):
    x, w, b = _operands((2, 3, 8, 8), (6, 3, 4, 4), Layout.CHANNELS_FIRST, seed=9)
    x.requires_grad_(x_grad)
    w.requires_grad_(w_grad)
    b.requires_grad_(True)
    with GemmconvOpLog() as log:
        gemmconv.conv2d(x, w, b, stride=4).sum().backward()
    assert sorted(log.calls) == sorted(expected)
    assert b.grad is not None
    assert (x.grad is not None) == x_grad and (w.grad is not None) == w_grad


@pytest.mark.usefixtures("work_costs_only")
def test_explain_still_reports_each_direction():
    # One patch per sample: a GEMM in every direction (the CPU's oneDNN takes 2x2 ones).
    x, w, _ = _operands((2, 3, 8, 8), (6, 3, 8, 8), Layout.CHANNELS_FIRST)
    choices = gemmconv.explain(x, w, stride=8)
    assert set(choices) == {"forward", "backward_data", "backward_weights"}
    assert all(c.solver == "point_output" for c in choices.values())


def test_autocast_inside_a_compiled_module():
    conv = gemmconv.nn.Conv2d(3, 8, kernel_size=4, stride=4)
    compiled = torch.compile(conv, backend="aot_eager", fullgraph=True)
    x, _, _ = _operands((2, 3, 8, 8), (8, 3, 4, 4), Layout.CHANNELS_FIRST, seed=10)
    x.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = compiled(x)
        y_torch = F.conv2d(x, conv.weight, conv.bias, stride=4)
    assert y.dtype == y_torch.dtype == torch.bfloat16
    ref = F.conv2d(*(t.detach().bfloat16().double() for t in (x, conv.weight, conv.bias)), stride=4)
    assert rms_range(y, ref) <= tolerance(torch.bfloat16, "cpu")
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and conv.weight.grad.dtype == torch.float32
