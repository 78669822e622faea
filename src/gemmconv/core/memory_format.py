"""Layouts: which memory order a convolution is computed in, and tensors in that order.

A tensor of logical shape [N, C, S1..Sd] is "channels-first" when it is contiguous
in that order and "channels-last" when its memory order is [N, S1..Sd, C]. PyTorch
has memory formats for 4-D and 5-D tensors only; a 3-D tensor is channels-last here
when its transpose(1, 2) is contiguous, so 1-D convolutions keep their layout too.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Sequence

import torch
from torch._prims_common import suggest_memory_format


class Layout(str, enum.Enum):
    """Memory order of a problem's tensors: channels-first (NCHW) or channels-last
    (NHWC, torch.channels_last)."""

    CHANNELS_FIRST = "channels_first"
    CHANNELS_LAST = "channels_last"


def _strides_like_channels_last(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """torch's Tensor.suggest_memory_format() rule for 4-D/5-D tensors of concrete sizes:
    the strides grow in the order C, W, H(, D), N."""
    order = {4: (1, 3, 2, 0), 5: (1, 4, 3, 2, 0)}.get(len(shape))
    if order is None or strides[1] == 0:
        return False
    smallest = 0
    for d in order:
        if shape[d] == 0 or strides[d] < smallest or (d == 0 and smallest == strides[1]):
            return False
        smallest = strides[d] * shape[d]
    return True


def _is_channels_last(t: torch.Tensor) -> bool:
    if t.dim() in (4, 5):
        shape, strides = t.shape, t.stride()
        if all(type(v) is int for v in (*shape, *strides)):
            # torch's own Python version imports sympy on first use (1.7 s on the CPU
            # machine, most of a first call's time); this is the same rule.
            return _strides_like_channels_last(shape, strides)
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
    """The layout F.conv* gives its output (and autograd its gradients) for a problem
    layout, by rule of thumb: the layout solvers write their results in, and the
    gradients' layout. A forward's result is given the layout forward_output_layout
    asks torch for, which differs in a few cases (a 1-D convolution with a
    channels-last strided weight, a small fp32 3-D convolution on the CPU's slow
    kernel); there the result is copied once into it.

    torch's backends differ: 1-D outputs are contiguous (but for that weight); cuDNN
    and the CPU's oneDNN path keep channels-last, but cuDNN never computes fp64
    channels-last, and a 3-D convolution that the CPU does not hand to oneDNN (fp64
    always, fp16 and bf16 where the processor lacks them) gives a contiguous output.
    """
    if dims == 1:
        return Layout.CHANNELS_FIRST
    if dtype == torch.float64 and device_type == "cuda":
        return Layout.CHANNELS_FIRST
    if dims == 3 and device_type == "cpu" and layout is Layout.CHANNELS_LAST:
        return _cpu_3d_output_layout(dtype, torch._C._get_mkldnn_enabled())
    return layout


@functools.cache
def _cpu_3d_output_layout(dtype: torch.dtype, onednn_enabled: bool) -> Layout:
    """The layout the CPU gives a channels-last 3-D convolution in ``dtype``, asked of
    torch's backend selection for a small one (batch 2, kernel 2: fp32's size rules
    send it to oneDNN, as most problems). oneDNN takes fp16 only on processors with
    AVX512-FP16 or AVX-NE-CONVERT (a Sapphire Rapids host, not an older one), bf16 on
    those with AVX512 or AVX-NE-CONVERT, never fp64, and none while
    torch.backends.mkldnn is disabled (``onednn_enabled``, part of the key)."""
    if _select_conv_backend is None or _backend_memory_format is None:
        # A torch without the question: its CPU's 3-D fp16/fp64 kernels are the slow ones.
        slow = dtype in (torch.float16, torch.float64)
        return Layout.CHANNELS_FIRST if slow else Layout.CHANNELS_LAST
    x = empty_in((2, 2, 2, 2, 2), Layout.CHANNELS_LAST, dtype, torch.device("cpu"))
    w = torch.empty((2, 2, 2, 2, 2), dtype=dtype)
    asked = _torch_output_layout(x, w, None, (1, 1, 1), (0, 0, 0), (1, 1, 1), 1)
    return Layout.CHANNELS_LAST if asked is None else asked


def forward_output_layout(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    output_shape: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> Layout:
    """The layout F.conv* gives the forward output of these operands and arguments.

    Where the sizes are known, torch is asked: the backend its convolution would
    select for these very tensors and the memory format that backend computes in
    (what torch's own fake tensors ask). That decides cases no rule of thumb here
    caught: a 1-D convolution whose weight is channels-last strided gives a
    channels-last output; a small fp32 3-D convolution that the CPU runs on its slow
    kernel gives a contiguous one. Elsewhere (symbolic sizes, other devices, a torch
    without the question) the rule of layout_of and output_layout stands."""
    if input.shape[0] == 0:
        return _empty_batch_output_layout(input, output_shape)
    asked = _torch_output_layout(input, weight, bias, stride, padding, dilation, groups)
    if asked is not None:
        return asked
    layout = layout_of(input, weight)
    return output_layout(layout, input.dim() - 2, input.dtype, input.device.type)


_select_conv_backend = getattr(torch._C, "_select_conv_backend", None)
_backend_memory_format = getattr(torch._C, "_conv_determine_backend_memory_format", None)
_ASKED_DEVICES = frozenset({"cpu", "cuda"})


def _torch_output_layout(input, weight, bias, stride, padding, dilation, groups) -> Layout | None:
    """The output layout torch's convolution gives, from its own backend selection;
    None where it cannot be asked."""
    if (
        _select_conv_backend is None
        or _backend_memory_format is None
        or input.device.type not in _ASKED_DEVICES
        or weight.device != input.device
        or (bias is not None and bias.device != input.device)
    ):
        return None
    if input.dim() == 3:
        # torch runs a 1-D convolution as a 2-D one of height 1, on a contiguous copy
        # of the input (so that a permuted input never selects channels-last): only
        # the weight's strides can make the output channels-last.
        if not input.is_contiguous():  # torch copies it on every call; here once
            input = torch.empty(input.shape, dtype=input.dtype, device=input.device)
        input, weight = input.unsqueeze(2), weight.unsqueeze(2)
        stride, padding, dilation = [1, *stride], [0, *padding], [1, *dilation]
    try:
        backend = _select_conv_backend(
            input, weight, bias, list(stride), list(padding), list(dilation), False,
            [0] * len(stride), groups, None,
        )  # fmt: skip
        memory_format = _backend_memory_format(input, weight, backend)
    except (RuntimeError, TypeError):  # a signature or a check torch has changed
        return None
    if memory_format in (torch.channels_last, torch.channels_last_3d):
        return Layout.CHANNELS_LAST
    return Layout.CHANNELS_FIRST


def _empty_batch_output_layout(input: torch.Tensor, output_shape: Sequence[int]) -> Layout:
    """torch computes an empty batch as the input times one weight element, viewed in
    the output's shape: the view keeps the input's strides when the two shapes agree
    (a pointwise convolution as wide as its input) and is contiguous otherwise,
    whatever the weight's layout, the dimensions or the dtype."""
    same_shape = tuple(output_shape) == tuple(input.shape)
    if same_shape and has_strides_of(input, Layout.CHANNELS_LAST):
        return Layout.CHANNELS_LAST
    return Layout.CHANNELS_FIRST


def dense_strides(shape: Sequence[int], layout: Layout) -> tuple[int, ...]:
    """The strides of a dense tensor of ``shape`` in ``layout`` (what empty_in gives)."""
    order = list(range(len(shape)))
    if layout is Layout.CHANNELS_LAST:
        order = [0, *range(2, len(shape)), 1]
    strides = [0] * len(shape)
    step = 1
    for dim in reversed(order):
        strides[dim] = step
        step *= max(int(shape[dim]), 1)
    return tuple(strides)


def has_strides_of(t: torch.Tensor, layout: Layout) -> bool:
    """Whether ``t`` has the strides of a dense tensor in ``layout`` (size-1 dimensions
    aside, whose strides address nothing); unlike is_contiguous, this tells the two
    layouts apart for an empty tensor too."""
    want = dense_strides(t.shape, layout)
    return all(a == b for a, b, n in zip(t.stride(), want, t.shape) if n != 1)


def empty_in(
    shape: Sequence[int], layout: Layout, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """An uninitialised tensor of logical ``shape`` laid out in ``layout``."""
    if layout is Layout.CHANNELS_FIRST:
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    n, c, *spatial = shape
    return torch.empty((n, *spatial, c), dtype=dtype, device=device).movedim(-1, 1)


# ---- weight memory formats (convert(memory_format=), gemmconv.nn's memory_format=) ----

# torch's channels-last format for a convolution's weight, by spatial dimensions: the
# weight of a 2-D convolution is a 4-D tensor, of a 3-D one 5-D. torch has no format
# for the 3-D weight of a 1-D convolution.
CHANNELS_LAST_FORMATS: dict[int, torch.memory_format] = {
    2: torch.channels_last,
    3: torch.channels_last_3d,
}
WEIGHT_FORMATS = (torch.contiguous_format, torch.channels_last, torch.channels_last_3d)
_WEIGHT_FORMAT_CHOICES = (
    "torch.channels_last, torch.channels_last_3d, torch.contiguous_format or None"
)


def check_weight_format(where: str, memory_format: object) -> torch.memory_format | None:
    """``memory_format`` when it is one a convolution weight can be given, else the error
    naming it (TypeError for something that is not a memory format at all); ``where``
    names the caller in the message."""
    if memory_format is None:
        return None
    if not isinstance(memory_format, torch.memory_format):
        raise TypeError(
            f"{where}: memory_format={memory_format!r} of type {type(memory_format).__name__}; "
            f"expected {_WEIGHT_FORMAT_CHOICES}"
        )
    if memory_format not in WEIGHT_FORMATS:
        raise ValueError(
            f"{where}: memory_format={memory_format}; expected {_WEIGHT_FORMAT_CHOICES}"
        )
    return memory_format


def is_channels_last_format(memory_format: torch.memory_format | None) -> bool:
    return memory_format in (torch.channels_last, torch.channels_last_3d)


def set_weight_format(parameter: torch.Tensor, memory_format: torch.memory_format) -> bool:
    """Re-lay ``parameter`` (and its gradient, if any) out in ``memory_format`` in place:
    the Parameter object stays, only its ``.data`` changes, so every reference to it
    (an optimizer's included) stays valid. Returns whether anything moved."""
    if parameter.is_contiguous(memory_format=memory_format):
        return False
    with torch.no_grad():
        parameter.data = parameter.data.contiguous(memory_format=memory_format)
        if parameter.grad is not None:
            # A fused optimizer walks the parameter and its gradient as flat memory;
            # both must have the same layout.
            parameter.grad = parameter.grad.contiguous(memory_format=memory_format)
    return True
