"""The opt-in fp8 mode (gemmconv.Float8Config, module.set_fp8, convert(fp8=...)).

On the CPU the fp8 run is reached through core.float8's test switch (torch._scaled_mm
has a CPU kernel), so its numerics, layouts and torch.compile trace are checked here;
without the switch the CPU checks the fallbacks and the errors. The gpu-marked tests
run the same cases on a CUDA device of compute capability 8.9 or later.

The error bound of an fp8 GEMM (``fp8_bound``), per result element: each operand
element a_i is rounded to fp8 with relative error at most u (e4m3, 3 mantissa bits:
u = 2^-4; e5m2: 2^-3) where it is normal, and absolute error at most u * t below it
(t = amax * min_normal / fp8_max, the scale taking amax to fp8_max; rowwise scales
only lower t, so the tensor's own t bounds it). So each product's error is at most
(u_a + u_b + u_a u_b) m_i with m_i = (|a_i| + t_a)(|b_i| + t_b), and the sum's at most
that times S1 = sum m_i (the worst case). For random signs the errors are independent
and zero-mean with variance at most (u_a^2 + u_b^2) / 3 m_i^2 (uniform rounding), so
the sum's standard deviation is below (u_a + u_b) / sqrt(3) * sqrt(S2), S2 = sum m_i^2:
it grows as sqrt(Kred), not Kred. The bound is the smaller of the worst case and
4 (u_a + u_b) sqrt(S2) (about 7 standard deviations), plus the rounding of the result
(and of a bias added after it) to the output dtype, 2 u_out (|y| + |bias|); fp32
accumulation adds about Kred 2^-24 relative, below that. S1 and S2 are convolutions of
m's factors, computed in float64 with torch's own convolution and its gradients.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import gemmconv
from gemmconv.core import float8 as core_float8
from gemmconv.core.problem import ConvProblem
from gemmconv.roads import float8 as road
from gemmconv.solvers import float8 as solver_float8

U = {torch.float8_e4m3fn: 2.0**-4, torch.float8_e5m2: 2.0**-3}
MIN_NORMAL = {torch.float8_e4m3fn: 2.0**-6, torch.float8_e5m2: 2.0**-14}
U_OUT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
SIGMAS = 4.0

CUDA_FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
needs_cuda_fp8 = pytest.mark.skipif(
    not CUDA_FP8, reason="needs a CUDA device of compute capability 8.9 or later"
)


@pytest.fixture
def fp8_on_cpu(monkeypatch):
    monkeypatch.setattr(core_float8, "_RUN_ON_CPU_FOR_TESTS", True)
    road.clear_decisions()
    yield
    road.clear_decisions()


@pytest.fixture
def nan_empty(monkeypatch):
    """Uninitialised tensors come back NaN (fp8: the NaN byte 0x7f), so that an element
    the fp8 run forgets to write shows in its results."""
    empty, empty_like = torch.empty, torch.empty_like

    def filled(t):
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            t.view(torch.uint8).fill_(0x7F)
        elif t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: filled(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: filled(empty_like(*a, **k)))


# ---- the bound --------------------------------------------------------------


def _floor(t: torch.Tensor, fp8: torch.dtype) -> float:
    """t: the absolute rounding floor of t's elements quantized with a tensorwise scale."""
    return t.abs().max().item() * MIN_NORMAL[fp8] / torch.finfo(fp8).max


def _grad_fns(dims):
    grad = torch.nn.grad
    conv = (F.conv1d, F.conv2d, F.conv3d)[dims - 1]
    conv_input = (grad.conv1d_input, grad.conv2d_input, grad.conv3d_input)[dims - 1]
    conv_weight = (grad.conv1d_weight, grad.conv2d_weight, grad.conv3d_weight)[dims - 1]
    return conv, conv_input, conv_weight


