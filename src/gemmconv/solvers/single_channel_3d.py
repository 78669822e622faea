"""torch's CPU fp32 3-D convolution of one channel a group, run channels-last, drops
outputs; this runs it channels-first and lays the result out as torch would.

oneDNN computes such a forward in channels_last_3d when either operand has those
strides (a single-channel volume or video permuted from channels-last memory), and with
two or more samples and a width the stride does not divide evenly it leaves outputs
unwritten: torch 2.13 and 2.14 returned zeros for two of every three outputs of a
[3, 1, 3, 3, 4] input under a [2, 1, 1, 1, 3] weight and stride (1, 1, 3), against a
float64 reference. Of 2592 fp32 geometries tried, 107 were wrong, every one with one
channel, two or more samples and a width the stride left a remainder of; channels-first
operands were right on all of them, and so were the backward directions. The same
memory viewed channels-first (a single channel's stride addresses nothing) gives the
right outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from gemmconv.core.memory_format import Layout, dense_strides, forward_output_layout


def drops_outputs(
    input: torch.Tensor,
    weight: torch.Tensor,
    output_shape: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> bool:
    """Whether torch's forward of these (batched) operands is the run that drops
    outputs: CPU, fp32, 3-D, one input channel a group, computed channels-last."""
    if (
        input.device.type != "cpu"
        or input.dtype != torch.float32
        or input.dim() != 5
        or weight.shape[1] != 1
        or input.shape[0] == 0
    ):
        return False
    layout = forward_output_layout(
        input, weight, None, output_shape, stride, padding, dilation, groups
    )
    return layout is Layout.CHANNELS_LAST


def run_channels_first(
    conv: Callable[..., torch.Tensor],
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *arguments: object,
) -> torch.Tensor:
    """``conv(input, weight, bias, *arguments)`` on channels-first views (or copies) of
    the operands, its result in channels_last_3d as torch's own would be."""
    y = conv(_channels_first(input), _channels_first(weight), bias, *arguments)
    result = torch.empty(y.shape, dtype=y.dtype, device=y.device,
                         memory_format=torch.channels_last_3d)  # fmt: skip
    return result.copy_(y)


def _channels_first(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        return t.contiguous()
    # Contiguous but for the stride of a size-1 dimension: the same memory, restrided.
    return t.as_strided(t.shape, dense_strides(t.shape, Layout.CHANNELS_FIRST))


__all__ = ["drops_outputs", "run_channels_first"]
