"""Argument checks for the functional API, run before any kernel.

Each error is of the type torch.nn.functional.conv* raises for the same mistake
(TypeError for an argument of the wrong kind, ValueError for an integer past 64 bits,
NotImplementedError for a bool input, RuntimeError for every other bad value: shapes,
dtypes, devices, layouts, padding strings) and names the argument, the value it got
and what was expected. The checks run in the order torch runs its own, so an input
with several mistakes reports the one torch would: check_argument_kinds, then
check_against_tensors.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

PADDING_STRINGS = ("valid", "same")

# The dtypes gemmconv computes in. A call in any other dtype (torch's CPU convolution
# also takes integer and complex tensors), or with an operand that is not a dense
# tensor (mkldnn), is handed to torch's convolution whole (handed_to_torch).
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_DTYPE_NAMES = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class ConvArgs(NamedTuple):
    """The non-tensor arguments as plain ints, one per spatial dimension; ``padding``
    is None for 'same' (resolved from the kernel later)."""

    stride: tuple[int, ...]
    padding: tuple[int, ...] | None
    dilation: tuple[int, ...]
    groups: int


def _as_int(fn: str, name: str, value: Any, overflow: type[Exception] = ValueError) -> int:
    """``value`` as a Python int. Anything with ``__index__`` is taken, as torch takes
    it (numpy integers, 0-d integer tensors); bools and floats are refused, and so is
    an integer past 64 bits, with ``overflow`` (torch raises ValueError for a single
    integer and TypeError for one inside a sequence)."""
    if isinstance(value, bool):
        raise TypeError(f"{fn}: {name}={value!r} is a bool; expected an integer")
    # A value without __index__ is refused before operator.index sees it: under
    # torch.compile, torch 2.11's dynamo raises operator.index's TypeError as its own
    # InternalTorchDynamoError, which no except clause here catches.
    if not isinstance(value, int) and not hasattr(value, "__index__"):
        raise _not_an_integer(fn, name, value)
    try:
        result = operator.index(value)
    except TypeError:
        raise _not_an_integer(fn, name, value) from None
    if not INT64_MIN <= result <= INT64_MAX:
        raise overflow(
            f"{fn}: {name}={result} does not fit in 64 bits; expected an integer in "
            f"[-2**63, 2**63 - 1]"
        )
    return result


def _not_an_integer(fn: str, name: str, value: Any) -> TypeError:
    return TypeError(f"{fn}: {name}={value!r} of type {type(value).__name__}; expected an integer")


def _int_tuple(fn: str, name: str, value: Any, dims: int) -> tuple[int, ...]:
    """An int or a sequence of 1 or ``dims`` ints, as ``dims`` ints."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        values = tuple(_as_int(fn, name, v, overflow=TypeError) for v in value)
        if len(values) not in (1, dims):
            raise RuntimeError(
                f"{fn}: expected {name} to be a single integer value or a list of {dims} "
                f"values to match the convolution dimensions, but got {name}={list(values)}"
            )
        return values * dims if len(values) == 1 else values
    return (_as_int(fn, name, value),) * dims


def _padding(fn: str, padding: Any, strides: tuple[int, ...], dims: int) -> tuple[int, ...] | None:
    """Integer padding per dimension, (0,..) for 'valid', None for 'same' (resolved later,
    from the kernel)."""
    if not isinstance(padding, str):
        pads = _int_tuple(fn, "padding", padding, dims)
        if any(p < 0 for p in pads):
            raise RuntimeError(f"{fn}: padding={pads}; expected every value >= 0")
        return pads
    if padding not in PADDING_STRINGS:
        raise RuntimeError(
            f"{fn}: padding={padding!r}; expected an int, a tuple of ints, or one of "
            f"{', '.join(repr(s) for s in PADDING_STRINGS)}"
        )
    if padding == "valid":
        return (0,) * dims
    if any(u != 1 for u in strides):
        raise RuntimeError(
            f"{fn}: padding='same' with stride={strides}; padding='same' is not supported "
            "for strided convolutions, expected stride 1 in every dimension"
        )
    return None


def check_argument_kinds(
    dims: int,
    input: Any,
    weight: Any,
    bias: Any,
    stride: Any,
    padding: Any,
    dilation: Any,
    groups: Any,
) -> ConvArgs:
    """The first half of a call's check, as F.conv{dims}d would refuse it: the
    operands are tensors and the other arguments are integers of the right count (or
    a padding string), returned as plain ints. It reads nothing of the tensors but
    their type, so a dynamo trace of it guards on little (gemmconv.functional traces
    this half and leaves the other to the op's fake implementation)."""
    fn = f"conv{dims}d"
    for name, t in (("input", input), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} is a {type(t).__name__}; expected a torch.Tensor")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"{fn}: bias is a {type(bias).__name__}; expected a torch.Tensor or None")
    groups = _as_int(fn, "groups", groups)
    strides = _int_tuple(fn, "stride", stride, dims)
    dilations = _int_tuple(fn, "dilation", dilation, dims)
    pads = _padding(fn, padding, strides, dims)
    return ConvArgs(strides, pads, dilations, groups)