def fp8_bound(direction, x, w, dy, stride, config, out_dtype, reference, bias=None):
    """The bound of the module docstring for ``direction``'s result, per element."""
    x, w, dy = (t.double() for t in (x, w, dy))
    dims = w.dim() - 2
    conv, conv_input, conv_weight = _grad_fns(dims)
    fwd, grad = config.forward_dtype, config.grad_dtype
    ax = x.abs() + _floor(x, fwd)
    aw = w.abs() + _floor(w, fwd)
    ag = dy.abs() + _floor(dy, grad)
    if direction == "forward":
        u = U[fwd] + U[fwd]
        s1, s2 = conv(ax, aw, stride=stride), conv(ax**2, aw**2, stride=stride)
    elif direction == "backward_data":
        u = U[grad] + U[fwd]
        s1 = conv_input(x.shape, aw, ag, stride=stride)
        s2 = conv_input(x.shape, aw**2, ag**2, stride=stride)
    else:
        u = U[grad] + U[fwd]
        s1 = conv_weight(ax, w.shape, ag, stride=stride)
        s2 = conv_weight(ax**2, w.shape, ag**2, stride=stride)
    worst = (u + U[fwd] * U[grad]) * s1
    statistical = SIGMAS * u * s2.sqrt()
    rounding = 2 * U_OUT[out_dtype] * reference.abs()
    if bias is not None:
        rounding = rounding + 2 * U_OUT[out_dtype] * bias.double().abs().view(1, -1, *[1] * dims)
    return torch.minimum(worst, statistical) + rounding + 1e-30


def _check_within(name, result, reference, bound):
    assert not result.isnan().any(), f"{name}: NaN in the result (an element not written)"
    error = (result.double() - reference).abs()
    excess = (error - bound).max().item()
    worst = (error / bound).max().item()
    assert excess <= 0, f"{name}: error exceeds the fp8 bound by {excess:.3g} ({worst:.3g}x)"
    # The bound is not vacuous: below the result's own size, so that a result of zeros,
    # of the wrong scale or with its columns misordered (errors of that size) fails.
    assert bound.mean() < reference.abs().mean(), f"{name}: bound too loose"


# ---- the cases --------------------------------------------------------------

# name -> (torch class, in_channels, out_channels, kernel, input spatial, batch)
CASES = {
    # ViT-like 2-D patch: Kred 588 -> padded to 592, 2x3 patches a sample.
    "patch_2d": (torch.nn.Conv2d, 3, 32, 14, (28, 42), 4),
    # Video / Qwen-VL-like 3-D patch with a remainder no patch covers.
    "patch_3d": (torch.nn.Conv3d, 3, 16, (2, 7, 7), (4, 15, 14), 3),
    # One patch a sample (Qwen2-VL's embed at small size): Kred 1176 -> 1184.
    "point_output_3d": (torch.nn.Conv3d, 3, 32, (2, 14, 14), (2, 14, 14), 8),
    # One patch a sample with an aligned reduction: dx written by the GEMM in place.
    "point_output_2d": (torch.nn.Conv2d, 4, 16, 4, (4, 4), 40),
    "pointwise": (torch.nn.Conv2d, 48, 32, 1, (5, 7), 3),
}


def _make(case, dtype, device, layout, generator, bias=True):
    cls, c, k, kernel, spatial, n = CASES[case]
    reference = cls(c, k, kernel, stride=kernel, bias=bias).to(torch.float64)
    with torch.no_grad():
        reference.weight.uniform_(-1, 1, generator=generator)
        if bias:
            reference.bias.uniform_(-1, 1, generator=generator)
    module = cls(c, k, kernel, stride=kernel, bias=bias)
    gemmconv.convert(module)
    module.load_state_dict(reference.state_dict())
    module.to(device=device, dtype=dtype)
    x = torch.rand((n, c, *spatial), generator=generator, dtype=torch.float64) * 2 - 1
    x = x.to(device=device, dtype=dtype)
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
    return module, reference, x.requires_grad_()


