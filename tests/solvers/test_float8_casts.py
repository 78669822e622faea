"""Which path casts the fp8 run's operands, and the kernel path's layouts.

``kernel_casts`` sends x's and dY's casts to the Triton copies in eager mode on CUDA
with tensorwise scales. On the CPU the copies run interpreted when the choice is
forced, into fp16 (the interpreter's fp8 rounding is wrong for some values, see
tests/kernels/test_triton_kernels.py), and must give torch's path's values and
layouts exactly; the fp8 bytes and the whole run are compared on CUDA
(tests/api/test_fp8.py).
"""

from __future__ import annotations

import pytest
import torch

import gemmconv
from gemmconv.core.memory_format import Layout
from gemmconv.core.problem import ConvProblem
from gemmconv.core.sizes import round_up
from gemmconv.solvers import float8
from gemmconv.solvers.float8 import Float8Run, kernel_casts

# name -> (in_channels, out_channels, kernel, input spatial, batch), as test_fp8's.
CASES = {
    "patch_2d": (3, 32, (14, 14), (28, 42), 4),
    "patch_3d": (3, 16, (2, 7, 7), (4, 15, 14), 3),
    "point_output_3d": (3, 32, (2, 14, 14), (2, 14, 14), 8),
    "point_output_2d": (4, 16, (4, 4), (4, 4), 40),
    "pointwise": (48, 32, (1, 1), (5, 7), 3),
}
LAYOUTS = ("channels_first", "channels_last")


def test_kernels_cast_in_eager_cuda_tensorwise_runs_only():
    assert kernel_casts("cuda", tensorwise=True, compiling=False)
    assert not kernel_casts("cpu", tensorwise=True, compiling=False)  # Triton interprets
    assert not kernel_casts("cuda", tensorwise=False, compiling=False)  # rowwise scales
    assert not kernel_casts("cuda", tensorwise=True, compiling=True)  # inductor fuses


def test_no_kernel_casts_without_triton(monkeypatch):
    monkeypatch.setattr(float8, "_have_triton", lambda: False)
    assert not kernel_casts("cuda", tensorwise=True, compiling=False)


def test_the_run_asks_with_its_device_recipe_and_trace(monkeypatch):
    asked = []
    monkeypatch.setattr(float8, "kernel_casts", lambda *a: asked.append(a) or False)
    for scaling in ("tensorwise", "rowwise"):
        run, x, _ = _run_and_operands("patch_2d", "channels_first", torch.float32, scaling)
        run._by_kernel(x)
    assert asked == [("cpu", True, False), ("cpu", False, False)]


def _layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "channels_first":
        return t
    return t.to(memory_format=torch.channels_last if t.dim() == 4 else torch.channels_last_3d)


def _run_and_operands(case, layout, dtype, scaling="tensorwise", seed=0):
    c, k, kernel, spatial, n = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    x = _layout((torch.rand(n, c, *spatial, generator=gen) * 2 - 1).to(dtype), layout)
    w = torch.empty(k, c, *kernel, dtype=dtype)
    p = ConvProblem.from_tensors(x, w, None, kernel)
    run = Float8Run(p, gemmconv.Float8Config(scaling=scaling))
    dy = _layout((torch.rand(p.output_shape, generator=gen) * 2 - 1).to(dtype), layout)
    return run, x, dy


