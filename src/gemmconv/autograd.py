"""The autograd formula of ``gemmconv::conv_forward``: its backward runs the
backward-data and backward-weights ops, each only when its gradient is needed, and
sums dy for the bias gradient. Registering it on the op (rather than wrapping the op
in an autograd.Function) lets torch.compile trace forward and backward as a whole."""

from __future__ import annotations

import torch

from gemmconv.memory_format import Layout, layout_of
from gemmconv.ops import conv_forward
from gemmconv.solvers.views import bias_grad


def _setup_context(ctx, inputs, output) -> None:
    input, weight, bias, stride, padding, dilation, groups = inputs
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    # Keep only what the backward pass will read: the input for dW, the weight for dx.
    ctx.save_for_backward(input if need_dw else None, weight if need_dx else None)
    ctx.input_size = list(input.shape)
    ctx.weight_size = list(weight.shape)
    ctx.conv_args = (list(stride), list(padding), list(dilation), groups)
    ctx.channels_last = layout_of(input, weight) is Layout.CHANNELS_LAST


def _backward(ctx, grad_output: torch.Tensor):
    input, weight = ctx.saved_tensors
    dx = dw = db = None
    if ctx.needs_input_grad[0]:
        dx = torch.ops.gemmconv.conv_backward_data(
            grad_output, weight, ctx.input_size, *ctx.conv_args, ctx.channels_last
        )
    if ctx.needs_input_grad[1]:
        dw = torch.ops.gemmconv.conv_backward_weights(
            grad_output, input, ctx.weight_size, *ctx.conv_args, ctx.channels_last
        )
    if ctx.needs_input_grad[2]:
        db = bias_grad(grad_output, out_channels=ctx.weight_size[0])
    return dx, dw, db, None, None, None, None


conv_forward.register_autograd(_backward, setup_context=_setup_context)
