"""conv1d / conv2d / conv3d with the signatures and defaults of torch.nn.functional.

Argument checks, string padding, unbatched inputs and autocast are handled here, in
traceable Python; the convolution itself is the ``gemmconv::conv_forward`` custom op,
whose autograd formula (gemmconv.autograd) runs the two backward ops. While a
torch.func transform or a forward-AD level is active, the same op runs through
gemmconv.func_transforms, which has the rules those need.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

import gemmconv.autograd  # noqa: F401  (registers the forward op's backward)
from gemmconv import func_transforms
from gemmconv.dispatch import Choice, explain_problem
from gemmconv.problem import ConvProblem
from gemmconv.transform_state import transforms_active
from gemmconv.validate import ConvArgs, check_conv_args

IntOrTuple = int | Sequence[int]
Padding = IntOrTuple | str


def _resolve_padding(
    input: torch.Tensor, weight: torch.Tensor, args: ConvArgs
) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Integer padding per dimension; 'same' with an odd total pads the input's far
    side by one first, exactly as torch does."""
    if args.padding is not None:
        return input, args.padding
    totals = [d * (r - 1) for d, r in zip(args.dilation, weight.shape[2:])]
    extra = []
    for total in reversed(totals):
        extra += [0, total % 2]
    if any(extra):
        input = F.pad(input, extra)
    return input, tuple(total // 2 for total in totals)


# Devices whose is_autocast_enabled raises. A fixed set rather than asking
# torch.amp.is_autocast_available, which torch 2.11's dynamo cannot trace (fullgraph
# compiles of converted models broke on it).
_DEVICES_WITHOUT_AUTOCAST = frozenset({"meta"})


def _autocast(*tensors: torch.Tensor | None, device_type: str) -> list[torch.Tensor | None]:
    """Cast to the autocast dtype as torch's convolutions are, when autocast is on:
    autocast casts floating-point operands except float64 ones (torch's is_eligible)."""
    if device_type in _DEVICES_WITHOUT_AUTOCAST or not torch.is_autocast_enabled(device_type):
        return list(tensors)
    dtype = torch.get_autocast_dtype(device_type)
    return [
        t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t
        for t in tensors
    ]


def _conv(dims, input, weight, bias, stride, padding, dilation, groups) -> torch.Tensor:
    args = check_conv_args(dims, input, weight, bias, stride, padding, dilation, groups)
    input, weight, bias = _autocast(input, weight, bias, device_type=input.device.type)
    unbatched = input.dim() == dims + 1
    if unbatched:
        input = input.unsqueeze(0)
    input, pad = _resolve_padding(input, weight, args)
    convolve = (
        func_transforms.conv_forward if transforms_active() else torch.ops.gemmconv.conv_forward
    )
    y = convolve(
        input, weight, bias, list(args.stride), list(pad), list(args.dilation), args.groups
    )
    return y.squeeze(0) if unbatched else y


def conv1d(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: IntOrTuple = 1,
    padding: Padding = 0,
    dilation: IntOrTuple = 1,
    groups: int = 1,
) -> torch.Tensor:
    return _conv(1, input, weight, bias, stride, padding, dilation, groups)


def conv2d(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: IntOrTuple = 1,
    padding: Padding = 0,
    dilation: IntOrTuple = 1,
    groups: int = 1,
) -> torch.Tensor:
    return _conv(2, input, weight, bias, stride, padding, dilation, groups)


def conv3d(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: IntOrTuple = 1,
    padding: Padding = 0,
    dilation: IntOrTuple = 1,
    groups: int = 1,
) -> torch.Tensor:
    return _conv(3, input, weight, bias, stride, padding, dilation, groups)


def explain(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: IntOrTuple = 1,
    padding: Padding = 0,
    dilation: IntOrTuple = 1,
    groups: int = 1,
) -> dict[str, Choice]:
    """Which solver would run each direction, and why the others would not; runs nothing.

    Keys are "forward", "backward_data" and "backward_weights"; each value has
    ``.solver`` (an id) and ``.rejected`` (id -> list of reasons).
    """
    return explain_problem(problem_of(input, weight, bias, stride, padding, dilation, groups))


def problem_of(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: IntOrTuple = 1,
    padding: Padding = 0,
    dilation: IntOrTuple = 1,
    groups: int = 1,
) -> ConvProblem:
    """The forward ConvProblem the custom op would build for these F.conv* arguments."""
    dims = weight.dim() - 2
    args = check_conv_args(dims, input, weight, bias, stride, padding, dilation, groups)
    input, weight, bias = _autocast(input, weight, bias, device_type=input.device.type)
    if input.dim() == dims + 1:
        input = input.unsqueeze(0)
    input, pad = _resolve_padding(input, weight, args)
    return ConvProblem.from_tensors(
        input, weight, bias, args.stride, pad, args.dilation, args.groups
    )