@pytest.fixture
def nan_empty(monkeypatch):
    """fp16 buffers come back NaN, so that an element the kernels leave unwritten shows."""
    empty = torch.empty

    def filled(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.dtype == torch.float16 else t

    monkeypatch.setattr(torch, "empty", filled)


def _rows_reference(dy, scale, m, k, transposed) -> torch.Tensor:
    """torch's dY rows [M, K] or dY^T [K, M'] times ``scale``, rounded to fp16."""
    rows = (dy.movedim(1, -1).reshape(m, k).float() * scale).to(torch.float16)
    if not transposed:
        return rows
    padded = torch.zeros(k, round_up(m, 16), dtype=torch.float16)
    padded[:, :m] = rows.t()
    return padded


@pytest.mark.parametrize("transposed", [False, True], ids=["cols", "cols_t"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_path_operands_match_torch_interpreted(
    case, layout, dtype, transposed, monkeypatch, nan_empty
):
    run, x, dy = _run_and_operands(case, layout, dtype)
    g = run.geometry
    source = run._patches(x, g.x_order_last)
    scale = torch.tensor([3.7])
    expected = run._columns(x, source, scale, torch.float16, transposed)
    monkeypatch.setattr(float8, "kernel_casts", lambda *a: True)
    assert torch.equal(run._columns(x, source, scale, torch.float16, transposed), expected)

    quantized = run._gradient_by_kernel(dy, scale, torch.float16, transposed)
    assert torch.equal(quantized, _rows_reference(dy, scale, g.m, g.k, transposed))


@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "rows_t"])
def test_a_gradient_no_view_makes_rows_of_takes_torchs_path(transposed, monkeypatch):
    run, _, dy = _run_and_operands("patch_2d", "channels_first", torch.float32)
    wide = torch.zeros(dy.shape[0], dy.shape[1], 2 * dy.shape[2], dy.shape[3])
    wide[:, :, ::2] = dy
    strided = wide[:, :, ::2]  # [N, K, O1, O2]: O1 and O2 do not merge, nor N and O
    scale = torch.tensor([3.7])
    assert run._gradient_by_kernel(strided, scale, torch.float16, transposed) is None
    # _gradient then casts through torch's multiply, to the same bytes as a dense dY.
    monkeypatch.setattr(float8, "kernel_casts", lambda *a: True)
    got = run._gradient(strided, scale, transposed).view(torch.uint8)
    monkeypatch.setattr(float8, "kernel_casts", lambda *a: False)
    assert torch.equal(got, run._gradient(dy, scale, transposed).view(torch.uint8))


@pytest.mark.parametrize(
    ("case", "layout", "whole_rows"),
    [
        ("point_output_3d", "channels_first", True),  # a patch is a whole sample
        ("pointwise", "channels_last", True),  # a pixel's channels are a row
        ("patch_2d", "channels_first", False),
        ("pointwise", "channels_first", False),
    ],
)
def test_x_as_whole_rows_is_transposed_by_the_tiled_copy(case, layout, whole_rows, monkeypatch):
    run, x, _ = _run_and_operands(case, layout, torch.float32)
    source = run._patches(x, run.geometry.x_order_last)
    used = []
    tiled = Float8Run._transposed_rows
    counted = staticmethod(lambda *a: used.append(1) or tiled(*a))
    monkeypatch.setattr(Float8Run, "_transposed_rows", counted)
    monkeypatch.setattr(float8, "kernel_casts", lambda *a: True)
    run._columns(x, source, torch.tensor([3.7]), torch.float16, transposed=True)
    assert bool(used) == whole_rows


# ---- the kernel path's moves of y and dx, and the reused weight ---------------------
# The whole run on the CPU, kernel path forced against torch's. Operands are small
# integers and scales powers of two, so every fp8 value is exact and the interpreter's
# fp8 rounding (above) never enters; uninitialised buffers are NaN (fp8: the byte
# 0x7f), so an element the kernels leave unwritten shows.

EXACT = gemmconv.Float8Config(round_scales_to_power_of_2=True)


@pytest.fixture
def all_nan_empty(monkeypatch):
    empty = torch.empty

    def filled(*args, **kwargs):
        t = empty(*args, **kwargs)
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            return t.view(torch.uint8).fill_(0x7F).view(t.dtype)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", filled)


def _exact_run(case, layout, dtype, seed=0):
    """A run with power-of-two scales and x, w, dY, bias of integers in [-7, 7]."""
    c, k, kernel, spatial, n = CASES[case]
    gen = torch.Generator().manual_seed(seed)

    def ints(*shape):
        return torch.randint(-7, 8, shape, generator=gen).to(dtype)

    x = _layout(ints(n, c, *spatial), layout)
    w = ints(k, c, *kernel)
    p = ConvProblem.from_tensors(x, w, None, kernel)
    dy = _layout(ints(*p.output_shape), layout)
    return Float8Run(p, EXACT), x, w, dy, ints(k)


def _spy(monkeypatch, module, name: str) -> list:
    called = []
    original = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: called.append(1) or original(*a, **k))
    return called


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.stride() == b.stride() and not a.isnan().any() and torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_path_forward_y_matches_torch_interpreted(
    case, layout, dtype, monkeypatch, all_nan_empty
):
    from gemmconv.kernels import strided_copy

    run, x, w, _, bias = _exact_run(case, layout, dtype)
    expected = run.forward(x, w, bias)[0]
    copies = _spy(monkeypatch, strided_copy, "strided_copy")
    monkeypatch.setattr(float8, "kernel_casts", lambda *a: True)
    y = run.forward(x, w, bias)[0]
    assert _same(y, expected)
    # The tiled transpose writes a channels-first y with several pixels a sample (a
    # channels-last 3-D bf16 y is channels-first on a CPU whose oneDNN lacks bf16).
    g = run.geometry
    several = g.result_layout is Layout.CHANNELS_FIRST and g.m > g.n
    assert bool(copies) == several


