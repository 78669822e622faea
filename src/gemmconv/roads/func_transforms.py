"""The convolution under torch.func transforms and forward-mode AD.

The custom ops' autograd formulas (gemmconv.roads.autograd) serve plain reverse mode and
torch.compile, but torch.func cannot run them and they carry no tangents. Here the
three directions run through autograd.Functions (one for the forward, one for both
backward directions) with every rule torch.func asks for, each computed by the
custom ops themselves (so by gemmconv's solvers):

- ``backward``: the same formulas as gemmconv.roads.autograd, in terms of these Functions,
  so grad of grad (hessian, gradient penalties under torch.func) keeps working.
- ``jvp``: every direction is bilinear in its two tensor operands, so the tangent of
  f(a, b) is f(ta, b) + f(a, tb) (plus the bias tangent for the forward).
- ``vmap``: a batch over one operand is folded into a dimension the GEMM already has
  (the input's over the batch size, the weight's over the output or input channels),
  so it stays one gemmconv call of the same problem class. A batch over both operands
  is one grouped convolution with a group per batch element, as torch's own batching
  rule computes it; no single-GEMM solver takes groups > 1, so im2col's batched GEMM
  or the vendor path runs it, and this is said at DEBUG on the ``gemmconv.selection.dispatch``
  logger.

Channel order when a batch is folded into channels with ``groups`` g: a grouped
convolution pairs the i-th block of output channels with the i-th block of input
channels, so batch b's channels of group i sit at (i, b, channel in group).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gemmconv.core.memory_format import Layout, layout_of
from gemmconv.core.problem import Direction
from gemmconv.selection.dispatch import log
from gemmconv.solvers.views import bias_grad

# ---- folding a vmapped batch into a convolution dimension ---------------------------


def _batch_first(t: torch.Tensor, dim: int) -> torch.Tensor:
    return t.movedim(dim, 0)


def _into_channels(t: torch.Tensor, dim: int, groups: int) -> torch.Tensor:
    """[.., B, C, ..] (batch at ``dim``, channels after it) -> [.., B*C, ..] in
    (group, batch, channel in group) order."""
    channels = t.shape[dim + 1]
    split = t.unflatten(dim + 1, (groups, channels // groups))
    return split.transpose(dim, dim + 1).flatten(dim, dim + 2)


def _out_of_channels(t: torch.Tensor, dim: int, batch: int, groups: int) -> torch.Tensor:
    """The inverse of _into_channels: [.., B*C, ..] at ``dim`` -> [.., B, C, ..]."""
    split = t.unflatten(dim, (groups, batch, -1))
    return split.transpose(dim, dim + 1).flatten(dim + 1, dim + 2)


def _bias_like_output(bias: torch.Tensor, output_dims: int) -> torch.Tensor:
    """A batched bias [B, K] viewed to broadcast over a batched output [B, N, K, O..]."""
    return bias.reshape(bias.shape[0], 1, bias.shape[1], *(1,) * (output_dims - 3))


def _log_grouped(direction: str, groups: int) -> None:
    log.debug(
        "%s under vmap with both operands batched: one grouped convolution (groups=%d), "
        "which no single-GEMM solver takes (im2col's batched GEMM or the vendor path)",
        direction,
        groups,
    )


# ---- the three directions -----------------------------------------------------------

# No gradient for the non-tensor arguments: the forward's four, and the six after the
# backward's two tensors (its direction, before them, gets its None on its own).
_NO_GRAD_FORWARD_ARGUMENTS = (None,) * 4
_NO_GRAD_BACKWARD_ARGUMENTS = (None,) * 6


class _Forward(torch.autograd.Function):
    @staticmethod
    def forward(input, weight, bias, stride, padding, dilation, groups):
        return torch.ops.gemmconv.conv_forward(
            input, weight, bias, stride, padding, dilation, groups
        )

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, weight, bias, stride, padding, dilation, groups = inputs
        ctx.save_for_backward(input, weight)
        ctx.save_for_forward(input, weight)
        ctx.conv_args = (stride, padding, dilation, groups)
        ctx.input_size = list(input.shape)
        ctx.weight_size = list(weight.shape)
        ctx.output_size = list(output.shape)
        ctx.channels_last = layout_of(input, weight) is Layout.CHANNELS_LAST

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = _backward_data(
                grad_output, weight, ctx.input_size, *ctx.conv_args, ctx.channels_last
            )
        if ctx.needs_input_grad[1]:
            dw = _backward_weights(
                grad_output, input, ctx.weight_size, *ctx.conv_args, ctx.channels_last
            )
        if ctx.needs_input_grad[2]:
            db = bias_grad(grad_output, out_channels=ctx.weight_size[0])
        return dx, dw, db, *_NO_GRAD_FORWARD_ARGUMENTS

    @staticmethod
    def jvp(ctx, input_tangent, weight_tangent, bias_tangent, *_):
        input, weight = ctx.saved_tensors
        tangent = None
        if input_tangent is not None:
            tangent = _Forward.apply(input_tangent, weight, bias_tangent, *ctx.conv_args)
            bias_tangent = None
        if weight_tangent is not None:
            term = _Forward.apply(input, weight_tangent, bias_tangent, *ctx.conv_args)
            tangent = term if tangent is None else tangent + term
            bias_tangent = None
        if bias_tangent is not None:
            spatial = (1,) * (len(ctx.output_size) - 2)
            tangent = bias_tangent.reshape(1, -1, *spatial).expand(ctx.output_size).clone()
        return tangent

    @staticmethod
    def vmap(info, in_dims, input, weight, bias, stride, padding, dilation, groups):
        input_dim, weight_dim, bias_dim = in_dims[:3]
        batch = info.batch_size
        if weight_dim is None:
            if input_dim is None:  # only the bias is batched
                y = _Forward.apply(input, weight, None, stride, padding, dilation, groups)
                y = y.unsqueeze(0)
            else:  # the batch joins the convolution's own batch
                x = _batch_first(input, input_dim)
                fused_bias = bias if bias_dim is None else None
                y = _Forward.apply(
                    x.flatten(0, 1), weight, fused_bias, stride, padding, dilation, groups
                ).unflatten(0, x.shape[:2])
            if bias_dim is not None:
                y = y + _bias_like_output(_batch_first(bias, bias_dim), y.dim())
            return y, 0
        w = _batch_first(weight, weight_dim)
        b = None
        if bias is not None:
            b = _batch_first(bias, bias_dim) if bias_dim is not None else bias.expand(batch, -1)
        if input_dim is None:  # one convolution with each weight's output channels
            y = _Forward.apply(
                input,
                _into_channels(w, 0, groups),
                None if b is None else _into_channels(b, 0, groups),
                stride,
                padding,
                dilation,
                groups,
            )
            return _out_of_channels(y, 1, batch, groups), 1
        x = _batch_first(input, input_dim).movedim(0, 1).flatten(1, 2)
        _log_grouped("forward", groups * batch)
        y = _Forward.apply(
            x,
            w.flatten(0, 1),
            None if b is None else b.flatten(),
            stride,
            padding,
            dilation,
            groups * batch,
        )
        return y.unflatten(1, (batch, -1)), 1


# ``torch.ops.gemmconv.conv_forward``, with the same arguments (gemmconv.roads.ops.forward),
# plus forward-mode, torch.func and vmap rules.
conv_forward: Callable[..., torch.Tensor] = _Forward.apply


class _Backward(torch.autograd.Function):
    """A backward direction f(dy, operand): backward-data (the operand is the weight,
    the result dx) or backward-weights (the operand is the input, the result dw). Its
    arguments are (direction, dy, operand, size of the result, stride, padding,
    dilation, groups, channels_last)."""

    @staticmethod
    def forward(
        direction, grad_output, operand, result_size, stride, padding, dilation, groups, cl
    ):
        return _backward_op(direction)(
            grad_output, operand, result_size, stride, padding, dilation, groups, cl
        )

    @staticmethod
    def setup_context(ctx, inputs, output):
        direction, grad_output, operand, result_size, stride, padding, dilation, groups, cl = inputs
        ctx.save_for_backward(grad_output, operand)
        ctx.save_for_forward(grad_output, operand)
        ctx.direction = direction
        ctx.result_size = result_size
        ctx.operand_size = list(operand.shape)
        ctx.conv_args = (stride, padding, dilation, groups)
        ctx.channels_last = cl

    @staticmethod
    def backward(ctx, grad_result):
        # backward-data: <g, dx> = <conv(g, w), dy>, and as a function of w,
        # backward_weights(dy, g); backward-weights: <G, dw> = <conv(x, G), dy>, and as
        # a function of x, backward_data(dy, G).
        grad_output, operand = ctx.saved_tensors
        ddy = d_operand = None
        # needs_input_grad follows the arguments: the direction first, then dy and operand.
        if ctx.needs_input_grad[1]:
            if ctx.direction is Direction.BACKWARD_DATA:
                ddy = _Forward.apply(grad_result, operand, None, *ctx.conv_args)
            else:
                ddy = _Forward.apply(operand, grad_result, None, *ctx.conv_args)
        if ctx.needs_input_grad[2]:
            d_operand = _Backward.apply(
                _OTHER_BACKWARD[ctx.direction],
                grad_output,
                grad_result,
                ctx.operand_size,
                *ctx.conv_args,
                ctx.channels_last,
            )
        return None, ddy, d_operand, *_NO_GRAD_BACKWARD_ARGUMENTS

    @staticmethod
    def jvp(ctx, _direction_tangent, grad_output_tangent, operand_tangent, *_):
        # f is bilinear in (dy, operand): its tangent is f(t_dy, operand) + f(dy, t_operand).
        grad_output, operand = ctx.saved_tensors
        rest = (ctx.result_size, *ctx.conv_args, ctx.channels_last)
        tangent = None
        if grad_output_tangent is not None:
            tangent = _Backward.apply(ctx.direction, grad_output_tangent, operand, *rest)
        if operand_tangent is not None:
            term = _Backward.apply(ctx.direction, grad_output, operand_tangent, *rest)
            tangent = term if tangent is None else tangent + term
        return tangent

    @staticmethod
    def vmap(info, in_dims, direction, grad_output, operand, result_size, *rest):
        stride, padding, dilation, groups, cl = rest
        rule = _VMAP_RULES[direction]
        args = (stride, padding, dilation)
        return rule(
            info.batch_size, in_dims[1:3], grad_output, operand, result_size, args, groups, cl
        )


_OTHER_BACKWARD = {
    Direction.BACKWARD_DATA: Direction.BACKWARD_WEIGHTS,
    Direction.BACKWARD_WEIGHTS: Direction.BACKWARD_DATA,
}


def _backward_op(direction: Direction):
    # Looked up per call, as the Functions' forwards look up theirs.
    if direction is Direction.BACKWARD_DATA:
        return torch.ops.gemmconv.conv_backward_data
    return torch.ops.gemmconv.conv_backward_weights


def _vmap_backward_data(batch, in_dims, grad_output, weight, input_size, args, groups, cl):
    dy_dim, weight_dim = in_dims
    n, c, *spatial = input_size
    if weight_dim is None:  # the batch joins the convolution's own batch
        dy = _batch_first(grad_output, dy_dim)
        dx = _backward_data(dy.flatten(0, 1), weight, [batch * n, c, *spatial], *args, groups, cl)
        return dx.unflatten(0, (batch, n)), 0
    w = _batch_first(weight, weight_dim)
    if dy_dim is None:  # each weight's input channels side by side
        stacked = w.movedim(0, 1).flatten(1, 2)
        dx = _backward_data(grad_output, stacked, [n, batch * c, *spatial], *args, groups, cl)
        return _out_of_channels(dx, 1, batch, groups), 1
    dy = _batch_first(grad_output, dy_dim).movedim(0, 1).flatten(1, 2)
    _log_grouped("backward-data", groups * batch)
    dx = _backward_data(dy, w.flatten(0, 1), [n, batch * c, *spatial], *args, groups * batch, cl)
    return dx.unflatten(1, (batch, c)), 1


def _vmap_backward_weights(batch, in_dims, grad_output, input, weight_size, args, groups, cl):
    dy_dim, input_dim = in_dims
    k, c_per_group, *kernel = weight_size
    if input_dim is None:  # each sample's output channels side by side
        dy = _into_channels(_batch_first(grad_output, dy_dim).movedim(0, 1), 1, groups)
        dw = _backward_weights(dy, input, [batch * k, c_per_group, *kernel], *args, groups, cl)
        return _out_of_channels(dw, 0, batch, groups), 0
    x = _batch_first(input, input_dim).movedim(0, 1)
    if dy_dim is None:  # each sample's input channels side by side
        stacked = _into_channels(x, 1, groups)
        dw = _backward_weights(
            grad_output, stacked, [k, batch * c_per_group, *kernel], *args, groups, cl
        )
        return dw.unflatten(1, (batch, c_per_group)), 1
    dy = _batch_first(grad_output, dy_dim).movedim(0, 1).flatten(1, 2)
    _log_grouped("backward-weights", groups * batch)
    dw = _backward_weights(
        dy, x.flatten(1, 2), [batch * k, c_per_group, *kernel], *args, groups * batch, cl
    )
    return dw.unflatten(0, (batch, k)), 0


# The vmap rule of each backward direction: (batch size, the batch dimensions of dy and
# of the operand, dy, the operand, the result's size, (stride, padding, dilation),
# groups, channels_last) -> (result, its batch dimension).
_VMAP_RULES = {
    Direction.BACKWARD_DATA: _vmap_backward_data,
    Direction.BACKWARD_WEIGHTS: _vmap_backward_weights,
}


def _backward_data(*args) -> torch.Tensor:
    """dx = backward_data(dy, w, input size, stride, padding, dilation, groups, cl)."""
    return _Backward.apply(Direction.BACKWARD_DATA, *args)


def _backward_weights(*args) -> torch.Tensor:
    """dw = backward_weights(dy, x, weight size, stride, padding, dilation, groups, cl)."""
    return _Backward.apply(Direction.BACKWARD_WEIGHTS, *args)