def _run_and_check(case, dtype, layout, config, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    module, reference, x = _make(case, dtype, device, layout, generator)
    module.set_fp8(config)
    y = module(x)
    dy = (torch.rand(y.shape, generator=generator, dtype=torch.float64) * 2 - 1).to(device, dtype)
    y.backward(dy)
    xr = x.detach().double().cpu().requires_grad_()
    yr = reference(xr)
    yr.backward(dy.double().cpu())
    # torch's strides, in every result.
    torch_y = F.conv2d if x.dim() == 4 else F.conv3d
    expected = torch_y(x.detach(), module.weight.detach(), module.bias.detach(),
                       stride=module.stride)  # fmt: skip
    assert y.stride() == expected.stride(), (y.stride(), expected.stride())
    assert y.dtype == dtype and x.grad.dtype == dtype and module.weight.grad.dtype == dtype
    stride = module.stride
    xs, ws, dys = x.detach().cpu(), module.weight.detach().cpu(), dy.cpu()
    for name, result, ref in (
        ("forward", y, yr),
        ("backward_data", x.grad, xr.grad),
        ("backward_weights", module.weight.grad, reference.weight.grad),
    ):
        bias = module.bias.detach().cpu() if name == "forward" else None
        bound = fp8_bound(name, xs, ws, dys, stride, config, dtype, ref.detach(), bias)
        _check_within(f"{case} {layout} {name}", result.detach().cpu(), ref.detach(), bound)
    # The bias gradient is a bf16 sum, not an fp8 GEMM.
    torch.testing.assert_close(module.bias.grad.double().cpu(), reference.bias.grad,
                               rtol=4 * U_OUT[dtype], atol=1e-3)  # fmt: skip
    return module


LAYOUTS = ("channels_first", "channels_last")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_fp8_numerics_per_problem_class(case, layout, fp8_on_cpu, nan_empty):
    _run_and_check(case, torch.bfloat16, layout, gemmconv.Float8Config(), "cpu")


# The recipes besides the default (tensorwise, e4m3 gradients), each checked apart.
RECIPES = [
    gemmconv.Float8Config(scaling="rowwise"),
    gemmconv.Float8Config(grad_dtype=torch.float8_e5m2),
    gemmconv.Float8Config(round_scales_to_power_of_2=True),
]
RECIPE_IDS = ["rowwise", "e5m2_grads", "pow2_scales"]


@pytest.mark.parametrize("config", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("case", ["patch_2d", "point_output_3d", "pointwise"])
def test_fp8_recipes(case, config, fp8_on_cpu, nan_empty):
    _run_and_check(case, torch.bfloat16, "channels_last", config, "cpu", seed=1)
    _run_and_check(case, torch.bfloat16, "channels_first", config, "cpu", seed=2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fp8_results_in_the_input_dtype(dtype, fp8_on_cpu, nan_empty):
    # An fp32 model (outside autocast) runs fp8 GEMMs with fp32 results: the operands
    # are quantized either way, and an fp32 result keeps the accumulation's digits.
    _run_and_check("patch_2d", dtype, "channels_first", gemmconv.Float8Config(), "cpu")


def test_rowwise_with_fp16_results(fp8_on_cpu, nan_empty):
    # Rowwise GEMMs write bf16 only; the run casts to the input's dtype after them.
    _run_and_check("patch_2d", torch.float16, "channels_last",
                   gemmconv.Float8Config(scaling="rowwise"), "cpu")  # fmt: skip


def test_fp8_is_used_and_differs_from_bf16(fp8_on_cpu):
    generator = torch.Generator().manual_seed(3)
    module, _, x = _make("patch_2d", torch.bfloat16, "cpu", "channels_first", generator)
    plain = module(x)
    module.set_fp8(True)
    quantized = module(x)
    assert not torch.equal(plain, quantized)  # the fp8 GEMMs ran
    notes = module.solvers().notes
    assert any("runs all three directions as fp8 GEMMs" in n for n in notes), notes


def test_no_grad_call_matches_the_training_call(fp8_on_cpu):
    generator = torch.Generator().manual_seed(4)
    module, _, x = _make("point_output_3d", torch.bfloat16, "cpu", "channels_first", generator)
    module.set_fp8()
    with torch.no_grad():
        inference = module(x)
    assert torch.equal(module(x), inference)


def test_unbatched_input(fp8_on_cpu):
    generator = torch.Generator().manual_seed(5)
    module, _, x = _make("patch_2d", torch.bfloat16, "cpu", "channels_first", generator)
    module.set_fp8()
    y = module(x[1])
    assert y.shape == module(x)[1].shape
    assert torch.equal(y, module(x[1:2])[0])


def test_autocast_runs_fp8_in_autocast_dtype(fp8_on_cpu):
    generator = torch.Generator().manual_seed(6)
    module, _, x = _make("patch_2d", torch.float32, "cpu", "channels_first", generator)
    module.set_fp8()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = module(x)
    assert y.dtype == torch.bfloat16
    bf16 = gemmconv.nn.Conv2d(3, 32, 14, stride=14).to(torch.bfloat16)
    bf16.load_state_dict(module.state_dict())
    bf16.set_fp8()
    assert torch.equal(y, bf16(x.detach().to(torch.bfloat16)))
    y.float().sum().backward()
    assert module.weight.grad.dtype == torch.float32


def test_torch_compile_fullgraph(fp8_on_cpu):
    generator = torch.Generator().manual_seed(7)
    module, _, x = _make("patch_2d", torch.bfloat16, "cpu", "channels_last", generator)
    module.set_fp8()
    y = module(x)
    y.sum().backward()
    dx, dw = x.grad.clone(), module.weight.grad.clone()
    x.grad = module.weight.grad = module.bias.grad = None
    # aot_eager: dynamo's trace and AOT autograd, without inductor's CPU compile time.
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    yc = compiled(x)
    yc.sum().backward()
    assert torch.equal(yc, y)
    assert torch.equal(x.grad, dx)
    assert torch.equal(module.weight.grad, dw)


def test_explain_takes_list_and_tensor_arguments(fp8_on_cpu):
    """explain(..., fp8=...) with a list stride raised "unhashable type: 'list'" (the
    decision's key); a 0-d tensor stride is keyed by its value, read on every call."""
    x = torch.randn(2, 3, 32, 32).to(torch.bfloat16)
    w = torch.randn(16, 3, 16, 16).to(torch.bfloat16)
    note = gemmconv.explain(x, w, stride=[16, 16], fp8=True).notes[-1]
    assert "runs all three directions" in note
    stride = torch.tensor(16)
    assert "runs all three directions" in gemmconv.explain(x, w, stride=stride, fp8=True).notes[-1]
    stride.fill_(8)  # now patches overlap: not a patch problem
    assert "does not apply" in gemmconv.explain(x, w, stride=stride, fp8=True).notes[-1]


def test_eager_decisions_are_bounded(fp8_on_cpu, monkeypatch):
    """One decision per batch size was kept for ever (a server's patch count differs on
    every request): past EAGER_DECISIONS the least recently used goes, and a call whose
    decision went decides again, with the same result."""
    monkeypatch.setattr(road, "EAGER_DECISIONS", 3)
    module = torch.nn.Conv2d(3, 16, 4, stride=4)
    gemmconv.convert(module)
    module.to(torch.bfloat16).set_fp8()
    generator = torch.Generator().manual_seed(15)
    inputs = [
        torch.randn((n, 3, 8, 8), generator=generator).to(torch.bfloat16) for n in range(1, 7)
    ]
    first = [module(x) for x in inputs]
    assert len(road._EAGER) == 3
    again = [module(x) for x in inputs]
    assert len(road._EAGER) == 3
    for y, y2 in zip(first, again):
        assert torch.equal(y, y2)
    assert "runs all three directions" in module.solvers(inputs[0]).notes[-1]


def test_torch_compile_fullgraph_over_batch_sizes(fp8_on_cpu):
    """A second batch size makes dynamo's sizes symbolic (automatic dynamic shapes),
    which the run's decision, a constant to torch.compile, could not take: fullgraph
    raised "assume_constant_result argument conversion failed"."""
    module = torch.nn.Conv2d(3, 16, 4, stride=4)
    gemmconv.convert(module)
    module.to(torch.bfloat16).set_fp8()
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    generator = torch.Generator().manual_seed(14)
    for n in (2, 3, 5):
        x = torch.randn((n, 3, 8, 12), generator=generator).to(torch.bfloat16)
        x.requires_grad_()
        yc = compiled(x)
        yc.float().sum().backward()
        dxc = x.grad
        x.grad = None
        y = module(x)
        y.float().sum().backward()
        assert torch.equal(yc, y), n
        assert torch.equal(dxc, x.grad), n


def test_torch_compile_inductor_with_an_aligned_reduction(fp8_on_cpu):
    """Inductor's _scaled_mm lowering takes only dense operands ("mat_b must be
    col_major"); with a reduction needing no padding (3 x 4 x 4 = 48) the functional
    cast once kept the weight's transposed strides into backward-data's GEMM."""
    generator = torch.Generator().manual_seed(13)
    module = torch.nn.Conv2d(3, 16, 4, stride=4)
    gemmconv.convert(module)
    module.to(torch.bfloat16).set_fp8()
    x = (torch.rand((2, 3, 8, 12), generator=generator) * 2 - 1).to(torch.bfloat16)
    x.requires_grad_()
    y = module(x)
    y.float().square().sum().backward()
    dx, dw = x.grad.clone(), module.weight.grad.clone()
    x.grad = module.weight.grad = module.bias.grad = None
    compiled = torch.compile(module, fullgraph=True, backend="inductor")
    yc = compiled(x)
    yc.float().square().sum().backward()
    # Inductor computes the scaled operands in its own kernels: within one fp8 step.
    step = 2 * U[torch.float8_e4m3fn]
    assert (yc - y).abs().max().item() <= step * y.abs().max().item()
    assert (x.grad - dx).abs().max().item() <= 2 * step * dx.abs().max().item()
    assert (module.weight.grad - dw).abs().max().item() <= 2 * step * dw.abs().max().item()


# ---- where fp8 does not apply ------------------------------------------------


def _note(module, x) -> str:
    return module.solvers(x).notes[-1]


def test_cpu_runs_the_ordinary_path_and_says_why():
    generator = torch.Generator().manual_seed(8)
    module, _, x = _make("patch_2d", torch.bfloat16, "cpu", "channels_first", generator)
    plain = module(x)
    module.set_fp8()
    assert torch.equal(module(x), plain)
    note = _note(module, x)
    assert "does not apply" in note and "device cpu" in note, note
    explained = gemmconv.explain(x, module.weight, module.bias, stride=14, fp8=True)
    assert "device cpu: fp8 GEMMs run on CUDA only" in repr(explained)


def test_older_gpu_says_why(monkeypatch):
    monkeypatch.setattr(core_float8, "cuda_capability", lambda index: (8, 0))
    reasons = core_float8.device_reasons(torch.device("cuda", 0))
    assert reasons and "compute capability 8.0" in reasons[0] and "8.9" in reasons[0]


@pytest.mark.parametrize(
    ("module", "shape", "dtype", "expected"),
    [
        (gemmconv.nn.Conv2d(3, 16, 3, padding=1), (2, 3, 8, 8), torch.bfloat16,
         "not a patch, point-output or stride-1 1x1"),
        (gemmconv.nn.Conv2d(3, 10, 4, stride=4), (2, 3, 8, 8), torch.bfloat16,
         "out_channels 10 is not a multiple of 16"),
        (gemmconv.nn.Conv2d(3, 16, 4, stride=4), (2, 3, 8, 8), torch.float64,
         "dtype fp64"),
        (gemmconv.nn.Conv2d(16, 16, 1, stride=2), (2, 16, 8, 8), torch.bfloat16,
         "not a patch, point-output or stride-1 1x1"),
    ],
    ids=["3x3", "unaligned_out_channels", "fp64", "strided_1x1"],
)  # fmt: skip
def test_problems_fp8_does_not_cover_run_the_ordinary_path(
    module, shape, dtype, expected, fp8_on_cpu
):
    module = module.to(dtype)
    x = torch.randn(shape, dtype=dtype)
    plain = module(x)
    module.set_fp8()
    assert torch.equal(module(x), plain)
    note = _note(module, x)
    assert "does not apply" in note and expected in note, note


# ---- configuration and its errors --------------------------------------------


def test_config_defaults_follow_torchao_tensorwise():
    config = gemmconv.Float8Config()
    assert config.forward_dtype == torch.float8_e4m3fn
    assert config.grad_dtype == torch.float8_e4m3fn
    assert config.scaling == "tensorwise"
    assert config.round_scales_to_power_of_2 is False
    with pytest.raises(dataclasses_frozen_error()):
        config.scaling = "rowwise"


def dataclasses_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"forward_dtype": "e4m3"}, TypeError, ["forward_dtype='e4m3'", "torch.dtype"]),
        ({"forward_dtype": torch.float8_e5m2}, ValueError,
         ["forward_dtype=torch.float8_e5m2", "torch.float8_e4m3fn", "e5m2 x e5m2"]),
        ({"grad_dtype": torch.bfloat16}, ValueError,
         ["grad_dtype=torch.bfloat16", "torch.float8_e4m3fn or torch.float8_e5m2"]),
        ({"scaling": "blockwise"}, ValueError,
         ["scaling='blockwise'", "'tensorwise'", "'rowwise'"]),
        ({"scaling": 1}, TypeError, ["scaling=1", "expected a str"]),
        ({"round_scales_to_power_of_2": 1}, TypeError,
         ["round_scales_to_power_of_2=1", "expected a bool"]),
    ],
)  # fmt: skip
def test_bad_config_values_raise(kwargs, error, words):
    with pytest.raises(error) as raised:
        gemmconv.Float8Config(**kwargs)
    for word in words:
        assert word in str(raised.value), (word, str(raised.value))