def test_more_samples_than_a_launch_takes_keep_torchs_copy_of_y(monkeypatch, all_nan_empty):
    from gemmconv.kernels import strided_copy

    run, x, w, _, bias = _exact_run("patch_2d", "channels_first", torch.float32)
    expected = run.forward(x, w, bias)[0]
    monkeypatch.setattr(strided_copy, "MAX_BATCH", run.geometry.n - 1)
    copies = _spy(monkeypatch, strided_copy, "strided_copy")
    monkeypatch.setattr(float8, "kernel_casts", lambda *a: True)
    assert _same(run.forward(x, w, bias)[0], expected)
    assert not copies


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_path_backward_data_dx_matches_torch_interpreted(
    case, layout, dtype, monkeypatch, all_nan_empty
):
    from gemmconv.kernels import patch_permute

    run, x, w, dy, _ = _exact_run(case, layout, dtype)
    _, (_, w_scales), wq = run.forward(x, w, None)
    assert run.weight_for_backward(wq) is None  # torch's path casts W^T itself
    expected = run.backward_data(dy, w, w_scales, None, wq)
    scatters = _spy(monkeypatch, patch_permute, "scatter_patches")
    monkeypatch.setattr(float8, "kernel_casts", lambda *a: True)
    _, (_, w_scales), wq = run.forward(x, w, None)
    reused = run.weight_for_backward(wq)
    # Kept where both directions order the reduction alike: dx's layout, like y's,
    # is channels-first for a 3-D bf16 problem on a CPU whose oneDNN lacks bf16.
    g = run.geometry
    assert (reused is wq) == (g.x_order_last == g.dx_order_last)
    dx = run.backward_data(dy, w, w_scales, None, reused)
    assert _same(dx, expected)
    # Only where dx's memory is not the column matrix are the columns scattered: where
    # it is, the GEMM writes it, or its padded rows are copied in row by row.
    g = run.geometry
    assert bool(scatters) == (run._rows_of(dx, g.dx_order_last) is None)
    if case == "patch_3d":  # the remainder no patch covers stays zero
        assert (dx[:, :, :, 14:] == 0).all() and (dx[:, :, :, :, 14:] == 0).all()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_backward_datas_weight_from_the_forwards_has_the_same_bytes(case, layout, monkeypatch):
    # Random weights over many binades, cast by torch's multiply in both directions (the
    # weight never takes the interpreter), so the bytes are fp8's own.
    run, x, _ = _run_and_operands(case, layout, torch.bfloat16)
    c, k, kernel, _, _ = CASES[case]
    gen = torch.Generator().manual_seed(5)
    w = (torch.rand(k, c, *kernel, generator=gen) * 2 - 1) * torch.exp2(
        torch.randint(-12, 4, (k, c, *kernel), generator=gen).float()
    )
    w = w.to(torch.bfloat16)
    monkeypatch.setattr(float8, "kernel_casts", lambda *a: True)
    _, (_, (sw, _)), wq = run.forward(x, w, None)
    g = run.geometry
    if g.x_order_last != g.dx_order_last:  # dx channels-first here (oneDNN lacks bf16)
        assert run.weight_for_backward(wq) is None
        return
    reused = run.weight_for_backward(wq).t().contiguous()
    cast = run._weight(w, sw, run.config.forward_dtype, g.dx_order_last, transposed=True)
    assert reused.shape == cast.shape == (g.ld, g.k) and reused.stride() == cast.stride()
    assert torch.equal(reused.view(torch.uint8), cast.view(torch.uint8))
    assert (cast.view(torch.uint8)[g.kred :] == 0).all()  # the reduction's padding


def test_the_forwards_weight_is_kept_only_where_backward_data_reuses_it(monkeypatch):
    run, x, w, _, _ = _exact_run("patch_2d", "channels_first", torch.float32)
    wq = run.forward(x, w, None)[2]
    assert run.weight_for_backward(wq) is None  # the CPU: torch's path
    monkeypatch.setattr(float8, "kernel_casts", lambda *a: True)
    assert run.weight_for_backward(wq) is wq
    rowwise = Float8Run(run.problem, gemmconv.Float8Config(scaling="rowwise"))
    monkeypatch.setattr(float8, "kernel_casts", lambda device, tensorwise, compiling: tensorwise)
    assert rowwise.weight_for_backward(rowwise.forward(x, w, None)[2]) is None


