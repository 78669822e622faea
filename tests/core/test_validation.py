"""Bad arguments: gemmconv refuses them before any kernel runs, with torch's exception type
and a message that names the argument, its value and what was expected.

Every case calls torch.nn.functional.conv{d}d with the same bad arguments first and
asserts gemmconv raises the type torch raised, so a change in torch shows here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import gemmconv
import gemmconv.roads.ops
from gemmconv.solvers.base import Solver

DIMS = (1, 2, 3)
TORCH_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
GEMMCONV_CONV = {1: gemmconv.conv1d, 2: gemmconv.conv2d, 3: gemmconv.conv3d}


def x_of(d: int, n: int = 2, c: int = 4, s: int = 6, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(n, c, *([s] * d), dtype=dtype)


def w_of(d: int, k: int = 6, cg: int = 4, r: int = 3, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(k, cg, *([r] * d), dtype=dtype)


@dataclasses.dataclass(frozen=True)
class BadCall:
    """One mistake: ``args(d)`` builds the call's arguments for a d-D convolution;
    ``says(d)`` lists what the message must contain (argument name, value, expectation)."""

    label: str
    args: Callable[[int], dict]
    says: Callable[[int], list[str]]


def _same(d: int, **kw) -> dict:
    return {"input": x_of(d), "weight": w_of(d), **kw}


BAD_CALLS = [
    BadCall(
        "input_too_few_dims",
        lambda d: {"input": torch.randn(*([6] * d)), "weight": w_of(d)},
        lambda d: ["input", f"{d} dims", f"expected {d + 1} (unbatched) or {d + 2}"],
    ),
    BadCall(
        "input_too_many_dims",
        lambda d: {"input": torch.randn(2, 2, 4, *([6] * d)), "weight": w_of(d)},
        lambda d: ["input", f"{d + 3} dims", f"expected {d + 1} (unbatched) or {d + 2}"],
    ),
    BadCall(
        "weight_wrong_dims",
        lambda d: {"input": x_of(d), "weight": torch.randn(6, 4, *([3] * (d + 1)))},
        lambda d: ["weight", f"{d + 3} dims", f"expected {d + 2}"],
    ),
    BadCall(
        "channel_mismatch",
        lambda d: {"input": x_of(d, c=4), "weight": w_of(d, cg=3)},
        lambda d: ["input", "4 channels", "groups=1 expects 3"],
    ),
    BadCall(
        "unbatched_channel_mismatch",
        lambda d: {"input": torch.randn(3, *([6] * d)), "weight": w_of(d, cg=4)},
        lambda d: ["input", "3 channels", "expects 4"],
    ),
    BadCall(
        "groups_not_dividing_input_channels",
        lambda d: {"input": x_of(d, c=5), "weight": w_of(d, cg=2), "groups": 2},
        lambda d: ["input channels=5", "groups=2"],
    ),
    BadCall(
        "groups_not_dividing_output_channels",
        lambda d: {"input": x_of(d, c=4), "weight": w_of(d, k=5, cg=2), "groups": 2},
        lambda d: ["out_channels=5", "groups=2"],
    ),
    BadCall("groups_zero", lambda d: _same(d, groups=0), lambda d: ["groups=0", "positive"]),
    BadCall("groups_negative", lambda d: _same(d, groups=-2), lambda d: ["groups=-2", "positive"]),
    BadCall(
        "kernel_larger_than_input",
        lambda d: {"input": x_of(d, s=2), "weight": w_of(d, r=3)},
        lambda d: ["kernel size", "input size 2", "padding 0", "expected at least 3"],
    ),
    BadCall(
        "kernel_larger_than_input_valid",
        lambda d: {"input": x_of(d, s=2), "weight": w_of(d, r=3), "padding": "valid"},
        lambda d: ["kernel size", "input size 2", "expected at least 3"],
    ),
    BadCall(
        "dilated_kernel_larger_than_padded_input",
        lambda d: {"input": x_of(d, s=4), "weight": w_of(d, r=3), "padding": 1, "dilation": 3},
        lambda d: ["kernel size", "dilation", "input size 4", "padding 1", "expected at least 7"],
    ),
    BadCall("stride_zero", lambda d: _same(d, stride=0), lambda d: [f"stride={(0,) * d}", "> 0"]),
    BadCall(
        "stride_negative_in_one_dim",
        lambda d: _same(d, stride=(1,) * (d - 1) + (-1,)),
        lambda d: [f"stride={(1,) * (d - 1) + (-1,)}", "> 0"],
    ),
    BadCall(
        "dilation_zero", lambda d: _same(d, dilation=0), lambda d: [f"dilation={(0,) * d}", "> 0"]
    ),
    BadCall(
        "dilation_negative",
        lambda d: _same(d, dilation=-1),
        lambda d: [f"dilation={(-1,) * d}", "> 0"],
    ),
    BadCall(
        "padding_negative",
        lambda d: _same(d, padding=(-1,) + (0,) * (d - 1)),
        lambda d: [f"padding={(-1,) + (0,) * (d - 1)}", ">= 0"],
    ),
    BadCall(
        "stride_wrong_length",
        lambda d: _same(d, stride=(1,) * (d + 1)),
        lambda d: ["stride", str([1] * (d + 1)), f"list of {d} values"],
    ),
    BadCall(
        "padding_wrong_length",
        lambda d: _same(d, padding=(1,) * (d + 1)),
        lambda d: ["padding", str([1] * (d + 1)), f"list of {d} values"],
    ),
    BadCall(
        "weight_dtype_mismatch",
        lambda d: {"input": x_of(d), "weight": w_of(d, dtype=torch.float64)},
        lambda d: ["weight dtype torch.float64", "input dtype torch.float32", "same dtype"],
    ),
    BadCall(
        "bias_dtype_mismatch",
        lambda d: _same(d, bias=torch.randn(6, dtype=torch.float64)),
        lambda d: ["bias dtype torch.float64", "input dtype torch.float32", "same dtype"],
    ),
    BadCall(
        "bias_wrong_size",
        lambda d: _same(d, bias=torch.randn(5)),
        lambda d: ["bias of shape (5,)", "expected (6,)"],
    ),
    BadCall(
        "bias_two_dims",
        lambda d: _same(d, bias=torch.randn(6, 1)),
        lambda d: ["bias of shape (6, 1)", "expected (6,)"],
    ),
    BadCall(
        "same_padding_with_stride",
        lambda d: _same(d, padding="same", stride=(1,) * (d - 1) + (2,)),
        lambda d: ["padding='same'", f"stride={(1,) * (d - 1) + (2,)}", "expected stride 1"],
    ),
    BadCall(
        "invalid_padding_string",
        lambda d: _same(d, padding="full"),
        lambda d: ["padding='full'", "'valid', 'same'"],
    ),
    BadCall(
        "padding_string_wrong_case",
        lambda d: _same(d, padding="SAME"),
        lambda d: ["padding='SAME'", "'valid', 'same'"],
    ),
    BadCall(
        "zero_output_channels",
        lambda d: {"input": x_of(d), "weight": w_of(d, k=0)},
        lambda d: ["out_channels=0", "at least 1"],
    ),
    BadCall(
        "empty_spatial_input",
        lambda d: {"input": x_of(d, s=0), "weight": w_of(d, r=1)},
        lambda d: ["input of shape", "empty spatial size", ">= 1"],
    ),
    BadCall(
        "empty_spatial_input_padded",
        lambda d: {"input": x_of(d, s=0), "weight": w_of(d, r=3), "padding": 2},
        lambda d: ["input of shape", "empty spatial size", ">= 1"],
    ),
    BadCall(
        "stride_float",
        lambda d: _same(d, stride=1.5),
        lambda d: ["stride=1.5", "float", "expected an integer"],
    ),
    BadCall(
        "groups_float",
        lambda d: _same(d, groups=1.0),
        lambda d: ["groups=1.0", "float", "expected an integer"],
    ),
    BadCall(
        "groups_bool", lambda d: _same(d, groups=True), lambda d: ["groups=True", "an integer"]
    ),
    BadCall(
        "bias_not_a_tensor",
        lambda d: _same(d, bias=3),
        lambda d: ["bias is a int", "torch.Tensor or None"],
    ),
    BadCall(
        "input_not_a_tensor",
        lambda d: {"input": [[1.0]], "weight": w_of(d)},
        lambda d: ["input is a list", "torch.Tensor"],
    ),
    BadCall(
        "bool_operands",
        lambda d: {"input": x_of(d).bool(), "weight": w_of(d).bool()},
        lambda d: ["input dtype torch.bool", "expected one of float16"],
    ),
    BadCall(
        "bool_input_float_weight",
        lambda d: {"input": x_of(d).bool(), "weight": w_of(d)},
        lambda d: ["input dtype torch.bool", "expected one of float16"],
    ),
    BadCall(
        "bool_operands_float_bias",
        lambda d: {"input": x_of(d).bool(), "weight": w_of(d).bool(), "bias": torch.randn(6)},
        lambda d: ["bias dtype torch.float32", "input dtype torch.bool", "same dtype"],
    ),
    BadCall(
        "stride_past_64_bits",
        lambda d: _same(d, stride=2**63),
        lambda d: [f"stride={2**63}", "64 bits", "[-2**63, 2**63 - 1]"],
    ),
    BadCall(
        "padding_past_64_bits_negative",
        lambda d: _same(d, padding=-(2**63) - 1),
        lambda d: [f"padding={-(2**63) - 1}", "64 bits"],
    ),
    BadCall(
        "stride_past_64_bits_in_a_tuple",
        lambda d: _same(d, stride=(1,) * (d - 1) + (2**63,)),
        lambda d: [f"stride={2**63}", "64 bits"],
    ),
    BadCall(
        "groups_past_64_bits",
        lambda d: _same(d, groups=2**64),
        lambda d: [f"groups={2**64}", "64 bits"],
    ),
    BadCall(
        "sparse_input",
        lambda d: {"input": x_of(d).to_sparse(), "weight": w_of(d)},
        lambda d: ["input has layout torch.sparse_coo", "expected a dense tensor"],
    ),
    BadCall(
        "sparse_weight",
        lambda d: {"input": x_of(d), "weight": w_of(d).to_sparse()},
        lambda d: ["weight has layout torch.sparse_coo", "expected a dense tensor"],
    ),
    BadCall(
        "sparse_bias",
        lambda d: _same(d, bias=torch.randn(6).to_sparse()),
        lambda d: ["bias has layout torch.sparse_coo", "expected a dense tensor"],
    ),
]


@pytest.fixture
def no_kernel_runs(monkeypatch):
    """Fail the test if any solver runs: the checks must come before all work."""

    def refuse(self, problem, tensors, out=None):
        raise AssertionError(f"solver {self.id} ran for {problem.key()} before validation")

    def refuse_plan(plan, tensors):
        refuse(plan.solver, plan.problem, tensors)

    monkeypatch.setattr(Solver, "run", refuse)
    # Calls run their plans' prepared runs, which need not go through Solver.run.
    monkeypatch.setattr(gemmconv.roads.ops, "_run", refuse_plan)


def _torch_error_type(d: int, kwargs: dict) -> type[BaseException]:
    with pytest.raises(Exception) as caught:
        TORCH_CONV[d](**kwargs)
    return caught.type


@pytest.mark.parametrize("autocast", [False, True], ids=["plain", "autocast"])
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("case", BAD_CALLS, ids=lambda c: c.label)
def test_bad_call_raises_torch_type_before_any_kernel(
    case: BadCall, d: int, autocast: bool, no_kernel_runs
):
    """Also under autocast, where the operands are cast first and checked after, as
    torch's autocast casts before its convolution checks."""
    torch.manual_seed(0)
    kwargs = case.args(d)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        expected_type = _torch_error_type(d, kwargs)
        with pytest.raises(Exception) as caught:
            GEMMCONV_CONV[d](**kwargs)
    assert caught.type is expected_type, (
        f"torch raises {expected_type.__name__}, gemmconv {caught.type.__name__}: {caught.value}"
    )
    message = str(caught.value)
    assert message.startswith(f"conv{d}d: "), message
    if autocast and case.label in _DTYPE_CALLS:
        return  # the cast changed the dtypes the message names: the next test's subject
    for part in case.says(d):
        assert part in message, f"{part!r} missing from {message!r}"