def test_bad_fp8_arguments_raise():
    module = gemmconv.nn.Conv2d(3, 16, 4, stride=4)
    with pytest.raises(TypeError, match=r"Conv2d.set_fp8\(config\)='yes'.*Float8Config"):
        module.set_fp8("yes")
    with pytest.raises(TypeError, match=r"convert\(fp8\)='yes'"):
        gemmconv.convert(torch.nn.Conv2d(3, 16, 4, stride=4), fp8="yes")
    with pytest.raises(TypeError, match=r"explain\(fp8\)=3"):
        gemmconv.explain(torch.randn(1, 3, 4, 4), module.weight, stride=4, fp8=3)


def test_set_fp8_keeps_state_dict_and_constructor():
    module = gemmconv.nn.Conv2d(3, 16, 4, stride=4)
    keys = list(module.state_dict())
    assert module.set_fp8() is module
    assert module.fp8_config == gemmconv.Float8Config()
    assert list(module.state_dict()) == keys
    module.set_fp8(None)
    assert module.fp8_config is None
    import inspect

    ours = inspect.signature(gemmconv.nn.Conv2d.__init__).parameters
    assert "fp8" not in ours


def test_convert_marks_swapped_convolutions_and_revert_unmarks():
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 4, stride=4),  # patch: fp8 applies on a capable GPU
        torch.nn.Conv2d(32, 32, 1, stride=2),  # strided 1x1: swapped, fp8 never applies
        torch.nn.Conv2d(32, 32, 3, padding=1),  # not a GEMM: left alone
    )
    keys = list(model.state_dict())
    report = gemmconv.convert(model, fp8=gemmconv.Float8Config(scaling="rowwise"))
    assert model[0].fp8_config == gemmconv.Float8Config(scaling="rowwise")
    assert model[1].fp8_config is not None
    assert not hasattr(model[2], "fp8_config")
    assert list(model.state_dict()) == keys
    by_name = {s.name: s for s in report.swapped}
    assert "rowwise" in by_name["0"].fp8 and by_name["0"].fp8_not_applicable == ""
    assert "not a patch" in by_name["1"].fp8_not_applicable
    text = str(report)
    assert "rowwise scaling (on CUDA, compute capability 8.9 and up)" in text
    assert "will not apply" in text
    gemmconv.revert(model)
    assert type(model[0]) is torch.nn.Conv2d and "_gemmconv_fp8" not in vars(model[0])


