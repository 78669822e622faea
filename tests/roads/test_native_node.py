"""gemmconv's C++ autograd node (roads/native_node): the calls it serves give torch's
values (against float64), shapes, strides and gradients in every direction, with
in-place ops, batched and double backward and autocast as torch's convolution allows
them; the calls it does not serve, and a node that cannot be built or loaded, take the
Python node; the setting is checked.

The node is built by torch's cpp_extension at first use: these tests need a C++
compiler and ninja, and skip, naming what is missing, where the machine lacks them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import gemmconv
from gemmconv.core.memory_format import Layout, empty_in
from gemmconv.core.problem import ConvProblem
from gemmconv.measuring.verify import rms_range, tolerance
from gemmconv.roads import native_node
from gemmconv.selection import dispatch

TOOLS_MISSING = [tool for tool in ("c++", "ninja") if shutil.which(tool) is None]
needs_compiler = pytest.mark.skipif(
    bool(TOOLS_MISSING), reason=f"building the C++ node needs {', '.join(TOOLS_MISSING)}"
)
pytestmark = needs_compiler

GEMMCONV_CONV = {1: gemmconv.conv1d, 2: gemmconv.conv2d, 3: gemmconv.conv3d}
TORCH_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
NODE_NAME = "RowsGemm"


@pytest.fixture
def node_on(monkeypatch):
    """The node built and wanted on the CPU, and point_output forced: torch's fused
    backward rightly wins these tiny problems' training calls on host time."""
    monkeypatch.setenv(native_node.ENVIRONMENT, "1")
    monkeypatch.setenv("GEMMCONV_SOLVER", "point_output")
    assert native_node.build(timeout=600), native_node.status()
    dispatch.clear_cache()