def check_against_tensors(
    dims: int, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, args: ConvArgs
) -> None:
    """The second half (after check_argument_kinds): the tensors' layouts, ranks,
    dtypes, devices and shapes, and the arguments' values against them, and the
    dtypes and layouts gemmconv does not compute in."""
    if torch.jit.is_tracing():
        _with_trace_paused(_check_against_tensors, dims, input, weight, bias, args)
    else:
        _check_against_tensors(dims, input, weight, bias, args)


def _with_trace_paused(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` with jit tracing (torch.jit.trace, the TorchScript ONNX exporter)
    paused. Tracing hands out sizes as tensors, and each Python comparison of one warns
    (TracerWarning) though a check records nothing: paused, the sizes are plain ints,
    as the op's own implementation sees them. The state is per thread, so no other
    trace is touched."""
    state = torch._C._get_tracing_state()
    torch._C._set_tracing_state(None)
    try:
        return fn(*args)
    finally:
        torch._C._set_tracing_state(state)


def _check_against_tensors(
    dims: int, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, args: ConvArgs
) -> None:
    fn = f"conv{dims}d"
    strides, pads, dilations, groups = args
    for name, t in (("input", input), ("weight", weight), ("bias", bias)):
        if t is not None and t.layout != torch.strided:
            kind = torch_refusal_type(dims, input, weight, bias, args)
            raise kind(
                f"{fn}: {name} has layout {t.layout}; expected a dense tensor (torch.strided)"
            )

    if input.dim() not in (dims + 1, dims + 2):
        raise RuntimeError(
            f"{fn}: input of shape {tuple(input.shape)} has {input.dim()} dims; expected "
            f"{dims + 1} (unbatched) or {dims + 2} (batched)"
        )
    if weight.dim() != dims + 2:
        raise RuntimeError(
            f"{fn}: weight of shape {tuple(weight.shape)} has {weight.dim()} dims; "
            f"expected {dims + 2} ([out_channels, in_channels/groups, *kernel])"
        )
    if groups < 1:
        raise RuntimeError(f"{fn}: groups={groups}; expected a positive integer")
    if any(u <= 0 for u in strides):
        raise RuntimeError(f"{fn}: stride={strides}; expected every value > 0")
    # torch checks a zero dilation only where there is data: an empty input takes it.
    if any(d < 0 or (d == 0 and input.numel() > 0) for d in dilations):
        raise RuntimeError(f"{fn}: dilation={dilations}; expected every value > 0")

    _check_dtypes_and_devices(dims, input, weight, bias, args)

    batched = input.dim() == dims + 2
    n = input.shape[0] if batched else 1
    channels = input.shape[-dims - 1]
    spatial = tuple(input.shape[-dims:])
    k = weight.shape[0]
    kernel = tuple(weight.shape[2:])
    if k < 1:
        raise RuntimeError(
            f"{fn}: weight of shape {tuple(weight.shape)} has out_channels={k}; expected at least 1"
        )
    if any(r < 1 for r in kernel):
        raise RuntimeError(
            f"{fn}: weight of shape {tuple(weight.shape)} has kernel size {kernel}; "
            "expected every kernel size >= 1"
        )
    if k % groups != 0:
        raise RuntimeError(f"{fn}: weight out_channels={k} is not divisible by groups={groups}")
    if channels % groups != 0:
        raise RuntimeError(f"{fn}: input channels={channels} is not divisible by groups={groups}")
    if weight.shape[1] * groups != channels:
        raise RuntimeError(
            f"{fn}: input of shape {tuple(input.shape)} has {channels} channels; weight of "
            f"shape {tuple(weight.shape)} with groups={groups} expects "
            f"{weight.shape[1] * groups}"
        )
    if bias is not None and tuple(bias.shape) != (k,):
        raise RuntimeError(
            f"{fn}: bias of shape {tuple(bias.shape)}; expected ({k},) to match out_channels"
        )
    if n > 0 and channels > 0 and 0 in spatial:
        # torch computes empty batches and empty channel sets, never empty images.
        raise RuntimeError(
            f"{fn}: input of shape {tuple(input.shape)} has an empty spatial size {spatial}; "
            "expected every spatial size >= 1 (only the batch or channel size may be 0)"
        )
    if pads is None:
        return  # 'same' pads d*(r-1) in total, so any non-empty input fits the kernel
    for i, (s, r, p, d) in enumerate(zip(spatial, kernel, pads, dilations, strict=True)):
        if s + 2 * p < d * (r - 1) + 1:
            raise RuntimeError(
                f"{fn}: kernel size {kernel} (dilation {dilations}) is larger than the "
                f"padded input: spatial dimension {i} has input size {s} and padding {p}, "
                f"so {s + 2 * p} positions; expected at least {d * (r - 1) + 1}"
            )


def _check_dtypes_and_devices(dims: int, input, weight, bias, args: ConvArgs) -> None:
    """In torch's order: the bias's dtype, a bool input (which no convolution kernel
    takes), the weight's dtype, then the dtypes gemmconv does not compute in (with
    the exception type torch raises for them)."""
    fn = f"conv{dims}d"
    if bias is not None and bias.dtype != input.dtype:
        _refuse_dtype_mismatch(fn, "bias", bias, input)
    if input.dtype == torch.bool:
        raise NotImplementedError(
            f"{fn}: input dtype torch.bool is not supported; expected one of {_DTYPE_NAMES}"
        )
    if weight.dtype != input.dtype:
        _refuse_dtype_mismatch(fn, "weight", weight, input)
    if input.dtype not in SUPPORTED_DTYPES:
        kind = torch_refusal_type(dims, input, weight, bias, args)
        raise kind(
            f"{fn}: input dtype {input.dtype} is not supported; expected one of {_DTYPE_NAMES}"
        )
    for name, t in (("weight", weight), ("bias", bias)):
        # torch runs a convolution with a meta operand on its meta kernel, which gives
        # an uninitialised result on the input's device; the custom op's fake
        # implementation does the same.
        if t is not None and t.device != input.device and not _either_is_meta(t, input):
            raise RuntimeError(
                f"{fn}: {name} is on {t.device} but input is on {input.device}; expected "
                "the same device"
            )


def _refuse_dtype_mismatch(fn: str, name: str, t: torch.Tensor, input: torch.Tensor) -> None:
    raise RuntimeError(
        f"{fn}: {name} dtype {t.dtype} differs from input dtype {input.dtype}; "
        "expected the same dtype"
    )


def _either_is_meta(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device.type == "meta" or b.device.type == "meta"


def handed_to_torch(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether gemmconv leaves the call to torch's convolution: an operand that is not
    a dense tensor (sparse, mkldnn), or operands of one dtype gemmconv does not compute
    in (integers, complex, float8, quantized). torch then computes it or refuses it, and
    whichever it does is the answer. Operands of differing dtypes and bool ones stay
    with gemmconv's checks, which name the mistake."""
    tensors = (input, weight) if bias is None else (input, weight, bias)
    if any(t.layout != torch.strided for t in tensors):
        return True
    dtype = input.dtype
    return (
        dtype not in SUPPORTED_DTYPES
        and dtype != torch.bool
        and all(t.dtype == dtype for t in tensors)
    )


def handed_to_torch_reason(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> str:
    """What makes handed_to_torch true, as an error message names it."""
    for name, t in (("input", input), ("weight", weight), ("bias", bias)):
        if t is not None and t.layout != torch.strided:
            return f"{name} has layout {t.layout}; expected a dense tensor (torch.strided)"
    return f"input dtype {input.dtype} is not supported; expected one of {_DTYPE_NAMES}"


_TORCH_CONVOLUTIONS = {1: "conv1d", 2: "conv2d", 3: "conv3d"}


def torch_refusal_type(
    dims: int,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    args: ConvArgs | None,
) -> type[Exception]:
    """The exception type torch's convolution raises for these operands, asked of
    torch by making the call (only for operands handed_to_torch, which torch refuses
    before computing anything or computes as the caller would have it do): the type
    differs between torch versions and builds (a sparse operand: RuntimeError from
    torch 2.13's CPU wheel, NotImplementedError from some 2.14 builds). RuntimeError
    where torch computes the call."""
    import torch.nn.functional as F

    convolution = getattr(F, _TORCH_CONVOLUTIONS.get(dims, "conv2d"))
    arguments = () if args is None or args.padding is None else args
    try:
        convolution(input, weight, bias, *arguments)
    except Exception as e:  # torch's own refusal: its type is the answer
        return type(e)
    return RuntimeError


IntOrTuple = int | Sequence[int]
Padding = IntOrTuple | str


class ResolvedArguments(NamedTuple):
    """F.conv* arguments as per-dimension integers; ``input_padding`` is the F.pad
    argument the input needs first ('same' with an odd total pads the far side by
    one, exactly as torch does), empty when it needs none."""

    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int
    input_padding: tuple[int, ...]


def resolve_arguments(
    dims: int,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: IntOrTuple,
    padding: Padding,
    dilation: IntOrTuple,
    groups: int,
) -> ResolvedArguments:
    """Check a call as F.conv{dims}d would (raising its errors) and resolve its arguments."""
    args = check_argument_kinds(dims, input, weight, bias, stride, padding, dilation, groups)
    check_against_tensors(dims, input, weight, bias, args)
    return _resolved(args, weight)


def _resolved(args: ConvArgs, weight: torch.Tensor) -> ResolvedArguments:
    """``args`` with 'same' padding resolved from the kernel."""
    if args.padding is not None:
        return ResolvedArguments(args.stride, args.padding, args.dilation, args.groups, ())
    if torch.jit.is_tracing():
        # The pads are the kernel's, fixed constants of the trace (see _with_trace_paused).
        return _with_trace_paused(_resolved, args, weight)
    totals = [d * (r - 1) for d, r in zip(args.dilation, weight.shape[2:])]
    extra = []
    for total in reversed(totals):
        extra += [0, total % 2]
    pads = tuple(total // 2 for total in totals)
    return ResolvedArguments(
        args.stride, pads, args.dilation, args.groups, tuple(extra) if any(extra) else ()
    )