def test_convert_without_fp8_leaves_modules_unconfigured():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 4, stride=4))
    report = gemmconv.convert(model)
    assert model[0].fp8_config is None and report.swapped[0].fp8 == ""


def test_composes_with_torchao_float8_training():
    float8 = pytest.importorskip("torchao.float8")

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Conv2d(3, 64, 4, stride=4)
            self.mlp = torch.nn.Linear(64, 64)

        def forward(self, x):
            return self.mlp(self.embed(x).flatten(2).transpose(1, 2))

    for gemmconv_first in (True, False):
        model = Tiny()
        if gemmconv_first:
            gemmconv.convert(model, fp8=True)
            float8.convert_to_float8_training(model)
        else:
            float8.convert_to_float8_training(model)
            gemmconv.convert(model, fp8=True)
        assert type(model.embed) is gemmconv.nn.Conv2d and model.embed.fp8_config is not None
        assert type(model.mlp).__name__ == "Float8Linear"
        model(torch.randn(2, 3, 16, 16)).sum().backward()  # fp8 on neither on the CPU


# ---- on a GPU with fp8 tensor cores ------------------------------------------


@pytest.mark.gpu
@needs_cuda_fp8
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_fp8_numerics_on_cuda(case, layout, nan_empty):
    road.clear_decisions()
    module = _run_and_check(case, torch.bfloat16, layout, gemmconv.Float8Config(), "cuda")
    assert any("runs all three directions" in n for n in module.solvers().notes)


