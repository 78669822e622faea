"""A converted model goes where a torch model goes: torch.export records aten
convolutions (portable: the saved program loads without gemmconv), the ops' own aten
forms make a graph that calls them directly portable, torch.compile (inductor
included) keeps the ops, both ONNX exporters write standard Conv nodes, fx's symbolic
tracing and the meta device work, jit tracing and make_fx record the ops, and
torch.jit.script refuses a converted convolution with what to do instead."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import gemmconv

# torch 2.14 deprecates jit.trace, jit.script and the TorchScript ONNX exporter.
pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

GEMMCONV_OPS = {
    torch.ops.gemmconv.conv_forward.default,
    torch.ops.gemmconv.conv_backward_data.default,
    torch.ops.gemmconv.conv_backward_weights.default,
}


def _torch_model(seed: int = 0) -> torch.nn.Module:
    """A patch embed with bias, then a strided 1x1 without: both swapped by convert."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, kernel_size=4, stride=4),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 5, kernel_size=1, stride=2, bias=False),
    ).eval()


def _converted(model: torch.nn.Module, **kwargs) -> torch.nn.Module:
    converted = copy.deepcopy(model)
    report = gemmconv.convert(converted, **kwargs)
    assert len(report.swapped) == 2
    return converted


def _input(seed: int = 1) -> torch.Tensor:
    return torch.rand(2, 3, 18, 17, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def _targets(graph: torch.fx.Graph) -> set:
    return {node.target for node in graph.nodes if node.op == "call_function"}


# ---- torch.export ------------------------------------------------------------------


@pytest.mark.parametrize("memory_format", [None, torch.channels_last], ids=["cf", "cl"])
def test_export_records_portable_aten_convolutions(memory_format):
    model = _torch_model()
    converted = _converted(model, memory_format=memory_format)
    x = _input()
    with torch.no_grad():
        want = model(x)
    ep = torch.export.export(converted, (x,))
    for program in (ep, ep.run_decompositions()):
        targets = _targets(program.graph)
        assert not targets & GEMMCONV_OPS
        assert torch.ops.aten.convolution.default in targets
        torch.testing.assert_close(program.module()(x), want)


def test_inductor_compiles_a_converted_model_and_keeps_the_ops(monkeypatch):
    # An aten form registered as the ops' CompositeImplicitAutograd kernel made inductor
    # refuse them ("both a fallback and a decomp for same op"); the ops must stay
    # opaque to it and run.
    converted = _converted(_torch_model())
    x = _input().requires_grad_()
    ran = []
    original = gemmconv.roads.ops.run_forward
    monkeypatch.setattr(gemmconv.roads.ops, "run_forward", lambda *a: ran.append(1) or original(*a))
    compiled = torch.compile(converted, fullgraph=True)
    y = compiled(x)
    y.sum().backward()
    with torch.no_grad():
        torch.testing.assert_close(y, converted(x), rtol=1e-5, atol=1e-6)
    assert ran, "the compiled graph did not run gemmconv's forward"


class _CallOp(torch.nn.Module):
    """One gemmconv op with fixed non-tensor arguments, for export."""

    def __init__(self, op, *arguments):
        super().__init__()
        self.op, self.arguments = op, arguments

    def forward(self, first, second):
        return self.op(first, second, *self.arguments)


# (input shape, weight shape, stride, padding, dilation, groups): a patch whose stride
# leaves a remainder, a strided 1x1, padding with dilation, and groups.
BACKWARD_CASES = {
    "patch_remainder": ((2, 3, 11, 10), (4, 3, 3, 3), [3, 3], [0, 0], [1, 1], 1),
    "strided_1x1": ((2, 4, 9, 8), (6, 4, 1, 1), [2, 2], [0, 0], [1, 1], 1),
    "padded_dilated": ((1, 2, 9, 9), (3, 2, 3, 2), [2, 1], [1, 2], [2, 1], 1),
    "groups_3d": ((2, 4, 5, 6, 7), (6, 2, 2, 1, 3), [2, 1, 2], [0, 1, 0], [1, 1, 1], 2),
}


@pytest.mark.parametrize("channels_last", [False, True], ids=["cf", "cl"])
@pytest.mark.parametrize("case", BACKWARD_CASES.values(), ids=BACKWARD_CASES.keys())
def test_each_ops_decomposition_computes_the_op(case, channels_last):
    x_shape, w_shape, stride, padding, dilation, groups = case
    gen = torch.Generator().manual_seed(3)
    x = torch.rand(x_shape, generator=gen, dtype=torch.float64) * 2 - 1
    w = torch.rand(w_shape, generator=gen, dtype=torch.float64) * 2 - 1
    conv_args = (stride, padding, dilation, groups)
    conv = F.conv2d if len(x_shape) == 4 else F.conv3d
    y_shape = conv(x, w, None, *conv_args).shape
    dy = torch.rand(y_shape, generator=gen, dtype=torch.float64) * 2 - 1
    calls = {
        "forward": (torch.ops.gemmconv.conv_forward.default, (x, w), (None, *conv_args)),
        "backward_data": (
            torch.ops.gemmconv.conv_backward_data.default,
            (dy, w),
            (list(x_shape), *conv_args, channels_last),
        ),
        "backward_weights": (
            torch.ops.gemmconv.conv_backward_weights.default,
            (dy, x),
            (list(w_shape), *conv_args, channels_last),
        ),
    }
    portable_table = {
        **torch.export.default_decompositions(),
        **gemmconv.roads.decompositions.table(),
    }
    for name, (op, tensors, arguments) in calls.items():
        module = _CallOp(op, *arguments)
        ep = torch.export.export(module, tensors)
        assert op in _targets(ep.graph), name  # the op itself, called directly, stays
        portable = ep.run_decompositions(portable_table)
        assert not _targets(portable.graph) & GEMMCONV_OPS, name
        torch.testing.assert_close(
            portable.module()(*tensors), op(*tensors, *arguments), rtol=1e-12, atol=1e-12
        )


def test_a_saved_decomposed_program_loads_without_gemmconv(tmp_path):
    converted = _converted(_torch_model())
    x = _input()
    portable = torch.export.export(converted, (x,)).run_decompositions()
    torch.export.save(portable, tmp_path / "model.pt2")
    with torch.no_grad():
        torch.save((x, converted(x)), tmp_path / "io.pt")
    # A None entry in sys.modules makes any import of gemmconv fail.
    load = textwrap.dedent(
        f"""
        import sys
        sys.modules["gemmconv"] = None
        import torch
        program = torch.export.load({str(tmp_path / "model.pt2")!r})
        x, want = torch.load({str(tmp_path / "io.pt")!r})
        torch.testing.assert_close(program.module()(x), want)
        assert "gemmconv" not in str(program.graph)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", load], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr


# ---- ONNX --------------------------------------------------------------------------


def _check_onnx(path, x: torch.Tensor, want: torch.Tensor) -> None:
    """A valid ONNX model of standard Conv and Relu nodes that computes ``want``."""
    onnx = pytest.importorskip("onnx")
    onnxruntime = pytest.importorskip("onnxruntime")
    written = onnx.load(str(path))
    onnx.checker.check_model(written)
    assert [node.op_type for node in written.graph.node] == ["Conv", "Relu", "Conv"]
    assert all(node.domain in ("", "ai.onnx") for node in written.graph.node)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_both_onnx_exporters_write_a_standard_conv(dynamo, tmp_path):
    pytest.importorskip("onnxscript")
    model = _torch_model()
    x = _input()
    path = tmp_path / "model.onnx"
    torch.onnx.export(_converted(model), (x,), str(path), dynamo=dynamo, verbose=False)
    with torch.no_grad():
        _check_onnx(path, x, model(x))


def test_torchscript_exporter_takes_a_loaded_traced_model(tmp_path):
    """A traced model saved and loaded elsewhere is exported without gemmconv's Python
    being traced again: the translation is registered at import there, as torch.onnx
    is loaded first."""
    pytest.importorskip("onnx")
    model = _torch_model()
    x = _input()
    torch.jit.save(torch.jit.trace(_converted(model), (x,)), tmp_path / "traced.pt")
    export = textwrap.dedent(
        f"""
        import warnings
        warnings.simplefilter("ignore")
        import torch, torch.onnx
        import gemmconv
        traced = torch.jit.load({str(tmp_path / "traced.pt")!r})
        x = torch.zeros({tuple(x.shape)})
        torch.onnx.export(traced, (x,), {str(tmp_path / "model.onnx")!r}, dynamo=False)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", export], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    with torch.no_grad():
        _check_onnx(tmp_path / "model.onnx", x, model(x))


def _gemmconv_tracer_warnings(record: list) -> list[str]:
    """The TracerWarnings raised from gemmconv's own source, as 'file:line: message'."""
    root = Path(gemmconv.__file__).resolve().parent
    return [
        f"{w.filename}:{w.lineno}: {w.message}"
        for w in record
        if issubclass(w.category, torch.jit.TracerWarning)
        and Path(w.filename).resolve().is_relative_to(root)
    ]


@pytest.mark.parametrize(
    "memory_format, batched", [(None, True), (torch.channels_last, True), (None, False)],
    ids=["cf", "cl", "unbatched"],
)  # fmt: skip
def test_the_torchscript_exporter_warns_nothing_from_gemmconv(memory_format, batched, tmp_path):
    """The argument checks compare sizes, which jit tracing hands out as tensors: each
    comparison warned (13 TracerWarnings for this model) though none was recorded."""
    pytest.importorskip("onnx")
    model = _torch_model()
    converted = _converted(model, memory_format=memory_format)
    x = _input() if batched else _input()[0]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        torch.onnx.export(converted, (x,), str(tmp_path / "model.onnx"), dynamo=False)
    assert _gemmconv_tracer_warnings(record) == []
    if batched:  # onnxruntime's Conv takes a batch
        with torch.no_grad():
            _check_onnx(tmp_path / "model.onnx", x, model(x))


@pytest.mark.parametrize(
    "dims, padding, dilation", [(1, 1, 1), (2, "same", 2), (3, "valid", 1)],
    ids=["1d", "2d-same", "3d"],
)  # fmt: skip
def test_jit_trace_of_the_functions_warns_nothing_from_gemmconv(dims, padding, dilation):
    """'same' padding is resolved from the kernel's sizes, which tracing also hands out
    as tensors; the trace records the pads torch's own convolution computes."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, *[9] * dims, generator=generator, requires_grad=True)
    w = torch.randn(4, 3, *[4] * dims, generator=generator, requires_grad=True)
    gemmconv_conv = getattr(gemmconv, f"conv{dims}d")
    torch_conv = getattr(F, f"conv{dims}d")

    def conv(x, w):
        return gemmconv_conv(x, w, padding=padding, dilation=dilation)

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        traced = torch.jit.trace(conv, (x, w))
        y = traced(x, w)
        y.sum().backward()
    assert _gemmconv_tracer_warnings(record) == []
    torch.testing.assert_close(y, torch_conv(x, w, padding=padding, dilation=dilation))


def test_jit_trace_raises_the_argument_checks_errors():
    """Paused for the checks, the trace still refuses what torch refuses, and goes on
    tracing nothing afterwards."""
    x, w = torch.randn(1, 3, 8, 8), torch.randn(4, 2, 2, 2)
    with pytest.raises(RuntimeError, match="input of shape \\(1, 3, 8, 8\\) has 3 channels"):
        torch.jit.trace(lambda x, w: gemmconv.conv2d(x, w), (x, w))
    assert not torch.jit.is_tracing()


# ---- fx, the meta device, jit ------------------------------------------------------


def test_symbolic_trace_records_the_functional_and_runs_it():
    model = _torch_model()
    converted = _converted(model)
    traced = torch.fx.symbolic_trace(converted)
    calls = [node.target for node in traced.graph.nodes if node.op == "call_function"]
    assert calls == [gemmconv.functional.conv2d, gemmconv.functional.conv2d]
    x = _input()
    with torch.no_grad():
        torch.testing.assert_close(traced(x), model(x))


def test_symbolic_trace_of_a_padding_mode_and_of_the_function():
    conv = gemmconv.nn.Conv2d(3, 4, kernel_size=1, padding=1, padding_mode="reflect")
    x = _input()
    traced = torch.fx.symbolic_trace(conv)
    want = F.conv2d(F.pad(x, (1, 1, 1, 1), mode="reflect"), conv.weight, conv.bias)
    torch.testing.assert_close(traced(x), want)

    w = torch.rand(4, 3, 3, generator=torch.Generator().manual_seed(4))
    traced = torch.fx.symbolic_trace(lambda x: gemmconv.conv1d(x, w, padding="same"))
    x1 = _input()[:, :, 0]
    torch.testing.assert_close(traced(x1), F.conv1d(x1, w, padding="same"))


def test_the_meta_device_runs_forward_and_backward_as_torch_does():
    model = _torch_model().to("meta")
    converted = _converted(model)
    for m in (model, converted):
        for p in m.parameters():
            p.requires_grad_()
    x = torch.empty(2, 3, 18, 17, device="meta", requires_grad=True)
    got, want = converted(x), model(x)
    assert (got.device, got.shape, got.stride()) == (want.device, want.shape, want.stride())
    (dx,) = torch.autograd.grad(got.sum(), x)
    assert dx.device.type == "meta" and dx.shape == x.shape
    # A meta forward runs no solver, so there is nothing for solvers() to report.
    assert converted[0]._gemmconv_last_input is None


def test_jit_script_refuses_a_converted_conv_and_says_to_revert():
    model = _torch_model()
    converted = _converted(model)
    with pytest.raises(RuntimeError, match=r"gemmconv\.nn\.Conv2d .*gemmconv\.revert\(model\)"):
        torch.jit.script(converted)
    # The refusal changes nothing: the model is still converted and runs.
    assert isinstance(converted[0], gemmconv.nn.Conv2d)
    gemmconv.revert(converted)
    scripted = torch.jit.script(converted)
    x = _input()
    with torch.no_grad():
        torch.testing.assert_close(scripted(x), model(x))


def test_jit_trace_make_fx_and_compile_record_the_ops():
    converted = _converted(_torch_model())
    x = _input()
    assert "gemmconv::conv_forward" in str(torch.jit.trace(converted, (x,)).inlined_graph)
    with torch.no_grad():
        assert "gemmconv.conv_forward" in make_fx(converted)(x).code

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm.graph)
        return gm

    from torch._dynamo.backends.common import aot_autograd

    backend = aot_autograd(fw_compiler=keep, bw_compiler=keep)
    compiled = torch.compile(converted, backend=backend, fullgraph=True)
    compiled(x.requires_grad_()).sum().backward()
    forward, backward = (_targets(graph) for graph in graphs)
    assert torch.ops.gemmconv.conv_forward.default in forward
    assert torch.ops.aten.convolution.default not in forward
    assert {
        torch.ops.gemmconv.conv_backward_data.default,
        torch.ops.gemmconv.conv_backward_weights.default,
    } <= backward
