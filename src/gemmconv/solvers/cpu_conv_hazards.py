"""Operands torch's CPU convolution forward mishandles, and the run that avoids them:
the same memory seen with channels-first strides, the result laid out as torch's own.

- fp32, 3-D, one channel a group, computed channels-last (a single-channel volume or
  video permuted from channels-last memory): oneDNN leaves outputs unwritten with two
  or more samples and a width the stride does not divide evenly. torch 2.13 and 2.14
  returned zeros for two of every three outputs of a [3, 1, 3, 3, 4] input under a
  [2, 1, 1, 1, 3] weight and stride (1, 1, 3); of 2592 fp32 geometries tried, 107 were
  wrong, all of that kind, and channels-first operands were right on every one (the
  backward directions were right too).
- bf16, 1-D, an operand of length 1 whose length stride is not 1 (a length-1 sequence
  transposed from [N, L, C] memory): torch 2.14 segfaulted on a [2, 6, 1] input of
  strides (6, 1, 6), groups 3, under stride 2, padding 1 and dilation 2, and on that
  input with a weight of such strides; with strides (6, 1, 1) it ran, as fp32 and
  fp16 did. A size-1 dimension's stride addresses nothing, so both views read the
  same elements.
- bf16, computed channels-last (torch's choice: either operand so laid out), a padded
  dimension of at most 2 input elements: torch 2.14's backward returns a wrong weight
  gradient. In 1-D and 2-D, with a channels-last weight, a kernel tap that reads only
  padding is left unwritten (whatever the memory held: NaN, 1e36); of the 224 1-D
  problems of a sweep with such a weight and tap, 56 came back wrong, all of a length-1
  input. In 3-D, 50 of the 72 problems of a 2x2x2 input under a 3x3x3 kernel with
  padding 1 came back wrong every time (up to 1.5x the gradient's largest element), and
  others of a length-1 or length-2 input. No sweep found one with a larger padded
  dimension, channels-first operands or fp32 and fp16. The forward takes channels-first
  operands here, so the backward torch records for it does too, and the vendor's own
  weight gradient (vendor.weight_gradient, whose weight stands in contiguous) a
  channels-first input. A padded dimension of one or two elements is rare, so are the
  copies.
- fp32 or bf16, computed channels-last, a 1x1 kernel with a stride above 1 and no
  padding: torch's weight gradient (2.13 to 2.15) writes past the end of a buffer on some small
  problems (heap corruption, which glibc noticed hundreds of calls later, if at all).
  Under an allocator that faults at such a write (tests/native/guard_allocator.c),
  23 of 2000 bf16 and 14 of 2000 fp32 random problems faulted with two threads, 35 and
  45 with eight, 6 and none with one (bench/probes/results/cpu_conv_overflow_epyc.txt);
  none at unit stride, with channels-first operands or in fp16. Which problems fault
  moves with the thread count, so no shape rule names them: every such weight
  gradient is computed as the unit-stride 1x1 of the elements the stride reads, copied
  dense channels-last (1/s^2 of the input), fp16's too. The forward does not fault;
  where torch's autograd records it, it records that copy and the unit-stride 1x1, so
  its backward runs at unit stride as well.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from gemmconv.core.memory_format import Layout, dense_strides, empty_in, forward_output_layout


def hazard_layout(
    input: torch.Tensor,
    weight: torch.Tensor,
    output_shape: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> Layout | None:
    """Where torch's forward of these (batched) operands is one of the runs above, the
    layout torch's own result would have; else None."""
    if input.device.type != "cpu" or input.shape[0] == 0:
        return None
    single_channel_3d = input.dtype == torch.float32 and input.dim() == 5 and weight.shape[1] == 1
    transposed_bf16 = input.dtype == torch.bfloat16 and (
        _length_one_transposed(input) or _length_one_transposed(weight)
    )
    if not (single_channel_3d or transposed_bf16 or _small_padded_bf16(input, padding)):
        return None
    layout = forward_output_layout(
        input, weight, None, output_shape, stride, padding, dilation, groups
    )
    if not transposed_bf16 and layout is not Layout.CHANNELS_LAST:
        return None  # the other two computed channels-first: torch is right
    return layout


def run_avoiding(
    layout: Layout,
    conv: Callable[..., torch.Tensor],
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *arguments: object,
) -> torch.Tensor:
    """``conv(input, weight, bias, *arguments)`` on channels-first views (or copies) of
    the operands, its result in ``layout`` (hazard_layout's answer)."""
    y = conv(_channels_first(input), _channels_first(weight), bias, *arguments)
    if layout is Layout.CHANNELS_FIRST:
        return y
    return empty_in(y.shape, layout, y.dtype, y.device).copy_(y)