@pytest.mark.gpu
@needs_cuda_fp8
@pytest.mark.parametrize("config", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_recipes_on_cuda(config, dtype, nan_empty):
    road.clear_decisions()
    for layout in LAYOUTS:
        _run_and_check("patch_2d", dtype, layout, config, "cuda", seed=9)
        _run_and_check("point_output_3d", dtype, layout, config, "cuda", seed=10)


@pytest.mark.gpu
@needs_cuda_fp8
def test_fp8_against_bf16_on_cuda():
    # The fp8 run's error against float64 stays within a few times the bf16 path's
    # (the fp8 rounding is 16x coarser than bf16's; its bound is the tested one above).
    road.clear_decisions()
    generator = torch.Generator().manual_seed(11)
    module, reference, x = _make("point_output_3d", torch.bfloat16, "cuda", "channels_first",
                                 generator, bias=False)  # fmt: skip
    ref = reference(x.detach().double().cpu())
    bf16_error = (module(x).double().cpu() - ref).abs().mean().item()
    module.set_fp8()
    fp8_error = (module(x).double().cpu() - ref).abs().mean().item()
    assert bf16_error < fp8_error < 64 * bf16_error, (bf16_error, fp8_error)


@pytest.mark.gpu
@needs_cuda_fp8
def test_torch_compile_inductor_on_cuda():
    road.clear_decisions()
    generator = torch.Generator().manual_seed(12)
    module, _, x = _make("patch_2d", torch.bfloat16, "cuda", "channels_last", generator)
    module.set_fp8()
    y = module(x)
    compiled = torch.compile(module, fullgraph=True)
    yc = compiled(x)
    yc.sum().backward()
    # Inductor fuses the scaling into its own kernels: the same fp8 values up to the
    # fp32 product's rounding, so within one fp8 step of the eager result.
    assert (yc - y).abs().max().item() <= 2 * U[torch.float8_e4m3fn] * y.abs().max().item()
    assert math.isfinite(module.weight.grad.float().sum().item())
    # Another batch size (dynamo's sizes turn symbolic) compiles its own graph.
    x2 = x.detach()[:3].requires_grad_()
    y2, y2_eager = compiled(x2), module(x2)
    bound = 2 * U[torch.float8_e4m3fn] * y2_eager.abs().max().item()
    assert (y2 - y2_eager).abs().max().item() <= bound


# ---- the casts: Triton copies against torch's multiply, on the GPU --------------

FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
SOURCE_DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _cast_operands(case, layout, dtype, config, seed, device="cuda"):
    """A run of ``case`` and its operands x, w, dY on ``device``, x and dY spread over many
    binades (fp8 subnormals and values that round up to a power of two included)."""
    generator = torch.Generator().manual_seed(seed)
    module, _, x = _make(case, dtype, device, layout, generator)
    x = x.detach()

    def spread(shape):
        # Down to 2^-30: e5m2's subnormals too (its scale takes the amax to 57344).
        return torch.exp2(torch.randint(-30, 4, shape, generator=generator).double())

    x = x.copy_(x.cpu().double().mul_(spread(x.shape)).to(dtype))  # keeps x's strides
    w = module.weight.detach()
    p = ConvProblem.from_tensors(x, w, None, module.stride)
    run = solver_float8.Float8Run(p, config)
    dy = torch.empty_like(module(x))  # torch's layout for y and dY
    values = torch.rand(dy.shape, generator=generator, dtype=torch.float64) * 2 - 1
    dy.copy_(values * spread(dy.shape))
    return run, x, w, dy


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        # Bytes of the flattened values: a view as bytes needs a last stride of 1, which
        # a channels-last result lacks, and so may a contiguous one whose last dim has
        # size 1 (torch leaves its stride free: point outputs' [N, K, 1, 1]).
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


@pytest.mark.gpu
@needs_cuda_fp8
@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", SOURCE_DTYPES, ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_casts_give_torchs_fp8_bytes_on_cuda(
    case, layout, dtype, fp8, monkeypatch, nan_empty
):
    config = gemmconv.Float8Config(grad_dtype=fp8)
    run, x, _, dy = _cast_operands(case, layout, dtype, config, seed=13)
    source = run._patches(x, run.geometry.x_order_last)
    sx, _ = run._scale(source, fp8, None)
    sdy, _ = run._scale(dy, fp8, None)

    def operands():
        cols = [run._columns(x, source, sx, fp8, transposed) for transposed in (False, True)]
        return cols + [run._gradient(dy, sdy, transposed) for transposed in (False, True)]

    assert solver_float8.kernel_casts("cuda", tensorwise=True, compiling=False)
    by_kernels = operands()
    monkeypatch.setattr(solver_float8, "kernel_casts", lambda *args: False)
    by_torch = operands()
    names = ("cols", "cols^T", "dY rows", "dY^T")
    for name, a, b in zip(names, by_kernels, by_torch):
        assert _same_bytes(a, b), f"{case} {layout} {dtype} {fp8}: {name} differs"


