"""Parity with torch's convolution where torch is the reference: the output's memory
format on every problem and solver, calls in dtypes and layouts gemmconv hands to
torch, and empty reductions (a zero-channel input, an empty batch) in every direction,
selection mode and road.

Every expectation is torch's answer to the same call, asked while the test runs.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.nn.functional as F

import gemmconv
from gemmconv.functional import problem_of
from gemmconv.solvers import SOLVERS

TORCH_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
GEMMCONV_CONV = {1: gemmconv.conv1d, 2: gemmconv.conv2d, 3: gemmconv.conv3d}
MODES = ("immediate", "database", "find", "hybrid")
# A GEMM sums a reduction in another order than torch's convolution kernels.
FP32_GEMM_TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}


def _same_memory_format(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal strides wherever a dimension has more than one element: a size-1
    dimension's stride addresses nothing, and torch's kernels leave it arbitrary."""
    pairs = zip(got.stride(), expected.stride(), expected.shape, strict=True)
    return got.shape == expected.shape and all(a == b for a, b, n in pairs if n > 1)


def _layouts(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """``t`` in channels-first, channels-last (for a 3-D tensor: transpose(1, 2)
    contiguous, as a permuted 1-D weight is), spatially transposed, and batch-major
    permuted memory orders."""
    out = {"cf": t.contiguous(), "cl": t.movedim(1, -1).contiguous().movedim(-1, 1)}
    if t.dim() >= 4:
        out["spatial_t"] = t.transpose(-1, -2).contiguous().transpose(-1, -2)
    out["nc"] = t.transpose(0, 1).contiguous().transpose(0, 1)
    return out


def _applicable_solvers(x, w, stride) -> list[str]:
    problem = problem_of(x, w, None, stride)
    return [s.id for s in SOLVERS if not s.not_supported_reasons(problem)]


def _stride_cases(seed: int, count: int) -> list[tuple]:
    """Problems that GEMM solvers take (patch, point-output, pointwise, strided
    pointwise) and some they do not, over dims, batch sizes 1, 2 and 17, dtypes."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        dims = rng.choice((1, 2, 3))
        kind = rng.choice(("patch", "point", "pointwise", "strided_pointwise"))
        r = {"patch": 2, "point": 3, "pointwise": 1, "strided_pointwise": 1}[kind]
        s = {"patch": 4, "point": 3, "pointwise": 3, "strided_pointwise": 5}[kind]
        u = {"patch": 2, "point": 3, "pointwise": 1, "strided_pointwise": 2}[kind]
        n = rng.choice((1, 1, 2, 17))
        c, k = rng.choice((1, 3, 8)), rng.choice((1, 4, 8))
        dtype = rng.choice((torch.float32, torch.float32, torch.float64, torch.bfloat16))
        cases.append((dims, n, c, k, r, s, u, dtype))
    return cases


@pytest.mark.parametrize("case", _stride_cases(0, 24), ids=str)
def test_output_strides_match_torch_for_every_solver_and_layout(case, monkeypatch):
    """Property: for every memory order of x and of the weight, and every solver that
    applies (forced), gemmconv's output has torch's values and memory format, on the
    eager road and on the op road (a list stride takes it)."""
    dims, n, c, k, r, s, u, dtype = case
    gen = torch.Generator().manual_seed(hash(case) % 2**31)
    x0 = torch.randn(n, c, *[s] * dims, generator=gen).to(dtype)
    w0 = torch.randn(k, c, *[r] * dims, generator=gen).to(dtype)
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else FP32_GEMM_TOLERANCE
    checked = 0
    for (xl, x), (wl, w) in itertools.product(_layouts(x0).items(), _layouts(w0).items()):
        expected = TORCH_CONV[dims](x, w, stride=u)
        for solver in _applicable_solvers(x, w, u):
            monkeypatch.setenv("GEMMCONV_SOLVER", solver)
            for stride in (u, [u] * dims):
                got = GEMMCONV_CONV[dims](x, w, stride=stride)
                where = f"{solver}, x {xl} {x.stride()}, w {wl} {w.stride()}, stride={stride!r}"
                assert _same_memory_format(got, expected), (
                    f"{where}: torch {expected.stride()}, gemmconv {got.stride()}"
                )
                torch.testing.assert_close(got, expected, **tol)
                checked += 1
    assert checked > 0


@pytest.mark.parametrize(
    ("x", "w", "stride"),
    [
        # A 1-D convolution with a permuted (channels-last strided) weight: torch's
        # output is channels-last.
        (torch.randn(8, 64, 32), torch.randn(16, 1, 64).permute(0, 2, 1), 1),
        (torch.randn(2, 8, 32), torch.randn(16, 4, 8).permute(0, 2, 1), 4),
        # A small 3-D fp32 batch-1 channels-last input: torch's CPU runs its slow,
        # contiguous kernel.
        (
            torch.randn(1, 16, 4, 8, 8).to(memory_format=torch.channels_last_3d),
            torch.randn(32, 16, 2, 2, 2),
            2,
        ),  # fmt: skip
    ],
    ids=["conv1d_permuted_weight", "conv1d_patch_permuted_weight", "conv3d_batch1_cl3d"],
)
def test_reported_stride_mismatches(x, w, stride):
    dims = w.dim() - 2
    expected = TORCH_CONV[dims](x, w, stride=stride)
    for given in (stride, [stride] * dims):
        got = GEMMCONV_CONV[dims](x, w, stride=given)
        assert _same_memory_format(got, expected), (got.stride(), expected.stride())
        torch.testing.assert_close(got, expected, **FP32_GEMM_TOLERANCE)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compiled_output_strides_match_eager_torch(dynamic: bool):
    """torch.compile relies on the op's fake implementation: it must promise the
    strides torch gives, and the real implementation must keep the promise (inductor
    asserts it), with symbolic sizes too. The 3-D batch sizes cross torch's switch
    between its slow kernel (batch 1, contiguous) and oneDNN (channels-last)."""
    torch._dynamo.reset()
    w1 = torch.randn(16, 4, 8).permute(0, 2, 1)
    w3 = torch.randn(32, 16, 2, 2, 2)
    conv1 = torch.compile(lambda x: gemmconv.conv1d(x, w1, stride=4), dynamic=dynamic)
    conv3 = torch.compile(lambda x: gemmconv.conv3d(x, w3, stride=2), dynamic=dynamic)
    for n in (2, 3, 1):
        x1 = torch.randn(n, 8, 32)
        x3 = torch.randn(n, 16, 4, 8, 8).to(memory_format=torch.channels_last_3d)
        for compiled, x, w, torch_conv, u in ((conv1, x1, w1, F.conv1d, 4),
                                              (conv3, x3, w3, F.conv3d, 2)):  # fmt: skip
            expected, got = torch_conv(x, w, stride=u), compiled(x)
            assert _same_memory_format(got, expected), (n, got.stride(), expected.stride())
            torch.testing.assert_close(got, expected, **FP32_GEMM_TOLERANCE)


# ---- calls gemmconv hands to torch -----------------------------------------------

HANDED_DTYPES = (torch.int64, torch.int32, torch.uint8, torch.complex64)


@pytest.mark.parametrize("d", (1, 2, 3))
@pytest.mark.parametrize("dtype", HANDED_DTYPES, ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_dtypes_torch_computes_give_torchs_result(d: int, dtype: torch.dtype, with_bias: bool):
    gen = torch.Generator().manual_seed(d)
    x = (torch.randn(2, 4, *[6] * d, generator=gen) * 4).to(dtype)
    w = (torch.randn(6, 4, *[3] * d, generator=gen) * 4).to(dtype)
    b = (torch.randn(6, generator=gen) * 4).to(dtype) if with_bias else None
    for stride in (2, [2] * d):  # the eager road and the op road
        expected = TORCH_CONV[d](x, w, b, stride=stride)
        got = GEMMCONV_CONV[d](x, w, b, stride=stride)
        assert got.dtype == expected.dtype and got.stride() == expected.stride()
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_mkldnn_operands_give_torchs_result():
    x = torch.randn(2, 4, 8, 8)
    w = torch.randn(6, 4, 2, 2)
    for xs, ws in [(x.to_mkldnn(), w.to_mkldnn()), (x.to_mkldnn(), w)]:
        expected = F.conv2d(xs, ws, stride=2)
        got = gemmconv.conv2d(xs, ws, stride=2)
        assert got.layout == expected.layout == torch._mkldnn
        torch.testing.assert_close(got.to_dense(), expected.to_dense())


def _quantized(t: torch.Tensor) -> torch.Tensor:
    return torch.quantize_per_tensor(t, 0.1, 0, torch.quint8)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda t: t.to(torch.float8_e4m3fn), id="float8_e4m3fn"),
        pytest.param(lambda t: t.to(torch.float8_e5m2), id="float8_e5m2"),
        pytest.param(_quantized, id="quint8"),
    ],
)
@pytest.mark.parametrize("d", (1, 2))
def test_dtypes_torch_refuses_raise_torchs_type(make, d: int):
    x, w = make(torch.randn(2, 4, *[6] * d)), make(torch.randn(6, 4, *[3] * d))
    with pytest.raises(Exception) as by_torch:
        TORCH_CONV[d](x, w)
    for stride in (1, [1] * d):
        with pytest.raises(Exception) as caught:
            GEMMCONV_CONV[d](x, w, stride=stride)
        assert caught.type is by_torch.type, caught.value
        assert str(caught.value).startswith(f"conv{d}d: input dtype {x.dtype}"), caught.value
    with pytest.raises(by_torch.type):
        gemmconv.explain(x, w)


# ---- empty reductions ---------------------------------------------------------------


def _empty_cases() -> list[tuple]:
    """(dims, N, C, K, groups): a zero-channel input, an empty batch, both; grouped."""
    cases = []
    for dims in (1, 2, 3):
        cases += [(dims, 1, 0, 3, 1), (dims, 0, 4, 3, 1), (dims, 0, 0, 3, 1), (dims, 2, 0, 4, 2)]
    return cases


def _torch_and_gemmconv(dims, n, c, k, groups, stride, layout: str, call):
    """Run ``call(conv, x, w, b)`` with torch's and gemmconv's convolution on equal
    leaf tensors; returns both (output, dx, dW, db)."""
    results = []
    for conv in (TORCH_CONV[dims], GEMMCONV_CONV[dims]):
        torch.manual_seed(0)
        x = torch.randn(n, c, *[5] * dims)
        w = torch.randn(k, c // groups, *[2] * dims)
        if layout == "cl":
            x, w = _layouts(x)["cl"], _layouts(w)["cl"]
        b = torch.randn(k)
        for t in (x, w, b):
            t.requires_grad_(True)
        y = call(conv, x, w, b, stride, groups)
        (y * 1.5).sum().backward()  # dY of ones * 1.5, so the bias's gradient is not trivial
        results.append((y.detach(), x.grad, w.grad, b.grad))
    return results


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", _empty_cases(), ids=str)
@pytest.mark.parametrize("road", ["eager", "op"])
def test_empty_reductions_match_torch_in_every_mode(mode, case, road):
    """Forward, dx, dW and the bias's gradient of a zero-channel input or an empty
    batch, in every selection mode, on the eager road (int stride) and the op road
    (list stride)."""
    dims, n, c, k, groups = case

    def call(conv, x, w, b, stride, groups):
        return conv(x, w, b, stride=stride if road == "eager" else [stride] * dims, groups=groups)

    with gemmconv.find_mode(mode):
        for layout in ("cf", "cl"):
            expected, got = _torch_and_gemmconv(dims, n, c, k, groups, 2, layout, call)
            for name, e, g in zip(("y", "dx", "dW", "db"), expected, got, strict=True):
                assert g is not None and g.shape == e.shape, (name, g, e)
                torch.testing.assert_close(g, e, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("case", [(2, 1, 0, 3, 1), (2, 0, 4, 3, 1), (1, 0, 0, 3, 1)], ids=str)
def test_empty_reductions_under_compile_match_eager_torch(case):
    """Compiled gemmconv against eager torch: torch 2.14's own compiled backward of an
    empty batch fails its stride assertion on dW, so eager torch is the reference."""
    dims, n, c, k, groups = case

    def call(conv, x, w, b, stride, groups):
        if conv is TORCH_CONV[dims]:
            return conv(x, w, b, stride=stride)
        compiled = torch.compile(lambda x, w, b: conv(x, w, b, stride=[stride] * dims))
        return compiled(x, w, b)

    torch._dynamo.reset()
    expected, got = _torch_and_gemmconv(dims, n, c, k, groups, 2, "cf", call)
    for name, e, g in zip(("y", "dx", "dW", "db"), expected, got, strict=True):
        assert g is not None and g.shape == e.shape, (name, g, e)
        torch.testing.assert_close(g, e)


def test_zero_output_channels_are_refused_as_torch_refuses():
    x, w = torch.randn(2, 3, 4, 4), torch.randn(0, 3, 2, 2)
    with pytest.raises(Exception) as by_torch:
        F.conv2d(x, w)
    with pytest.raises(by_torch.type):
        gemmconv.conv2d(x, w)


# ---- tensor-valued arguments ----------------------------------------------------------


@pytest.mark.parametrize(
    ("argument", "first", "then"), [("stride", 2, 4), ("padding", 1, 0), ("dilation", 1, 2)]
)
@pytest.mark.parametrize("form", ["tensor", "tuple_of_tensors"])
def test_a_changed_tensor_argument_is_read_again(argument, first, then, form):
    """A 0-d tensor's value can change while the object stays: each call must read it,
    as torch's does."""
    x, w = torch.randn(2, 4, 9, 9), torch.randn(4, 4, 2, 2)
    value = torch.tensor(first)
    given = (value, value) if form == "tuple_of_tensors" else value
    for expected_value in (first, then, first):
        value.fill_(expected_value)
        expected = F.conv2d(x, w, **{argument: given})
        got = gemmconv.conv2d(x, w, **{argument: given})
        assert got.shape == expected.shape, (argument, expected_value)
        torch.testing.assert_close(got, expected, **FP32_GEMM_TOLERANCE)


def test_a_changed_tensor_groups_is_read_again():
    """groups = 2 fits these operands and groups = 1 does not: once changed, the call
    must be refused as torch refuses it, not computed with the old value."""
    x, w = torch.randn(2, 4, 6, 6), torch.randn(4, 2, 2, 2)
    groups = torch.tensor(2)
    torch.testing.assert_close(
        gemmconv.conv2d(x, w, groups=groups), F.conv2d(x, w, groups=groups), **FP32_GEMM_TOLERANCE
    )
    groups.fill_(1)
    with pytest.raises(Exception) as by_torch:
        F.conv2d(x, w, groups=groups)
    with pytest.raises(by_torch.type):
        gemmconv.conv2d(x, w, groups=groups)


def test_a_module_whose_stride_holds_tensors_reads_them_every_call():
    torch.manual_seed(0)
    reference = torch.nn.Conv2d(4, 8, 2, stride=2)
    module = gemmconv.nn.Conv2d(4, 8, 2, stride=2)
    module.load_state_dict(reference.state_dict())
    stride = torch.tensor(2)
    for m in (reference, module):
        m.stride = (stride, stride)
    x = torch.randn(2, 4, 8, 8)
    for value in (2, 1, 4):
        stride.fill_(value)
        expected, got = reference(x), module(x)
        assert got.shape == expected.shape, value
        torch.testing.assert_close(got, expected, **FP32_GEMM_TOLERANCE)