_DTYPE_CALLS = {"weight_dtype_mismatch", "bias_dtype_mismatch", "bool_operands_float_bias"}


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize(
    ("input_dtype", "weight_dtype"),
    [(torch.int64, torch.float32), (torch.float64, torch.float32), (torch.float32, torch.float64)],
)
def test_a_dtype_autocast_leaves_alone_is_refused_after_the_cast(
    d: int, input_dtype: torch.dtype, weight_dtype: torch.dtype, no_kernel_runs
):
    """Autocast casts float32 operands and leaves float64 and integer ones: where the
    dtypes still differ after that, torch refuses the call, and gemmconv names both
    dtypes as they are after the cast."""
    x, w = x_of(d).to(input_dtype), w_of(d).to(weight_dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected_type = _torch_error_type(d, {"input": x, "weight": w})
        with pytest.raises(Exception) as caught:
            GEMMCONV_CONV[d](x, w)
    assert caught.type is expected_type
    cast = {t: torch.bfloat16 if t == torch.float32 else t for t in (input_dtype, weight_dtype)}
    message = str(caught.value)
    assert f"weight dtype {cast[weight_dtype]}" in message, message
    assert f"input dtype {cast[input_dtype]}" in message, message


# explain() infers the dimensionality from the weight, so a weight of the wrong rank
# is a different (valid or invalid) call there.
EXPLAINABLE = [c for c in BAD_CALLS if c.label != "weight_wrong_dims"]


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("case", EXPLAINABLE, ids=lambda c: c.label)
def test_explain_refuses_the_same_calls(case: BadCall, d: int, no_kernel_runs):
    kwargs = case.args(d)
    expected_type = _torch_error_type(d, kwargs)
    with pytest.raises(expected_type):
        gemmconv.explain(**kwargs)


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("on_meta", [("weight",), ("bias",), ("weight", "bias"), ("input",)])
def test_a_meta_operand_gives_torchs_result_on_the_inputs_device(d: int, on_meta: tuple):
    """torch runs a convolution with a meta operand on its meta kernel: the result has
    the right shape and strides, on the input's device, and no values (meta data)."""
    tensors = {"input": x_of(d), "weight": w_of(d), "bias": torch.randn(6)}
    tensors = {name: t.to("meta") if name in on_meta else t for name, t in tensors.items()}
    expected = TORCH_CONV[d](**tensors, stride=2)
    got = GEMMCONV_CONV[d](**tensors, stride=2)
    assert got.device == expected.device == tensors["input"].device
    assert (got.shape, got.stride(), got.dtype) == (
        expected.shape,
        expected.stride(),
        expected.dtype,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("which", ["input", "weight", "bias"])
def test_device_mismatch_matches_torch_on_cuda(d: int, which: str, no_kernel_runs):
    tensors = {"input": x_of(d), "weight": w_of(d), "bias": torch.randn(6)}
    tensors = {name: t.cuda() if name != which else t for name, t in tensors.items()}
    expected_type = _torch_error_type(d, tensors)
    with pytest.raises(expected_type) as caught:
        GEMMCONV_CONV[d](**tensors)
    assert "cpu" in str(caught.value) and "cuda" in str(caught.value)


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("n", [0, 2])
def test_zero_size_kernel_is_refused_by_name(d: int, n: int, no_kernel_runs):
    """torch has no argument check for a zero-size kernel: the backend fails (oneDNN
    with a RuntimeError; an empty batch has given an IndexError). gemmconv refuses it
    up front with a RuntimeError that says what is wrong."""
    x, w = x_of(d, n=n), torch.randn(6, 4, *([3] * (d - 1)), 0)
    with pytest.raises(RuntimeError, match=r"kernel size .*expected every kernel size >= 1"):
        GEMMCONV_CONV[d](x, w)


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64])
def test_a_dtype_gemmconv_does_not_compute_goes_to_torch(
    d: int, dtype: torch.dtype, no_kernel_runs
):
    """torch's CPU convolution computes integer and complex tensors; gemmconv hands
    such a call to it whole (no solver of its own runs) and returns torch's result."""
    x, w = x_of(d).to(dtype), w_of(d).to(dtype)
    torch.testing.assert_close(GEMMCONV_CONV[d](x, w), TORCH_CONV[d](x, w), rtol=0, atol=0)