CUDA = pytest.param("cuda", marks=pytest.mark.gpu)


@pytest.mark.parametrize("pow2", [False, True], ids=["exact", "pow2"])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_eager_tensorwise_scale_is_the_recipes_to_the_bit(device, dtype, fp8, pow2):
    # The eager form folds the amax's reshape, widening and clamp into one maximum; the
    # recipe's form (torch.compile's) is the reference, over amaxes below the eps, zero,
    # NaN, infinite and ordinary.
    from gemmconv.core.float8 import AMAX_EPS

    config = gemmconv.Float8Config(round_scales_to_power_of_2=pow2)
    run = Float8Run(_run_and_operands("patch_2d", "channels_first", dtype)[0].problem, config)
    tiny = torch.finfo(dtype).tiny * 0.5  # a subnormal: below AMAX_EPS in bf16 and fp32
    for amax in (0.0, tiny, 1e-3, 3.7, 448.0, 6e4, float("nan"), float("inf")):
        t = torch.tensor([[-amax, amax / 3], [amax / 4, 0.0]], dtype=dtype, device=device)
        scale, inverse = run._scale(t, fp8, None)
        expected = torch.linalg.vector_norm(t, float("inf")).reshape(1).float()
        expected = expected.clamp_(min=AMAX_EPS).div_(torch.finfo(fp8).max)
        if pow2:
            expected = torch.exp2(torch.ceil(torch.log2(expected)))
        assert inverse.shape == scale.shape == (1,) and inverse.dtype == torch.float32
        if amax != amax and device == "cpu":
            # A NaN's payload may differ on the CPU, which keeps payloads; CUDA's
            # arithmetic (div_ here) returns its one canonical NaN, so there the bytes
            # are compared too.
            assert inverse.isnan().all() and scale.isnan().all()
            continue
        assert torch.equal(inverse.view(torch.int32), expected.view(torch.int32)), amax
        assert torch.equal(scale.view(torch.int32), expected.reciprocal().view(torch.int32))


@pytest.mark.parametrize("pow2", [False, True], ids=["exact", "pow2"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_tensorwise_scales_take_one_kernel_where_triton_casts(monkeypatch, layout, pow2):
    # Where the kernels cast (forced here, as on CUDA), a dense operand's scale pair
    # comes from kernels/amax_scale.py, to the recipe's bit; a slice of x and power-of-2
    # scales keep torch's calls.
    from gemmconv.kernels import amax_scale as scale_kernel

    launched = []
    scaled = scale_kernel.amax_scale
    monkeypatch.setattr(scale_kernel, "amax_scale", lambda *a: launched.append(a) or scaled(*a))
    monkeypatch.setattr(float8, "kernel_casts", lambda *a: True)
    run, x, dy = _run_and_operands("patch_2d", layout, torch.bfloat16)
    run = Float8Run(run.problem, gemmconv.Float8Config(round_scales_to_power_of_2=pow2))
    for t in (x, dy, x[:, :2]):
        scale, inverse = run._scale(t, torch.float8_e4m3fn, None)
        expected = torch.linalg.vector_norm(t, float("inf")).reshape(1).float() / 448.0
        if pow2:
            expected = torch.exp2(torch.ceil(torch.log2(expected)))
        assert torch.equal(inverse.view(torch.int32), expected.view(torch.int32))
        assert torch.equal(scale.view(torch.int32), expected.reciprocal().view(torch.int32))
    assert len(launched) == (0 if pow2 else 2)


def test_no_eps_tensor_is_made_while_a_cuda_graph_is_captured(monkeypatch):
    # A fill recorded in a capture runs only at replay: the eps must not be made then,
    # and the scale takes the recipe's own form meanwhile.
    monkeypatch.setattr(float8, "_EPS", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert float8._eps_on(torch.device("cuda")) is None
    assert float8._EPS == {}
    monkeypatch.setattr(float8, "_eps_on", lambda device: None)
    run, x, _ = _run_and_operands("patch_2d", "channels_first", torch.bfloat16)
    scale, inverse = run._scale(x, torch.float8_e4m3fn, None)
    expected = torch.linalg.vector_norm(x, float("inf")).reshape(1).float() / 448.0
    assert inverse.shape == (1,) and torch.equal(inverse, expected)
    assert torch.equal(scale, expected.reciprocal())
