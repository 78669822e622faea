"""Argument checks for the functional API, run before any kernel.

Each error is of the type torch raises for the same mistake (RuntimeError for shapes,
dtypes and devices; ValueError for padding strings) and names the argument, the
value it got and what was expected.
"""

from __future__ import annotations

import torch


def _tuple_arg(name: str, value, dims: int, fn: str) -> tuple[int, ...] | None:
    if isinstance(value, str):
        return None
    if isinstance(value, int):
        return (value,) * dims
    values = tuple(value)
    if len(values) not in (1, dims):
        raise RuntimeError(
            f"{fn}: expected {name} to be a single integer value or a list of {dims} "
            f"values to match the convolution dimensions, but got {name}={list(values)}"
        )
    return values * dims if len(values) == 1 else values


def check_conv_args(dims, input, weight, bias, stride, padding, dilation, groups) -> None:
    fn = f"conv{dims}d"
    if not isinstance(input, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"{fn}: input and weight must be tensors")
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
    if not isinstance(groups, int) or groups < 1:
        raise RuntimeError(f"{fn}: groups={groups!r}; expected a positive integer")
    strides = _tuple_arg("stride", stride, dims, fn)
    pads = _tuple_arg("padding", padding, dims, fn)
    dilations = _tuple_arg("dilation", dilation, dims, fn)
    if any(u <= 0 for u in strides):
        raise RuntimeError(f"{fn}: stride={strides}; expected every value > 0")
    if any(d <= 0 for d in dilations):
        raise RuntimeError(f"{fn}: dilation={dilations}; expected every value > 0")
    if pads is not None and any(p < 0 for p in pads):
        raise RuntimeError(f"{fn}: padding={pads}; expected every value >= 0")
    channels = input.shape[-dims - 1]
    k = weight.shape[0]
    if k % groups != 0:
        raise RuntimeError(
            f"{fn}: weight out_channels={k} is not divisible by groups={groups}"
        )
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
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if t.dtype != input.dtype and not torch.is_autocast_enabled(input.device.type):
            raise RuntimeError(
                f"{fn}: {name} dtype {t.dtype} differs from input dtype {input.dtype}; "
                "expected the same dtype"
            )
        if t.device != input.device:
            raise RuntimeError(
                f"{fn}: {name} is on {t.device} but input is on {input.device}; expected "
                "the same device"
            )
    if pads is not None:
        for i, (s, r, p, d) in enumerate(
            zip(input.shape[-dims:], weight.shape[2:], pads, dilations)
        ):
            if s + 2 * p < d * (r - 1) + 1:
                raise RuntimeError(
                    f"{fn}: kernel size {tuple(weight.shape[2:])} (dilation {dilations}) is "
                    f"larger than the padded input {tuple(input.shape[-dims:])} + 2*{pads} "
                    f"in spatial dimension {i}"
                )