# ---- calls torch accepts are accepted, and give torch's result ------------------


def _accepted_calls(d: int) -> dict[str, dict]:
    return {
        "unbatched": {"input": torch.randn(4, *([6] * d)), "weight": w_of(d)},
        "stride_one_element_tuple": _same(d, stride=(2,)),
        "stride_list": _same(d, stride=[2] * d),
        "padding_valid": _same(d, padding="valid"),
        "padding_same_even_kernel": {"input": x_of(d), "weight": w_of(d, r=2), "padding": "same"},
        "padding_same_dilated": _same(d, padding="same", dilation=2),
        "padding_same_unit_stride_tuple": _same(d, padding="same", stride=(1,) * d),
        "kernel_equal_to_padded_input": {
            "input": x_of(d, s=1),
            "weight": w_of(d, r=3),
            "padding": 1,
        },
        "zero_batch": {"input": x_of(d, n=0), "weight": w_of(d)},
        "zero_batch_empty_spatial_padded": {
            "input": x_of(d, n=0, s=0),
            "weight": w_of(d),
            "padding": 2,
        },
        "groups_numpy_style_index": _same(d, groups=torch.tensor(1)),
        "groups_numpy_int": _same(d, groups=np.int64(1)),
        "stride_numpy_int": _same(d, stride=np.int64(2)),
        "dilation_numpy_int": _same(d, dilation=np.int32(2)),
        "padding_zero_dim_tensor": _same(d, padding=torch.tensor(1)),
        "stride_tuple_of_indexables": _same(d, stride=(np.int64(2), *[torch.tensor(1)] * (d - 1))),
        "stride_largest_64_bit": _same(d, stride=2**63 - 1),
    }


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("label", list(_accepted_calls(1)))
def test_valid_edge_calls_match_torch(d: int, label: str):
    torch.manual_seed(1)
    kwargs = _accepted_calls(d)[label]
    expected = TORCH_CONV[d](**kwargs)
    got = GEMMCONV_CONV[d](**kwargs)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("which", ["input", "weight", "bias"])