@pytest.mark.gpu
@needs_cuda_fp8
@pytest.mark.parametrize(
    "config",
    [gemmconv.Float8Config(), *RECIPES[1:]],
    ids=["tensorwise", *RECIPE_IDS[1:]],
)
@pytest.mark.parametrize("dtype", SOURCE_DTYPES, ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_float8_run_is_bitwise_the_same_with_and_without_kernel_casts_on_cuda(
    case, layout, dtype, config, monkeypatch, nan_empty
):
    run, x, w, dy = _cast_operands(case, layout, dtype, config, seed=17)
    bias = torch.rand(w.shape[0], dtype=dtype, device=x.device)

    def directions():
        # As Float8Convolution runs them: W^T from the forward's fp8 W where the kernel
        # path reuses it, cast anew from w on torch's.
        y, (x_scales, w_scales), wq = run.forward(x, w, bias)
        dy_scales = run.gradient_scales(dy)
        dx = run.backward_data(dy, w, w_scales, dy_scales, run.weight_for_backward(wq))
        dw = run.backward_weights(dy, x, x_scales, w, dy_scales)
        return y, dx, dw

    by_kernels = directions()
    monkeypatch.setattr(solver_float8, "kernel_casts", lambda *args: False)
    by_torch = directions()
    for name, a, b in zip(("forward", "backward_data", "backward_weights"), by_kernels, by_torch):
        assert not a.isnan().any(), f"{case} {layout} {dtype}: NaN in {name}"
        assert _same_bytes(a, b), f"{case} {layout} {dtype}: {name} differs"
