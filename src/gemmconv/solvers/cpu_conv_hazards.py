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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from gemmconv.core.memory_format import Layout, dense_strides, forward_output_layout


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
    result = torch.empty_strided(y.shape, dense_strides(y.shape, layout), dtype=y.dtype,
                                 device=y.device)  # fmt: skip
    return result.copy_(y)


def weight_gradient_operands(
    input: torch.Tensor, weight: torch.Tensor, padding: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The input and weight torch's weight gradient of (batched) ``input`` should be
    given: channels-first copies where channels-last ones are the bf16 run above, else
    the operands themselves."""
    if input.device.type == "cpu" and _small_padded_bf16(input, padding):
        return _channels_first(input), _channels_first(weight)
    return input, weight


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


__all__ = ["hazard_layout", "run_avoiding", "weight_gradient_operands"]
