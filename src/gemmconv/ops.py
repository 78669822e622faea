"""The three directions as torch.library custom ops, so torch.compile sees one opaque
node per direction.

- ``gemmconv::conv_forward(input, weight, bias, stride, padding, dilation, groups)``
- ``gemmconv::conv_backward_data(grad_output, weight, input_size, ..., channels_last)``
- ``gemmconv::conv_backward_weights(grad_output, input, weight_size, ..., channels_last)``

Each real implementation builds the direction's ConvProblem from the concrete tensors
and asks dispatch for its solver, so solver selection happens when the op runs, outside
any traced graph: a compiled graph holds the op, not a solver, and a new batch size is a
new dispatch-cache entry, never a recompilation. The fake implementations give the
shapes and strides the real ones return (the layout F.conv* gives), and the real ones
guarantee those strides, which compiled code relies on.

The backward ops take the problem layout as a flag because the forward decides it from
both operands (channels-last when the input or the weight is), and the backward has only
one of them: backward-data never needs the input, backward-weights never the weight.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gemmconv import dispatch
from gemmconv.memory_format import Layout, empty_in, layout_of, output_layout
from gemmconv.problem import ConvProblem, Direction
from gemmconv.solvers import ConvTensors

_FORWARD_SCHEMA = (
    "(Tensor input, Tensor weight, Tensor? bias, int[] stride, int[] padding, "
    "int[] dilation, int groups) -> Tensor"
)
_BACKWARD_DATA_SCHEMA = (
    "(Tensor grad_output, Tensor weight, SymInt[] input_size, int[] stride, int[] padding, "
    "int[] dilation, int groups, bool channels_last) -> Tensor"
)
_BACKWARD_WEIGHTS_SCHEMA = (
    "(Tensor grad_output, Tensor input, SymInt[] weight_size, int[] stride, int[] padding, "
    "int[] dilation, int groups, bool channels_last) -> Tensor"
)


def _layout(channels_last: bool) -> Layout:
    return Layout.CHANNELS_LAST if channels_last else Layout.CHANNELS_FIRST


def _output_spatial(spatial, kernel, stride, padding, dilation) -> list:
    return [
        (s + 2 * p - d * (r - 1) - 1) // u + 1
        for s, r, u, p, d in zip(spatial, kernel, stride, padding, dilation, strict=True)
    ]


def dense(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    """``t`` as is when it is dense in either layout, else a dense copy in ``layout``.

    Slices, expanded (stride-0) gradients and other views are copied once here, as
    torch's own convolutions copy them, so solvers only ever see dense operands.
    """
    expanded = any(st == 0 and size > 1 for st, size in zip(t.stride(), t.shape, strict=True))
    if not expanded and (t.is_contiguous() or t.movedim(1, -1).is_contiguous()):
        return t
    if layout is Layout.CHANNELS_FIRST:
        return t.contiguous()
    return t.movedim(1, -1).contiguous().movedim(-1, 1)


def _strides_in(shape: Sequence[int], layout: Layout) -> tuple[int, ...]:
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


def _as_promised(result: torch.Tensor, layout: Layout) -> torch.Tensor:
    """``result`` with exactly the strides the fake implementation promises.

    Strides of size-1 dimensions do not address memory, so a result that differs only
    there is re-viewed for free; anything else (a vendor kernel choosing another
    memory format) is copied once.
    """
    want = _strides_in(result.shape, layout)
    if result.stride() == want:
        return result
    if all(a == b for a, b, n in zip(result.stride(), want, result.shape, strict=True) if n > 1):
        return result.as_strided(result.shape, want, result.storage_offset())
    out = empty_in(result.shape, layout, result.dtype, result.device)
    out.copy_(result)
    return out


def _run(problem: ConvProblem, tensors: ConvTensors) -> torch.Tensor:
    solver = dispatch.solver_for(problem)
    if not torch.is_autocast_enabled(problem.device_type):
        return solver.run(problem, tensors)
    # Autocast would re-cast the GEMMs inside a solver (and undo their fp32
    # accumulation); the operands were already cast before the op, as for F.conv*.
    with torch.autocast(problem.device_type, enabled=False):
        return solver.run(problem, tensors)


# ---- forward ----------------------------------------------------------------


@torch.library.custom_op("gemmconv::conv_forward", mutates_args=(), schema=_FORWARD_SCHEMA)
def conv_forward(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> torch.Tensor:
    problem = ConvProblem.from_tensors(input, weight, bias, stride, padding, dilation, groups)
    x, w = dense(input, problem.layout), dense(weight, problem.layout)
    y = _run(problem, ConvTensors(input=x, weight=w, bias=bias))
    return _as_promised(
        y, output_layout(problem.layout, problem.dims, problem.dtype, problem.device_type)
    )


@conv_forward.register_fake
def _(input, weight, bias, stride, padding, dilation, groups):
    dims = input.dim() - 2
    spatial = _output_spatial(input.shape[2:], weight.shape[2:], stride, padding, dilation)
    layout = output_layout(layout_of(input, weight), dims, input.dtype, input.device.type)
    return empty_in((input.shape[0], weight.shape[0], *spatial), layout, input.dtype, input.device)


# ---- backward-data ----------------------------------------------------------


@torch.library.custom_op(
    "gemmconv::conv_backward_data", mutates_args=(), schema=_BACKWARD_DATA_SCHEMA
)
def conv_backward_data(
    grad_output: torch.Tensor,
    weight: torch.Tensor,
    input_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    channels_last: bool,
) -> torch.Tensor:
    layout = _layout(channels_last)
    problem = _backward_problem(
        grad_output, input_size, weight.shape, stride, padding, dilation, groups, layout
    ).with_direction(Direction.BACKWARD_DATA)
    dy, w = dense(grad_output, layout), dense(weight, layout)
    dx = _run(problem, ConvTensors(grad_output=dy, weight=w))
    return _as_promised(dx, output_layout(layout, problem.dims, problem.dtype, problem.device_type))


@conv_backward_data.register_fake
def _(grad_output, weight, input_size, stride, padding, dilation, groups, channels_last):
    layout = output_layout(
        _layout(channels_last), len(input_size) - 2, grad_output.dtype, grad_output.device.type
    )
    return empty_in(input_size, layout, grad_output.dtype, grad_output.device)


# ---- backward-weights -------------------------------------------------------


@torch.library.custom_op(
    "gemmconv::conv_backward_weights", mutates_args=(), schema=_BACKWARD_WEIGHTS_SCHEMA
)
def conv_backward_weights(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    channels_last: bool,
) -> torch.Tensor:
    layout = _layout(channels_last)
    problem = _backward_problem(
        grad_output, input.shape, weight_size, stride, padding, dilation, groups, layout
    ).with_direction(Direction.BACKWARD_WEIGHTS)
    dy, x = dense(grad_output, layout), dense(input, layout)
    dw = _run(problem, ConvTensors(grad_output=dy, input=x))
    return _as_promised(dw, layout)


@conv_backward_weights.register_fake
def _(grad_output, input, weight_size, stride, padding, dilation, groups, channels_last):
    return empty_in(weight_size, _layout(channels_last), grad_output.dtype, grad_output.device)


def _backward_problem(
    grad_output, input_size, weight_size, stride, padding, dilation, groups, layout
) -> ConvProblem:
    return ConvProblem.from_sizes(
        n=input_size[0],
        c=input_size[1],
        k=weight_size[0],
        spatial=tuple(input_size[2:]),
        kernel=tuple(weight_size[2:]),
        stride=stride,
        padding=padding,
        dilation=dilation,
        groups=groups,
        layout=layout,
        dtype=grad_output.dtype,
        device_type=grad_output.device.type,
    )


OPS = (conv_forward, conv_backward_data, conv_backward_weights)