def weight_gradient_arguments(
    input: torch.Tensor,
    weight: torch.Tensor,
    stride: list[int],
    padding: Sequence[int],
    dilation: list[int],
    groups: int,
) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    """The input, weight, stride and dilation torch's weight gradient of (batched)
    ``input`` should be given: channels-first copies where channels-last ones are the
    small-padding bf16 run above, the elements a strided 1x1 reads at unit stride where
    it is the out-of-bounds write, else the arguments themselves."""
    if input.device.type == "cpu" and _small_padded_bf16(input, padding):
        return _channels_first(input), _channels_first(weight), stride, dilation
    reads = unit_stride_reads(input, weight, stride, padding, dilation, groups)
    if reads is not None:
        unit = [1] * len(stride)
        return unit_stride_input(input, reads), weight, unit, unit
    return input, weight, stride, dilation


# The dtypes torch's CPU convolution runs on oneDNN (fp64 takes torch's own kernels).
_ONEDNN_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})


def unit_stride_reads(
    input: torch.Tensor,
    weight: torch.Tensor,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> tuple | None:
    """Where torch's weight gradient of these operands (``input`` batched or not) is the
    strided 1x1 write above, the index of the elements the 1x1 reads: ``input`` seen
    through it and convolved at unit stride is the same convolution. Else None."""
    if (
        input.device.type != "cpu"
        or input.dtype not in _ONEDNN_DTYPES
        or any(padding)
        or all(s == 1 for s in stride)
        or any(r != 1 for r in weight.shape[2:])
    ):
        return None
    batched = input if input.dim() == weight.dim() else input.unsqueeze(0)
    if batched.numel() == 0:
        return None
    outputs = ((size - 1) // s + 1 for size, s in zip(batched.shape[2:], stride))
    output_shape = (batched.shape[0], weight.shape[0], *outputs)
    layout = forward_output_layout(
        batched, weight, None, output_shape, stride, padding, dilation, groups
    )
    if layout is not Layout.CHANNELS_LAST:
        return None
    return (Ellipsis, *(slice(None, None, s) for s in stride))


def unit_stride_input(input: torch.Tensor, reads: tuple) -> torch.Tensor:
    """The elements ``reads`` (unit_stride_reads' answer) of ``input`` (batched or not),
    copied dense channels-last. Not the strided view itself: torch compacts that
    channels-first and computes channels-first, and ResNet-50's fp32 downsample weight
    gradient (batch 8, 256 -> 512 at 56x56) then took 9.5 ms against the strided
    call's 5.0 on the CPU machine; with this copy (0.1 ms) 5.8 against 5.0, and 5.1
    against 6.4 at 28x28, within that machine's spread."""
    view = input[reads]
    unbatched = input.dim() == len(reads)  # reads: Ellipsis and one slice a spatial dim
    shape = (1, *view.shape) if unbatched else view.shape
    dense = empty_in(shape, Layout.CHANNELS_LAST, view.dtype, view.device)
    if unbatched:
        dense = dense[0]
    return dense.copy_(view)


def run_at_unit_stride(
    reads: tuple,
    conv: Callable[..., torch.Tensor],
    groups: int,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *arguments: object,
) -> torch.Tensor:
    """``conv`` (an F.conv*) of a strided 1x1 with ``arguments``, computed where autograd
    will ask for the weight's gradient as the unit-stride 1x1 of the elements it reads
    (``reads``, unit_stride_reads' answer), so that torch records that one. A forward
    alone does not fault and runs as it is."""
    if not (weight.requires_grad and torch.is_grad_enabled()):
        return conv(input, weight, bias, *arguments)
    return conv(unit_stride_input(input, reads), weight, bias, 1, 0, 1, groups)


def _small_padded_bf16(input: torch.Tensor, padding: Sequence[int]) -> bool:
    """Whether ``input`` is bf16 with a padded dimension of at most 2 elements."""
    return input.dtype == torch.bfloat16 and any(
        p > 0 and size <= 2 for size, p in zip(input.shape[2:], padding)
    )


def _length_one_transposed(t: torch.Tensor) -> bool:
    """Whether ``t`` is 1-D of length 1 with the length's stride not 1 (a view of
    [N, L, C] memory)."""
    return t.dim() == 3 and t.shape[2] == 1 and t.stride(2) != 1


def _channels_first(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        return t.contiguous()
    # Contiguous but for the stride of a size-1 dimension: the same memory, restrided.
    return t.as_strided(t.shape, dense_strides(t.shape, Layout.CHANNELS_FIRST))


__all__ = [
    "hazard_layout",
    "run_at_unit_stride",
    "run_avoiding",
    "unit_stride_input",
    "unit_stride_reads",
    "weight_gradient_arguments",
]