def _graph_names(t: torch.Tensor) -> set[str]:
    """The names of every node of t's autograd graph."""
    seen, stack, names = set(), [t.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(node.name())
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


def _served_by_node(y: torch.Tensor) -> bool:
    return any(NODE_NAME in name for name in _graph_names(y))


def _served_by_python_node(y: torch.Tensor) -> bool:
    return "_EagerConvolutionBackward" in _graph_names(y)


def _operands(dims, layout, dtype, one_patch, bias, generator, batch=5, c=3, k=6):
    kernel = (2, 3, 2)[:dims] if one_patch else (1,) * dims
    spatial = kernel if one_patch else (4, 3, 5)[:dims]
    x = empty_in((batch, c, *spatial), layout, torch.float32, "cpu")
    x.copy_(torch.rand(x.shape, generator=generator) * 2 - 1)
    w = empty_in((k, c, *kernel), layout, torch.float32, "cpu")
    w.copy_(torch.rand(w.shape, generator=generator) * 2 - 1)
    b = torch.rand(k, generator=generator) * 2 - 1 if bias else None
    cast = [t if t is None else t.to(dtype) for t in (x, w, b)]
    return cast, kernel


def _reference(dims, x, w, b, stride, dy):
    """y, dx, dW and db of torch's convolution in float64 on channels-first copies."""
    x64, w64 = (t.detach().double().contiguous().requires_grad_() for t in (x, w))
    b64 = None if b is None else b.detach().double().requires_grad_()
    y = TORCH_CONV[dims](x64, w64, b64, stride=stride)
    y.backward(dy.double())
    return y.detach(), x64.grad, w64.grad, None if b64 is None else b64.grad


CASES = [
    # dims, layout, one patch (else a channels-last 1x1), bias
    (1, Layout.CHANNELS_FIRST, True, True),
    (2, Layout.CHANNELS_FIRST, True, False),
    (2, Layout.CHANNELS_LAST, True, True),
    (3, Layout.CHANNELS_FIRST, True, True),
    (3, Layout.CHANNELS_LAST, True, False),
    (2, Layout.CHANNELS_LAST, False, True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("dims", "layout", "one_patch", "bias"), CASES)
@pytest.mark.parametrize("needs", ["dx and dW", "dx", "dW"])
def test_values_strides_and_gradients_match_torch(
    node_on, monkeypatch, dims, layout, one_patch, bias, dtype, needs
):
    if not one_patch:
        monkeypatch.setenv("GEMMCONV_SOLVER", "pointwise")
    generator = torch.Generator().manual_seed(dims * 7 + one_patch)
    (x, w, b), kernel = _operands(dims, layout, dtype, one_patch, bias, generator)
    x.requires_grad_(needs != "dW")
    w.requires_grad_(needs != "dx")
    if b is not None:
        b.requires_grad_()
    stride = kernel
    y = GEMMCONV_CONV[dims](x, w, b, stride=stride)
    assert _served_by_node(y), _graph_names(y)
    expected = TORCH_CONV[dims](x.detach(), w.detach(), None if b is None else b.detach(),
                                stride=stride)  # fmt: skip
    assert y.shape == expected.shape and y.dtype == dtype
    assert y.stride() == expected.stride()
    assert y._base is None  # a base tensor, as torch's output and the Python node's
    dy = torch.rand(y.shape, generator=generator).to(dtype) * 2 - 1
    y.backward(dy)
    ref_y, ref_dx, ref_dw, ref_db = _reference(dims, x, w, b, stride, dy)
    pairs = [(y.detach(), ref_y, "y")]
    if x.requires_grad:
        pairs.append((x.grad, ref_dx, "dx"))
    else:
        assert x.grad is None
    if w.requires_grad:
        pairs.append((w.grad, ref_dw, "dW"))
    else:
        assert w.grad is None
    if b is not None:
        pairs.append((b.grad, ref_db, "db"))
    for got, want, name in pairs:
        assert got.shape == want.shape and got.dtype == dtype, name
        error = rms_range(got, want)
        assert error <= tolerance(dtype, "cpu"), (name, error)


def _step(dims, x, w, b, stride, dy):
    """y and the gradients of one gemmconv call, on fresh leaves of the operands."""
    leaves = [t if t is None else t.detach().requires_grad_(t.requires_grad) for t in (x, w, b)]
    y = GEMMCONV_CONV[dims](*leaves, stride=stride)
    y.backward(dy)
    return y, [None if t is None else t.grad for t in leaves]


@pytest.mark.parametrize("dy_layout", ["y's", "contiguous", "expanded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("dims", "layout", "one_patch", "bias"), CASES)
def test_the_node_gives_the_python_nodes_bits(
    node_on, monkeypatch, dims, layout, one_patch, bias, dtype, dy_layout
):
    # A process switches from the Python node to the C++ one when its build ends: a
    # seeded run must not change its numbers with that moment.
    if not one_patch:
        monkeypatch.setenv("GEMMCONV_SOLVER", "pointwise")
    generator = torch.Generator().manual_seed(dims * 3 + one_patch)
    (x, w, b), kernel = _operands(dims, layout, dtype, one_patch, bias, generator, batch=40)
    for t in (x, w, b):
        if t is not None:
            t.requires_grad_()
    # dY in y's layout, as a network's next layer gives it, contiguous, or one value
    # expanded (a sum's backward): the node reads the first as rows in place and moves
    # the others' channels first.
    y_like = TORCH_CONV[dims](x.detach(), w.detach(), stride=kernel)
    values = torch.rand(y_like.shape, generator=generator) * 2 - 1
    dy = {
        "y's": torch.empty_like(y_like).copy_(values),
        "contiguous": values.to(dtype),
        "expanded": values[(0,) * values.dim()].to(dtype).expand(values.shape),
    }[dy_layout]
    y_node, grads_node = _step(dims, x, w, b, kernel, dy)
    assert _served_by_node(y_node)
    monkeypatch.setattr(native_node, "rows_gemm", None)
    y_python, grads_python = _step(dims, x, w, b, kernel, dy)
    assert _served_by_python_node(y_python)
    assert torch.equal(y_node, y_python) and y_node.stride() == y_python.stride()
    for got, want in zip(grads_node, grads_python):
        assert (got is None) == (want is None)
        if got is not None:
            assert torch.equal(got, want) and got.stride() == want.stride()


def test_the_default_selection_reaches_the_node_on_a_qwen_shaped_embed(node_on, monkeypatch):
    monkeypatch.delenv("GEMMCONV_SOLVER")
    dispatch.clear_cache()
    x = torch.rand(512, 3, 2, 14, 14, dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(128, 3, 2, 14, 14, dtype=torch.bfloat16, requires_grad=True)
    assert _served_by_node(gemmconv.conv3d(x, w, stride=(2, 14, 14)))
    # With the setting at auto, CPU calls keep the Python node.
    monkeypatch.setenv(native_node.ENVIRONMENT, "auto")
    dispatch.clear_cache()
    assert _served_by_python_node(gemmconv.conv3d(x, w, stride=(2, 14, 14)))


def test_explain_says_which_training_calls_run_the_node(node_on, monkeypatch):
    monkeypatch.delenv("GEMMCONV_SOLVER")
    dispatch.clear_cache()
    x = torch.rand(512, 3, 2, 14, 14, dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(128, 3, 2, 14, 14, dtype=torch.bfloat16, requires_grad=True)
    notes = gemmconv.explain(x, w, stride=(2, 14, 14)).notes
    assert "eager calls that need dx and dW run gemmconv's C++ autograd node (loaded)" in notes
    assert not any("C++" in n for n in gemmconv.explain(x.detach(), w.detach(),
                                                         stride=(2, 14, 14)).notes)  # fmt: skip
    monkeypatch.setenv(native_node.ENVIRONMENT, "0")
    assert not any("C++" in n for n in gemmconv.explain(x, w, stride=(2, 14, 14)).notes)


def test_calls_it_does_not_serve_take_the_python_node(node_on, monkeypatch):
    generator = torch.Generator().manual_seed(3)
    # A cropped input: its rows are a copy.
    x = torch.rand(4, 3, 3, 5, generator=generator, requires_grad=True)
    w = torch.rand(5, 3, 2, 4, generator=generator, requires_grad=True)
    assert _served_by_python_node(gemmconv.conv2d(x, w, stride=(2, 4)))
    # An unbatched input.
    x2 = torch.rand(4, 3, 2, 4, generator=generator, requires_grad=True)
    assert _served_by_python_node(gemmconv.conv2d(x2[0], w, stride=(2, 4)))
    assert _served_by_node(gemmconv.conv2d(x2, w, stride=(2, 4)))
    # A channels-first 1x1: batched products, not rows.
    monkeypatch.setenv("GEMMCONV_SOLVER", "pointwise")
    dispatch.clear_cache()
    x1 = torch.rand(2, 8, 3, 3, generator=generator, requires_grad=True)
    w1 = torch.rand(4, 8, 1, 1, generator=generator, requires_grad=True)
    assert _served_by_python_node(gemmconv.conv2d(x1, w1))
    # Another solver forced.
    monkeypatch.setenv("GEMMCONV_SOLVER", "patch")
    dispatch.clear_cache()
    assert _served_by_python_node(gemmconv.conv2d(x2, w, stride=(2, 4)))
    # Batch invariance on: the invariant GEMM forms.
    monkeypatch.setenv("GEMMCONV_SOLVER", "point_output")
    dispatch.clear_cache()
    with gemmconv.batch_invariant():
        assert _served_by_python_node(gemmconv.conv2d(x2, w, stride=(2, 4)))


def test_inference_calls_run_without_a_node(node_on):
    x = torch.rand(4, 3, 2, 4)
    w = torch.rand(5, 3, 2, 4, requires_grad=True)
    with torch.no_grad():
        y = gemmconv.conv2d(x, w, stride=(2, 4))
    assert y.grad_fn is None
    torch.testing.assert_close(y, F.conv2d(x, w.detach(), stride=(2, 4)))


def test_in_place_ops_on_the_output_and_version_checks_behave_as_torch(node_on):
    generator = torch.Generator().manual_seed(5)
    x = torch.rand(4, 3, 2, 4, generator=generator, dtype=torch.float64, requires_grad=True)
    w = torch.rand(5, 3, 2, 4, generator=generator, dtype=torch.float64, requires_grad=True)
    scale = torch.rand(4, 5, 1, 1, generator=generator, dtype=torch.float64, requires_grad=True)
    grads = []
    for conv in (gemmconv.conv2d, F.conv2d):
        y = conv(x, w, stride=(2, 4))
        y += 1
        y[:, 1] = 0
        y.view(-1)[::3] *= 2
        y.relu_()
        grads.append(torch.autograd.grad((y * scale).sum(), (x, w, scale)))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # The saved input modified in place: the backward raises, as torch's would.
    x2 = x.detach().clone().requires_grad_()
    x3 = x2 * 1
    y = gemmconv.conv2d(x3, w, stride=(2, 4))
    assert _served_by_node(y)
    x3.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_batched_and_double_backward(node_on):
    generator = torch.Generator().manual_seed(9)
    x = torch.rand(3, 4, 2, 3, generator=generator, dtype=torch.float64)
    x = x.contiguous(memory_format=torch.channels_last).requires_grad_()
    w = torch.rand(5, 4, 2, 3, generator=generator, dtype=torch.float64, requires_grad=True)
    b = torch.rand(5, generator=generator, dtype=torch.float64, requires_grad=True)

    def conv(x, w, b):
        return gemmconv.conv2d(x, w, b, stride=(2, 3))

    assert _served_by_node(conv(x, w, b))
    assert torch.autograd.gradcheck(conv, (x, w, b))
    assert torch.autograd.gradgradcheck(conv, (x, w, b))
    y = conv(x, w, b)
    dys = torch.rand(6, *y.shape, generator=generator, dtype=torch.float64)
    got = torch.autograd.grad(y, (x, w, b), dys, is_grads_batched=True)
    y_ref = F.conv2d(x, w, b, stride=(2, 3))
    want = torch.autograd.grad(y_ref, (x, w, b), dys, is_grads_batched=True)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


def test_autocast_runs_the_gemms_in_its_dtype_and_the_gradients_in_the_parameters(node_on):
    generator = torch.Generator().manual_seed(11)
    x = torch.rand(6, 3, 2, 4, 4, generator=generator, requires_grad=True)
    w = torch.rand(8, 3, 2, 4, 4, generator=generator, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = gemmconv.conv3d(x, w, stride=(2, 4, 4))
        assert _served_by_node(y)
        assert y.dtype == torch.bfloat16
        y.float().square().sum().backward()
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = F.conv3d(x64, w64, stride=(2, 4, 4))
    y64.square().sum().backward()
    assert x.grad.dtype == w.grad.dtype == torch.float32
    assert rms_range(y.detach(), y64.detach()) <= tolerance(torch.bfloat16, "cpu")
    assert rms_range(w.grad, w64.grad) <= 4 * tolerance(torch.bfloat16, "cpu")
    assert rms_range(x.grad, x64.grad) <= 4 * tolerance(torch.bfloat16, "cpu")


def test_a_long_fp32_weight_gradient_is_reduced_in_fp64_as_the_python_node_does(node_on):
    # Three output channels: a skinny [3, 12] result, which gemmconv's CPU rule reduces
    # in fp64 (core/precision.py).
    generator = torch.Generator().manual_seed(13)
    x = torch.rand(20000, 3, 2, 2, generator=generator) * 2 - 1
    w = (torch.rand(3, 3, 2, 2, generator=generator) * 2 - 1).requires_grad_()
    y = gemmconv.conv2d(x, w, stride=2)
    assert _served_by_node(y)
    dy = torch.rand(y.shape, generator=generator) * 2 - 1
    y.backward(dy)
    want = torch.einsum("nk,nc->kc", dy.double().flatten(1), x.double().flatten(1))
    error = (w.grad.double().flatten(1) - want).abs().max() / want.abs().max()
    assert error < 1e-6  # fp32 rounding once; a long fp32 sum measured about 1e-5


def test_the_node_serves_cuda_calls_unless_the_setting_says_otherwise(monkeypatch):
    monkeypatch.delenv(native_node.ENVIRONMENT, raising=False)
    assert native_node.setting() == "auto"
    assert native_node.wanted_on("cuda") and not native_node.wanted_on("cpu")
    monkeypatch.setenv(native_node.ENVIRONMENT, "0")
    assert not native_node.wanted_on("cuda") and not native_node.wanted_on("cpu")
    monkeypatch.setenv(native_node.ENVIRONMENT, "1")
    assert native_node.wanted_on("cuda") and native_node.wanted_on("cpu")


def test_a_bad_setting_is_refused_with_the_variable_named(monkeypatch):
    monkeypatch.setenv(native_node.ENVIRONMENT, "sometimes")
    x = torch.rand(4, 3, 2, 4, requires_grad=True)
    w = torch.rand(5, 3, 2, 4, requires_grad=True)
    with pytest.raises(ValueError, match="GEMMCONV_NATIVE_NODE='sometimes'"):
        gemmconv.conv2d(x, w, stride=(2, 4))


_SUBPROCESS_SCRIPT = textwrap.dedent(
    """
    import os, sys, pathlib
    import torch, torch.nn.functional as F
    import gemmconv
    from gemmconv.roads import native_node

    def checked_step():
        x = torch.rand(4, 3, 2, 4, dtype=torch.float64, requires_grad=True)
        w = torch.rand(5, 3, 2, 4, dtype=torch.float64, requires_grad=True)
        y = gemmconv.conv2d(x, w, stride=(2, 4))
        y.square().sum().backward()
        x64, w64 = x.detach().requires_grad_(), w.detach().requires_grad_()
        F.conv2d(x64, w64, stride=(2, 4)).square().sum().backward()
        torch.testing.assert_close(w.grad, w64.grad)
        torch.testing.assert_close(x.grad, x64.grad)
        names = [y.grad_fn.name()] + [n.name() for n, _ in y.grad_fn.next_functions if n]
        print("step", "cpp" if any("RowsGemm" in n for n in names) else "python")

    case = sys.argv[1]
    if case == "broken source":
        broken = pathlib.Path(os.environ["XDG_CACHE_HOME"]) / "broken.cpp"
        broken.write_text("this is not C++")
        native_node.SOURCE = broken
        print("built", native_node.build(timeout=600), native_node.status())
        checked_step()
    elif case == "first process":
        checked_step()  # asks for the node: none cached, so a build starts
        native_node._builder.join(600)
        print("status", native_node.status())
        checked_step()
    else:
        checked_step()
    """
)


def _run(case: str, cache: str) -> subprocess.CompletedProcess:
    env = {**os.environ, native_node.ENVIRONMENT: "1", "XDG_CACHE_HOME": cache,
           "GEMMCONV_SOLVER": "point_output"}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", _SUBPROCESS_SCRIPT, case], env=env,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_a_source_that_does_not_build_leaves_the_python_node(tmp_path):
    done = _run("broken source", str(tmp_path))
    assert "built False unavailable" in done.stdout
    assert "step python" in done.stdout
    # The node is on by default: a machine that cannot build it is told by status()
    # and the dispatch log's info records, not by a warning on every process's stderr.
    assert "autograd node" not in done.stderr


def test_the_first_process_builds_for_the_next_over_an_unloadable_cached_file(tmp_path):
    cached = tmp_path / "gemmconv" / "native" / f"{native_node.library_name()}.so"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"not a library")
    first = _run("first process", str(tmp_path)).stdout
    # It keeps the Python node before and after its build.
    assert first.count("step python") == 2, first
    assert "status built in the background" in first
    assert cached.read_bytes()[:4] == b"\x7fELF"
    assert "step cpp" in _run("next process", str(tmp_path)).stdout


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64, torch.float32])
@pytest.mark.parametrize("layout", [Layout.CHANNELS_FIRST, Layout.CHANNELS_LAST])
def test_on_cuda_the_default_selection_runs_the_node_with_the_precision_rule(
    monkeypatch, dtype, layout
):
    monkeypatch.setenv(native_node.ENVIRONMENT, "auto")
    assert native_node.build(timeout=600), native_node.status()
    dispatch.clear_cache()
    matmul = torch.backends.cuda.matmul
    flags = (matmul.allow_bf16_reduced_precision_reduction,
             matmul.allow_fp16_reduced_precision_reduction)  # fmt: skip
    generator = torch.Generator().manual_seed(17)
    x = empty_in((8192, 3, 2, 14, 14), layout, torch.float32, "cuda")
    x.copy_(torch.rand(x.shape, generator=generator) * 2 - 1)
    w = empty_in((1280, 3, 2, 14, 14), layout, torch.float32, "cuda")
    w.copy_(torch.rand(w.shape, generator=generator) * 2 - 1)
    x, w = x.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
    b = (torch.rand(1280, generator=generator) * 2 - 1).to("cuda", dtype).requires_grad_()
    y = gemmconv.conv3d(x, w, b, stride=(2, 14, 14))
    # fp32 keeps the Python node, whose TF32 rule reads torch's precision settings.
    assert _served_by_node(y) == (dtype != torch.float32), _graph_names(y)
    dy = (torch.rand(y.shape, generator=generator) * 2 - 1).to("cuda", dtype)
    y.backward(dy)
    assert (matmul.allow_bf16_reduced_precision_reduction,
            matmul.allow_fp16_reduced_precision_reduction) == flags  # fmt: skip
    ref_y, ref_dx, ref_dw, ref_db = _reference(3, x, w, b, (2, 14, 14), dy)
    for got, want, name in ((y, ref_y, "y"), (x.grad, ref_dx, "dx"), (w.grad, ref_dw, "dW"),
                            (b.grad, ref_db, "db")):  # fmt: skip
        assert got.dtype == dtype, name
        error = rms_range(got, want)
        assert error <= tolerance(dtype, "cuda"), (name, error)
    # The Python node's bits, on the same operands.
    monkeypatch.setattr(native_node, "rows_gemm", None)
    y_python, grads = _step(3, x, w, b, (2, 14, 14), dy)
    assert torch.equal(y_python, y)
    for got, want in zip(grads, (x.grad, w.grad, b.grad)):
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("forward_solver", "served"), [("patch", True), ("vendor", False), ("im2col", False)]
)
def test_a_forward_of_another_gemm_still_trains_through_the_node(node_on, forward_solver, served):
    # The backward directions chose point_output (the fixture forces it) and the forward
    # another solver (a find pick): a training call still runs the node's one GEMM over
    # views where the forward's was that GEMM (patch reads x as its columns), not after
    # the vendor's or another kind of forward.
    generator = torch.Generator().manual_seed(11)
    x = torch.rand(6, 3, 2, 4, generator=generator) * 2 - 1
    w = (torch.rand(5, 3, 2, 4, generator=generator) * 2 - 1).requires_grad_()
    forward = ConvProblem.from_tensors(x, w, None, (2, 4), (0, 0), (1, 1), 1)
    with dispatch.trial(forward, forward_solver):
        y = gemmconv.conv2d(x, w, stride=(2, 4))
        assert _served_by_node(y) == served, _graph_names(y)
        notes = gemmconv.explain(x, w, stride=(2, 4)).notes
    assert any("C++ autograd node" in n for n in notes) == served, notes
    dy = torch.rand(y.shape, generator=generator) * 2 - 1
    (dw,) = torch.autograd.grad(y, w, dy)
    _, _, ref_dw, _ = _reference(2, x, w, None, (2, 4), dy)
    assert rms_range(dw, ref_dw) <= tolerance(torch.float32, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 64])
def test_on_cuda_a_one_patch_call_after_the_implicit_gemm_trains_through_the_node(
    monkeypatch, batch
):
    # Qwen2-VL's embed whose forward chose patch_implicit (on its host price, as at one
    # patch) and whose backward chose point_output: its training calls run the node's
    # GEMM forward too, and the node (rows_solver), with torch's values.
    monkeypatch.setenv(native_node.ENVIRONMENT, "auto")
    monkeypatch.setenv("GEMMCONV_SOLVER", "point_output")
    assert native_node.build(timeout=600), native_node.status()
    dispatch.clear_cache()
    generator = torch.Generator().manual_seed(23)
    x = (torch.rand(batch, 3, 2, 14, 14, generator=generator) * 2 - 1).to("cuda", torch.bfloat16)
    w = (torch.rand(1280, 3, 2, 14, 14, generator=generator) * 2 - 1).to("cuda", torch.bfloat16)
    w.requires_grad_()
    forward = ConvProblem.from_tensors(x, w, None, (2, 14, 14), (0, 0, 0), (1, 1, 1), 1)
    with dispatch.trial(forward, "patch_implicit"):
        y = gemmconv.conv3d(x, w, stride=(2, 14, 14))
        assert _served_by_node(y), _graph_names(y)
        with torch.no_grad():  # inference keeps the forward's own pick
            assert not _served_by_node(gemmconv.conv3d(x, w, stride=(2, 14, 14)))
    dy = (torch.rand(y.shape, generator=generator) * 2 - 1).to("cuda", torch.bfloat16)
    (dw,) = torch.autograd.grad(y, w, dy)
    ref_y, _, ref_dw, _ = _reference(3, x, w.detach(), None, (2, 14, 14), dy)
    assert rms_range(y, ref_y) <= tolerance(torch.bfloat16, "cuda")
    assert rms_range(dw, ref_dw) <= tolerance(torch.bfloat16, "cuda")
