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
guarantee those strides, which compiled code relies on. gemmconv.roads.decompositions gives
each op its aten form, which exported programs turn to for portability.

The backward ops take the problem layout as a flag because the forward decides it from
both operands (channels-last when the input or the weight is), and the backward has only
one of them: backward-data never needs the input, backward-weights never the weight.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from gemmconv.core.arguments import ConvArgs, check_against_tensors
from gemmconv.core.memory_format import (
    Layout,
    dense_strides,
    empty_in,
    forward_output_layout,
    input_layout_of,
    output_layout,
)
from gemmconv.core.problem import ConvProblem, Direction
from gemmconv.selection import dispatch
from gemmconv.solvers import ConvTensors, Solver

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
    if is_dense(t):
        return t
    return _dense_copy(t, layout)


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t`` is dense in either layout (a function of its shape and strides)."""
    expanded = any(st == 0 and size > 1 for st, size in zip(t.stride(), t.shape, strict=True))
    return not expanded and (t.is_contiguous() or t.movedim(1, -1).is_contiguous())


def _dense_copy(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    if layout is Layout.CHANNELS_FIRST:
        return t.contiguous()
    return t.movedim(1, -1).contiguous().movedim(-1, 1)


def _as_promised(result: torch.Tensor, layout: Layout, want: tuple[int, ...]) -> torch.Tensor:
    """``result`` with exactly the strides the fake implementation promises (``want``,
    the strides of a dense tensor of its shape in ``layout``).

    Strides of size-1 dimensions do not address memory, so a result that differs only
    there is re-viewed for free; anything else (a vendor kernel choosing another
    memory format) is copied once.
    """
    if result.stride() == want:
        return result
    if all(a == b for a, b, n in zip(result.stride(), want, result.shape, strict=True) if n > 1):
        return result.as_strided(result.shape, want, result.storage_offset())
    out = empty_in(result.shape, layout, result.dtype, result.device)
    out.copy_(result)
    return out


class Plan:
    """What a call derives from its operands' metadata and the selection state: built
    once per distinct call, then found in one dict lookup (eager calls of a small
    convolution would otherwise spend more time here than in its GEMM). Its run is
    prepared on the first call (Solver.prepare), from that call's operands."""

    __slots__ = ("problem", "solver", "copy_first", "copy_second", "result_layout",
                 "result_strides", "runner", "result_as_promised", "keeping_columns")  # fmt: skip

    def __init__(
        self,
        problem: ConvProblem,
        solver: Solver,
        copy_first: bool,  # the first tensor operand is not dense in either layout
        copy_second: bool,
        result_layout: Layout,
        result_strides: tuple[int, ...],
    ) -> None:
        self.problem, self.solver = problem, solver
        self.copy_first, self.copy_second = copy_first, copy_second
        self.result_layout, self.result_strides = result_layout, result_strides
        self.runner: Callable[[ConvTensors], torch.Tensor] | None = None
        # Whether every result of the prepared run has ``result_strides`` already:
        # known once the run is prepared.
        self.result_as_promised = False
        # Where the run keeps columns (ColumnKeepingForward), needs no operand copied
        # and returns results as promised: its form on the operands themselves,
        # (input, weight, bias) -> (y, columns), which a forward outside autocast calls
        # and nothing else.
        self.keeping_columns: Callable[..., tuple] | None = None


# Asked on every run: bound once, as eager.py binds torch's C questions.
_any_autocast_enabled = torch._C._is_any_autocast_enabled
_is_grad_enabled = torch.is_grad_enabled


def as_base(result: torch.Tensor) -> torch.Tensor:
    """``result``, where a solver returned a view (of its GEMM's product) made with
    grad mode off, as a base tensor of the same memory, shape and strides: no copy.
    torch's convolutions return base tensors, and autograd refuses in-place ops on a
    view made inside a custom autograd Function or op (the forward's output on either
    road) or made under no_grad (once grad mode is back on), so ``y += r`` or
    ``relu_(y)`` would fail where torch's output takes them. A view made with grad mode
    on outside a Function takes them already, and inference mode makes no views.

    detach() is such a base (since torch 1.13 its metadata may change too: resize_,
    set_, as a convolution's output's may), sharing the view's version counter. On the
    CPU machine it costs 0.3 us of thread time, ``_make_subclass`` 0.5 and a set_()
    onto the view's storage 1.5. run_forward, the hottest caller, inlines this test."""
    if result._is_view() and not _is_grad_enabled():
        return result.detach()
    return result