@pytest.mark.parametrize("torch_raises", [NotImplementedError, RuntimeError, TypeError])
def test_a_sparse_operand_is_refused_with_whatever_type_torch_raises(
    d: int, which: str, torch_raises: type, monkeypatch, no_kernel_runs
):
    """torch's exception type for a sparse operand differs between versions and builds
    (RuntimeError from torch 2.13's CPU wheel, NotImplementedError from some 2.14
    builds): gemmconv asks torch at run time, so a torch raising any type is followed,
    by the convolution and by explain()."""
    real = getattr(F, f"conv{d}d")

    def torch_conv(input, weight, bias=None, *args, **kwargs):
        if any(t is not None and t.layout != torch.strided for t in (input, weight, bias)):
            raise torch_raises("sparse operands are not supported")
        return real(input, weight, bias, *args, **kwargs)

    monkeypatch.setattr(F, f"conv{d}d", torch_conv)
    tensors = {"input": x_of(d), "weight": w_of(d), "bias": torch.randn(6)}
    tensors[which] = tensors[which].to_sparse()
    for stride in (1, [1] * d):  # the eager road and the op road
        with pytest.raises(torch_raises, match=rf"conv{d}d: {which} has layout torch.sparse_coo"):
            GEMMCONV_CONV[d](**tensors, stride=stride)
    with pytest.raises(torch_raises, match=f"{which} has layout torch.sparse_coo"):
        gemmconv.explain(**tensors)
