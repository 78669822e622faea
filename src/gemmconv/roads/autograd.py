"""The autograd formulas of the three ops, registered on the ops themselves (rather
than wrapping them in autograd.Functions) so torch.compile traces forward and backward
as a whole.

The forward's backward runs backward-data and backward-weights, each only when its
gradient is needed, and sums dy for the bias gradient. The two backward ops are linear
in each of their operands, so their own gradients are the other two directions of the
same convolution, which makes double backward (``create_graph=True``, e.g. gradient
penalties) run on gemmconv too. With y = conv(x, w):

- dx = backward_data(dy, w): a gradient g of dx gives dy the gradient conv(g, w) and
  w the gradient backward_weights(dy, g), since <g, dx> = <conv(g, w), dy>.
- dw = backward_weights(dy, x): a gradient G of dw gives dy the gradient conv(x, G)
  and x the gradient backward_data(dy, G), since <G, dw> = <conv(x, G), dy>.
"""

from __future__ import annotations

import torch

from gemmconv.core.memory_format import Layout, layout_of
from gemmconv.roads.ops import conv_backward_data, conv_backward_weights, conv_forward
from gemmconv.solvers.cpu_conv_hazards import weight_gradient_arguments
from gemmconv.solvers.views import bias_grad


def _forward_setup_context(ctx, inputs, output) -> None:
    input, weight, bias, stride, padding, dilation, groups = inputs
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    # Keep only what the backward pass will read: the input for dW, the weight for dx.
    ctx.save_for_backward(input if need_dw else None, weight if need_dx else None)
    ctx.input_size = list(input.shape)
    ctx.weight_size = list(weight.shape)
    ctx.conv_args = (list(stride), list(padding), list(dilation), groups)
    ctx.channels_last = layout_of(input, weight) is Layout.CHANNELS_LAST


def under_vmap(grad_output: torch.Tensor) -> bool:
    """Whether a backward runs batched: ``grad_output`` is a batched tensor of the vmap
    behind ``torch.autograd.grad(..., is_grads_batched=True)`` and
    ``torch.autograd.functional.jacobian(..., vectorize=True)``, or a torch.func
    transform (vmap over a backward among them) is active. The solvers' out= and
    in-place ops have no batching rules, so such a backward takes vmap_safe_gradients."""
    return _is_legacy_batched(grad_output) or _functorch_transforms_active()


_is_legacy_batched = torch._C._functorch.is_legacy_batchedtensor
_functorch_transforms_active = torch._C._are_functorch_transforms_active


def vmap_safe_gradients(
    grad_output: torch.Tensor,
    input: torch.Tensor | None,
    weight: torch.Tensor | None,
    input_size: list[int],
    weight_size: list[int],
    conv_args: tuple,
    need_dx: bool,
    need_dw: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """dx and dW, each where needed, by torch's own convolution backward, out of place,
    which vmap batches (and autograd differentiates again) as it does torch's
    convolutions. ``input`` may be None where dW is not needed and ``weight`` where dx
    is not: only its size is read then, from a stride-0 stand-in, as
    torch.nn.grad.conv*_input/_weight pass one. ``conv_args`` is (stride, padding,
    dilation, groups) as lists and an int."""
    stride, padding, dilation, groups = conv_args
    # The stand-in is made from the saved operand, which the batch does not wrap.
    if input is None:
        input = weight.new_empty(1).expand(input_size)
    if weight is None:
        weight = input.new_empty(1).expand(weight_size)
    dx = None
    if need_dw:
        dw_input, weight, dw_stride, dw_dilation = weight_gradient_arguments(
            input, weight, stride, padding, dilation, groups
        )
        if dw_stride is not stride and need_dx:
            # dW from the elements a strided 1x1 reads, at unit stride: dx apart.
            dx, _ = vmap_safe_gradients(grad_output, input, weight, input_size, weight_size,
                                        conv_args, True, False)  # fmt: skip
            need_dx = False
        input, stride, dilation = dw_input, dw_stride, dw_dilation
    dx_here, dw, _ = torch.ops.aten.convolution_backward(
        grad_output, input, weight, None, stride, padding, dilation,
        False, [0] * len(stride), groups, [need_dx, need_dw, False],
    )  # fmt: skip
    return (dx_here if need_dx else dx), dw


def _forward_backward(ctx, grad_output: torch.Tensor):
    input, weight = ctx.saved_tensors
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    if under_vmap(grad_output):
        # The custom ops have no batching rule: vmap would run them once per batch entry
        # (with a performance warning under torch.func).
        dx, dw = vmap_safe_gradients(
            grad_output, input, weight, ctx.input_size, ctx.weight_size, ctx.conv_args,
            need_dx, need_dw,
        )  # fmt: skip
    else:
        dx = dw = None
        if need_dx:
            dx = torch.ops.gemmconv.conv_backward_data(
                grad_output, weight, ctx.input_size, *ctx.conv_args, ctx.channels_last
            )
        if need_dw:
            dw = torch.ops.gemmconv.conv_backward_weights(
                grad_output, input, ctx.weight_size, *ctx.conv_args, ctx.channels_last
            )
    db = bias_grad(grad_output, out_channels=ctx.weight_size[0]) if need_db else None
    return dx, dw, db, None, None, None, None


def _backward_setup_context(ctx, inputs, output) -> None:
    """Shared by both backward ops: inputs are (dy, the other operand, the size of the
    result, stride, padding, dilation, groups, channels_last)."""
    grad_output, operand, _result_size, stride, padding, dilation, groups, channels_last = inputs
    need_ddy, need_doperand = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    # The operand's gradient reads dy; dy's gradient reads the operand.
    ctx.save_for_backward(grad_output if need_doperand else None, operand if need_ddy else None)
    ctx.operand_size = list(operand.shape)
    ctx.conv_args = (list(stride), list(padding), list(dilation), groups)
    ctx.channels_last = channels_last


_NO_GRAD_FOR_ARGUMENTS = (None,) * 6


def _backward_data_backward(ctx, grad_dx: torch.Tensor):
    return _bilinear_backward(ctx, grad_dx, operand_is_weight=True)


def _backward_weights_backward(ctx, grad_dw: torch.Tensor):
    return _bilinear_backward(ctx, grad_dw, operand_is_weight=False)


def _bilinear_backward(ctx, grad_result: torch.Tensor, operand_is_weight: bool):
    """The gradients of a backward op f(dy, operand), from the gradient of its result:
    dy's is a forward convolution and the operand's the other backward op (the module
    docstring has both identities)."""
    grad_output, operand = ctx.saved_tensors
    ddy = d_operand = None
    if ctx.needs_input_grad[0]:
        x, w = (grad_result, operand) if operand_is_weight else (operand, grad_result)
        ddy = torch.ops.gemmconv.conv_forward(x, w, None, *ctx.conv_args)
    if ctx.needs_input_grad[1]:
        if operand_is_weight:
            other_backward = torch.ops.gemmconv.conv_backward_weights
        else:
            other_backward = torch.ops.gemmconv.conv_backward_data
        d_operand = other_backward(
            grad_output, grad_result, ctx.operand_size, *ctx.conv_args, ctx.channels_last
        )
    return ddy, d_operand, *_NO_GRAD_FOR_ARGUMENTS


conv_forward.register_autograd(_forward_backward, setup_context=_forward_setup_context)
conv_backward_data.register_autograd(_backward_data_backward, setup_context=_backward_setup_context)
conv_backward_weights.register_autograd(
    _backward_weights_backward, setup_context=_backward_setup_context
)