# Bounded so that a stream of ever-new shapes cannot grow it without limit; emptied
# by dispatch.clear_cache() with the choices the plans hold.
_PLANS_MAX = 4096
_plans: dict[tuple, Plan] = dispatch.dependent_cache()


def _plan(
    key: tuple,
    first: torch.Tensor,
    second: torch.Tensor,
    build: Callable[[], tuple[ConvProblem, Layout, Sequence[int]]],
) -> Plan:
    """The plan of ``key``; ``build`` gives (problem, result layout, result shape).

    ``key`` must hold the shapes and strides of ``first`` and ``second``, every other
    argument the problem is built from, and dispatch.selection_key()."""
    plan = _plans.get(key)
    if plan is None:
        problem, layout, shape = build()
        plan = Plan(
            problem,
            dispatch.solver_for(problem),
            not is_dense(first),
            not is_dense(second),
            layout,
            dense_strides(shape, layout),
        )
        if len(_plans) >= _PLANS_MAX:
            _plans.clear()
        _plans[key] = plan
    return plan


def _operands(
    plan: Plan, first: torch.Tensor, second: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two tensor operands, each copied dense where the plan says it is not (the
    callers test ``plan.copy_first or plan.copy_second`` first: every Python frame
    shows in a small convolution's call)."""
    p = plan.problem
    # A non-dense x is copied into its own memory order, the one the problem reads it in.
    first_layout = p.input_layout if p.direction is Direction.FORWARD else p.layout
    second_layout = p.input_layout if p.direction is Direction.BACKWARD_WEIGHTS else p.layout
    return (
        _dense_copy(first, first_layout) if plan.copy_first else first,
        _dense_copy(second, second_layout) if plan.copy_second else second,
    )


def _prepared_runner(plan: Plan, tensors: ConvTensors) -> Callable[[ConvTensors], torch.Tensor]:
    """The plan's run, prepared from its first call's operands and kept."""
    runner = plan.runner = plan.solver.prepare(plan.problem, tensors)
    plan.result_as_promised = getattr(runner, "result_strides", None) == plan.result_strides
    if plan.result_as_promised and not (plan.copy_first or plan.copy_second):
        plan.keeping_columns = getattr(runner, "keeping_columns", None)
    return runner


def _without_autocast(plan: Plan, fn: Callable, *arguments: object):
    """``fn(*arguments)`` with autocast off on the plan's device. Autocast would re-cast
    the GEMMs inside a solver (and undo their fp32 accumulation); the operands were
    already cast before the op, as for F.conv*. Callers first ask whether autocast is
    on for any device, one C call.

    The device's flag is switched directly: ``torch.autocast(..., enabled=False)``
    does the same plus checks and cache bookkeeping that cost 3.3 us a call on the
    CPU machine against 0.6, on every convolution of a model trained under autocast."""
    device_type = plan.problem.device_type
    if not torch.is_autocast_enabled(device_type):
        return fn(*arguments)
    torch.set_autocast_enabled(device_type, False)
    try:
        return fn(*arguments)
    finally:
        torch.set_autocast_enabled(device_type, True)


def _run(plan: Plan, tensors: ConvTensors) -> torch.Tensor:
    """The plan's run on ``tensors``, its result with the strides promised: a view
    where the solver's is one (the forward and the backward ops take as_base; a
    gradient the eager road's backward hands autograd needs no base)."""
    runner = plan.runner
    if runner is None:
        runner = _prepared_runner(plan, tensors)
    if _any_autocast_enabled():
        result = _without_autocast(plan, runner, tensors)
    else:
        result = runner(tensors)
    if plan.result_as_promised:
        return result
    return _as_promised(result, plan.result_layout, plan.result_strides)


# ---- forward ----------------------------------------------------------------


def forward_plan(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> Plan:
    key = (
        input.shape,
        input.stride(),
        weight.shape,
        weight.stride(),
        bias is None,
        input.dtype,
        input.device.type,
        tuple(stride),
        tuple(padding),
        tuple(dilation),
        groups,
        dispatch.selection_key(),
    )

    def build() -> tuple[ConvProblem, Layout, Sequence[int]]:
        problem = ConvProblem.from_tensors(input, weight, bias, stride, padding, dilation, groups)
        shape = problem.output_shape
        if problem.c == 0:
            shape = (shape[0], 0, *shape[2:])  # as the fake implementation says
        arguments = (stride, padding, dilation, groups)
        layout = forward_output_layout(input, weight, bias, shape, *arguments)
        return problem, layout, shape

    return _plan(key, input, weight, build)


def run_forward(
    plan: Plan, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    keeping = plan.keeping_columns
    if keeping is not None and not _any_autocast_enabled():
        y = keeping(input, weight, bias)[0]  # three frames fewer than _run's way
    else:
        if plan.copy_first or plan.copy_second:
            input, weight = _operands(plan, input, weight)
        y = _run(plan, ConvTensors(input, weight, bias))
    if y._is_view() and not _is_grad_enabled():  # as_base, inline
        return y.detach()
    return y


def run_forward_keeping_columns(
    plan: Plan, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y, and the column matrix its GEMM read where the plan's prepared run keeps one
    (ColumnKeepingForward; None otherwise), for weight_gradient_from_columns."""
    keeping = plan.keeping_columns
    if keeping is not None and not _any_autocast_enabled():
        y, columns = keeping(input, weight, bias)
        return as_base(y), columns
    if plan.copy_first or plan.copy_second:
        input, weight = _operands(plan, input, weight)
    runner = plan.runner
    if runner is None:
        runner = _prepared_runner(plan, ConvTensors(input, weight, bias))
    keep = getattr(runner, "keeping_columns", None)
    if keep is None:
        return as_base(_run(plan, ConvTensors(input, weight, bias))), None
    if _any_autocast_enabled():
        y, columns = _without_autocast(plan, keep, input, weight, bias)
    else:
        y, columns = keep(input, weight, bias)
    if plan.result_as_promised:
        return as_base(y), columns
    return as_base(_as_promised(y, plan.result_layout, plan.result_strides)), columns


def weight_gradient_from_columns(
    plan: Plan, grad_output: torch.Tensor, columns: torch.Tensor
) -> torch.Tensor:
    """dW of a forward ``plan``'s call from dY and the columns its forward kept."""
    if _any_autocast_enabled():
        return _without_autocast(plan, plan.runner.weight_gradient, grad_output, columns)
    return plan.runner.weight_gradient(grad_output, columns)


def forward(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *arguments: object
) -> torch.Tensor:
    """The forward convolution: what ``gemmconv::conv_forward`` computes. ``arguments``
    are stride, padding, dilation and groups (the op's schema), as forward_plan takes
    them."""
    plan = forward_plan(input, weight, bias, *arguments)
    return run_forward(plan, input, weight, bias)


conv_forward = torch.library.custom_op(
    "gemmconv::conv_forward", forward, mutates_args=(), schema=_FORWARD_SCHEMA
)


@conv_forward.register_fake
def _(input, weight, bias, stride, padding, dilation, groups):
    # Under dynamo gemmconv.functional checks only the arguments' kinds; what they and
    # the tensors must agree on is checked here, where dynamo guards nothing it reads.
    args = ConvArgs(tuple(stride), tuple(padding), tuple(dilation), groups)
    check_against_tensors(len(stride), input, weight, bias, args)
    spatial = _output_spatial(input.shape[2:], weight.shape[2:], stride, padding, dilation)
    # torch gives a zero-channel input a zero-channel output, whatever the weight's
    # output channels (its meta kernel says so too).
    channels = 0 if input.shape[1] == 0 else weight.shape[0]
    shape = (input.shape[0], channels, *spatial)
    layout = forward_output_layout(input, weight, bias, shape, stride, padding, dilation, groups)
    return empty_in(shape, layout, input.dtype, input.device)


# ---- the backward directions --------------------------------------------------


def backward_plan(
    direction: Direction,
    grad_output: torch.Tensor,
    operand: torch.Tensor,
    result_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    channels_last: bool,
) -> Plan:
    """The plan of a backward direction: ``operand`` is the weight (backward-data,
    ``result_size`` the input's) or the input (backward-weights, the weight's)."""
    key = (
        direction,
        grad_output.shape,
        grad_output.stride(),
        operand.shape,
        operand.stride(),
        grad_output.dtype,
        grad_output.device.type,
        tuple(result_size),
        tuple(stride),
        tuple(padding),
        tuple(dilation),
        groups,
        channels_last,
        dispatch.selection_key(),
    )

    def build() -> tuple[ConvProblem, Layout, Sequence[int]]:
        layout = _layout(channels_last)
        data = direction is Direction.BACKWARD_DATA
        input_size, weight_size = (
            (result_size, operand.shape) if data else (operand.shape, result_size)
        )
        problem = ConvProblem.from_sizes(
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
        if data:
            dims, dtype, device_type = problem.dims, problem.dtype, problem.device_type
            problem = problem.with_direction(direction)
            return problem, output_layout(layout, dims, dtype, device_type), result_size
        # The weight gradient gathers x in x's own memory order.
        problem = dataclasses.replace(
            problem, direction=direction, input_layout=input_layout_of(operand)
        )
        return problem, layout, result_size

    return _plan(key, grad_output, operand, build)


def run_backward(plan: Plan, grad_output: torch.Tensor, operand: torch.Tensor) -> torch.Tensor:
    if plan.copy_first or plan.copy_second:
        grad_output, operand = _operands(plan, grad_output, operand)
    if plan.problem.direction is Direction.BACKWARD_DATA:
        return _run(plan, ConvTensors(grad_output=grad_output, weight=operand))
    return _run(plan, ConvTensors(grad_output=grad_output, input=operand))


def _backward_implementation(direction: Direction) -> Callable[..., torch.Tensor]:
    """What a backward op computes: dx (``operand`` the weight, ``result_size`` the
    input's) or dw (``operand`` the input, ``result_size`` the weight's)."""

    def implementation(
        grad_output: torch.Tensor, operand: torch.Tensor, *arguments: object
    ) -> torch.Tensor:
        # arguments: result_size, stride, padding, dilation, groups, channels_last (the
        # op's schema), as backward_plan takes them.
        plan = backward_plan(direction, grad_output, operand, *arguments)
        # The op's result is an output of its autograd formula where it is differentiated
        # (double backward): in-place ops on it need a base, as on the forward's.
        return as_base(run_backward(plan, grad_output, operand))

    implementation.__name__ = direction.value
    return implementation


backward_data = _backward_implementation(Direction.BACKWARD_DATA)
backward_weights = _backward_implementation(Direction.BACKWARD_WEIGHTS)


conv_backward_data = torch.library.custom_op(
    "gemmconv::conv_backward_data", backward_data, mutates_args=(), schema=_BACKWARD_DATA_SCHEMA
)


@conv_backward_data.register_fake
def _(grad_output, weight, input_size, stride, padding, dilation, groups, channels_last):
    layout = output_layout(
        _layout(channels_last), len(input_size) - 2, grad_output.dtype, grad_output.device.type
    )
    return empty_in(input_size, layout, grad_output.dtype, grad_output.device)


conv_backward_weights = torch.library.custom_op(
    "gemmconv::conv_backward_weights",
    backward_weights,
    mutates_args=(),
    schema=_BACKWARD_WEIGHTS_SCHEMA,
)


@conv_backward_weights.register_fake
def _(grad_output, input, weight_size, stride, padding, dilation, groups, channels_last):
    return empty_in(weight_size, _layout(channels_last), grad_output.dtype, grad_output.device)


OPS = (conv_forward, conv_backward_data, conv_backward_weights)
