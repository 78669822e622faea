"""Layouts: which memory order a convolution is computed in, and tensors in that order.

A tensor of logical shape [N, C, S1..Sd] is "channels-first" when it is contiguous
in that order and "channels-last" when its memory order is [N, S1..Sd, C]. PyTorch
has memory formats for 4-D and 5-D tensors only; a 3-D tensor is channels-last here
when its transpose(1, 2) is contiguous, so 1-D convolutions keep their layout too.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

import torch
from torch._prims_common import suggest_memory_format


class Layout(str, enum.Enum):
    CHANNELS_FIRST = "channels_first"
    CHANNELS_LAST = "channels_last"


def _is_channels_last(t: torch.Tensor) -> bool:
    if t.dim() in (4, 5):
        return suggest_memory_format(t) in (torch.channels_last, torch.channels_last_3d)
    if t.dim() == 3:
        return t.shape[1] > 1 and not t.is_contiguous() and t.transpose(1, 2).is_contiguous()
    return False


# The layouts are functions of shapes and strides alone, and torch's
# suggest_memory_format costs tens of microseconds of Python per call; eager calls
# repeat the same few shape/stride pairs, so the answers are remembered (boundedly).
_LAYOUTS_MAX = 4096
_layouts: dict[tuple, Layout] = {}


def _remembered(key: tuple, compute: Callable[[], Layout]) -> Layout:
    try:
        return _layouts[key]
    except KeyError:
        pass
    except TypeError:  # symbolic sizes (tracing) are not hashable: nothing to remember
        return compute()
    layout = compute()
    if len(_layouts) >= _LAYOUTS_MAX:
        _layouts.clear()
    _layouts[key] = layout
    return layout


def layout_of(input: torch.Tensor, weight: torch.Tensor) -> Layout:
    """The layout a convolution of these tensors is computed in.

    For 2-D and 3-D convolutions this is the layout of the output F.conv* would
    return: channels-last when the input or the weight is channels-last. A 1-D
    convolution follows its input (its output is always contiguous).
    """
    key = (input.shape, input.stride(), weight.shape, weight.stride())
    return _remembered(key, lambda: _layout_of(input, weight))


def input_layout_of(input: torch.Tensor) -> Layout:
    """The layout the input's own memory is in, whatever the weight's: the order in
    which a solver that gathers patches of x reads it."""
    return _remembered((input.shape, input.stride()), lambda: _memory_layout(input))


def _memory_layout(t: torch.Tensor) -> Layout:
    return Layout.CHANNELS_LAST if _is_channels_last(t) else Layout.CHANNELS_FIRST


def _layout_of(input: torch.Tensor, weight: torch.Tensor) -> Layout:
    if input.dim() == 3:
        return _memory_layout(input)
    if _is_channels_last(input) or _is_channels_last(weight):
        return Layout.CHANNELS_LAST
    return Layout.CHANNELS_FIRST


def output_layout(layout: Layout, dims: int, dtype: torch.dtype, device_type: str) -> Layout:
    """The layout F.conv* gives its output (and autograd its gradients) for a problem layout.

    torch's backends differ: 1-D outputs are always contiguous; cuDNN and the CPU's
    oneDNN path keep channels-last, but cuDNN never computes fp64 channels-last and
    the CPU's 3-D fp16/fp64 kernels only produce contiguous outputs.
    """
    if dims == 1:
        return Layout.CHANNELS_FIRST
    if dtype == torch.float64 and device_type == "cuda":
        return Layout.CHANNELS_FIRST
    if dims == 3 and device_type == "cpu" and dtype in (torch.float16, torch.float64):
        return Layout.CHANNELS_FIRST
    return layout


def to_layout(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    """``t`` dense in ``layout``; returns ``t`` itself when it already is."""
    if layout is Layout.CHANNELS_FIRST:
        return t.contiguous()
    if t.movedim(1, -1).is_contiguous():
        return t
    return t.movedim(1, -1).contiguous().movedim(-1, 1)


def is_dense_in(t: torch.Tensor, layout: Layout) -> bool:
    if layout is Layout.CHANNELS_FIRST:
        return t.is_contiguous()
    return t.movedim(1, -1).is_contiguous()


def empty_in(
    shape: Sequence[int], layout: Layout, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """An uninitialised tensor of logical ``shape`` laid out in ``layout``."""
    if layout is Layout.CHANNELS_FIRST:
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    n, c, *spatial = shape
    return torch.empty((n, *spatial, c), dtype=dtype, device=device).movedim(-1, 1)


def channels_last_view(t: torch.Tensor) -> torch.Tensor:
    """[N, C, S..] -> [N, S.., C] as a view (dense when ``t`` is channels-last)."""
    return t.movedim(1, -1)
