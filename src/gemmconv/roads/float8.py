"""How a convolution configured for fp8 reaches the fp8 run (solvers/float8.py).

A ``gemmconv.nn`` module given a ``Float8Config`` asks ``decision``: where fp8
applies (a patch, point-output or 1x1 problem in fp16/bf16/fp32 on a CUDA device of
compute capability 8.9 or later) the answer is a ``Float8Run`` and ``convolve`` runs
it through ``Float8Convolution``, an autograd.Function of torch ops that dynamo
traces (torch.compile); otherwise it is the list of reasons, and the caller runs the
ordinary path. The decision is kept per operand metadata, as the eager road keeps
its plans, and is a constant to torch.compile.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses

import torch
from torch.fx.experimental.symbolic_shapes import guard_scalar

from gemmconv.core.arguments import resolve_arguments
from gemmconv.core.float8 import Float8Config, device_reasons
from gemmconv.core.problem import ConvProblem
from gemmconv.solvers.float8 import Float8Run, problem_reasons


class Float8Convolution(torch.autograd.Function):
    """y = conv(x, w) + bias with fp8 GEMMs in each direction. The backward re-quantizes
    x from the saved tensors with the forward's scale (tensorwise), so what it keeps of
    x is what the model holds anyway, not an fp8 copy; of the weight it keeps the
    forward's fp8 copy where backward-data transposes it (Float8Run.weight_for_backward:
    K x ld bytes, in place of three casting calls)."""

    @staticmethod
    def forward(ctx, x, weight, bias, run: Float8Run):  # type: ignore[override]
        with _autocast_off(x):
            y, ((sx, inv_x), (sw, inv_w)), wq = run.forward(x, weight, bias)
        ctx.run = run
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight, sx, inv_x, sw, inv_w, run.weight_for_backward(wq))
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, weight, sx, inv_x, sw, inv_w, wq = ctx.saved_tensors
        run: Float8Run = ctx.run
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        with _autocast_off(dy):
            # dY's amax is taken once for both GEMMs (tensorwise).
            dy_scales = run.gradient_scales(dy) if need_dx and need_dw else None
            dx = run.backward_data(dy, weight, (sw, inv_w), dy_scales, wq) if need_dx else None
            dw = run.backward_weights(dy, x, (sx, inv_x), weight, dy_scales) if need_dw else None
            db = run.backward_bias(dy) if need_db and ctx.has_bias else None
        return dx, dw, db, None


def _autocast_off(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Autocast off for the run: its operands are cast already (as autocast casts a
    convolution's), and autocast would recast its reductions and scales."""
    device_type = t.device.type
    if device_type == "meta" or not torch.is_autocast_enabled(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


# Decisions made while torch.compile traces: operand metadata and arguments -> the
# index of the run in _RUNS, or the reasons fp8 does not apply. torch.compile takes the
# decision as a constant and reads the run from _RUNS (a global it can guard), so these
# are never dropped; dynamo's recompile limit bounds them.
_DECISIONS: dict[tuple, int | tuple[str, ...]] = {}
_RUNS: list[Float8Run] = []
# Eager calls' decisions, the least recently used dropped past EAGER_DECISIONS: a
# server whose batch (Qwen-VL's patch count) differs on every request would otherwise
# keep one run per batch size for ever.
EAGER_DECISIONS = 1024
_EAGER: collections.OrderedDict[tuple, Float8Run | tuple[str, ...]] = collections.OrderedDict()


@torch.compiler.assume_constant_result
def _decision_index(
    dims: int,
    input_shape: tuple[int, ...],
    input_strides: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    weight_shape: tuple[int, ...],
    weight_strides: tuple[int, ...],
    weight_dtype: torch.dtype,
    bias_dtype: torch.dtype | None,
    stride: object,
    padding: object,
    dilation: object,
    groups: object,
    config_fields: tuple,
) -> int | tuple[str, ...]:
    """The index in _RUNS of the fp8 run of a call with operands of this metadata (a
    batched input, or an unbatched one), or why fp8 does not apply; raises F.conv*'s
    errors for a call torch would refuse. Kept per metadata; a constant to
    torch.compile, which calls it while tracing from the metadata alone. The config
    comes as its fields: torch 2.11's dynamo cannot hand a frozen dataclass instance to
    such a function ("can't reconstruct arbitrary frozen dataclass instances")."""
    key = _key(dims, input_shape, input_strides, dtype, device, weight_shape, weight_strides,
               weight_dtype, bias_dtype, stride, padding, dilation, groups,
               Float8Config(*config_fields))  # fmt: skip
    found = _DECISIONS.get(key)
    if found is None:
        decided = _decide(*key)
        if isinstance(decided, Float8Run):
            _RUNS.append(decided)
            found = len(_RUNS) - 1
        else:
            found = tuple(decided)
        _DECISIONS[key] = found
    return found


def _decide(
    dims, input_shape, input_strides, dtype, device, weight_shape, weight_strides,
    weight_dtype, bias_dtype, stride, padding, dilation, groups, config,
) -> Float8Run | list[str]:  # fmt: skip
    def meta(shape, strides, dtype):
        return torch.empty_strided(shape, strides, dtype=dtype, device="meta")

    input = meta(input_shape, input_strides, dtype)
    weight = meta(weight_shape, weight_strides, weight_dtype)
    bias = None if bias_dtype is None else meta((weight_shape[0],), (1,), bias_dtype)
    args = resolve_arguments(dims, input, weight, bias, stride, padding, dilation, groups)
    if input.dim() == dims + 1:
        input = input.unsqueeze(0)
    problem = ConvProblem.from_tensors(
        input, weight, bias, args.stride, args.padding, args.dilation, args.groups
    )
    problem = dataclasses.replace(problem, device_type=device.type)
    reasons = device_reasons(device) + problem_reasons(problem)
    if args.input_padding:
        reasons.append(f"padding 'same' pads the input first ({args.input_padding})")
    if weight_dtype != dtype or (bias_dtype is not None and bias_dtype != dtype):
        reasons.append(
            f"operand dtypes differ (input {dtype}, weight {weight_dtype}"
            + ("" if bias_dtype is None else f", bias {bias_dtype}")
            + ")"
        )
    return reasons if reasons else Float8Run(problem, config)


def _key(
    dims, input_shape, input_strides, dtype, device, weight_shape, weight_strides,
    weight_dtype, bias_dtype, stride, padding, dilation, groups, config,
) -> tuple:  # fmt: skip
    """A decision's key, in _decide's argument order: sizes and strides as tuples, and
    F.conv*'s stride, padding, dilation and groups hashable (lists as tuples, a 0-d
    tensor, which a call reads anew each time, by its value, not its identity)."""

    def hashable(value: object) -> object:
        if isinstance(value, torch.Tensor):
            return value.tolist()
        if isinstance(value, (list, tuple)):
            return tuple(hashable(v) for v in value)
        return value

    return (dims, tuple(input_shape), tuple(input_strides), dtype, device,
            tuple(weight_shape), tuple(weight_strides), weight_dtype, bias_dtype,
            *(hashable(a) for a in (stride, padding, dilation, groups)), config)  # fmt: skip


def _ints(values) -> tuple[int, ...]:
    """Sizes or strides as plain ints. Under torch.compile with dynamic shapes (a second
    batch size makes dynamo's sizes symbolic) guard_scalar specializes the graph on
    them: the fp8 run's reshapes are planned from concrete sizes, so each new shape
    compiles its own graph, where a symbolic size made the decision untraceable."""
    if not torch.compiler.is_compiling():
        return tuple(values)
    return tuple(guard_scalar(v) for v in values)


def decision_of(
    dims: int,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: object,
    padding: object,
    dilation: object,
    groups: object,
    config: Float8Config,
) -> Float8Run | list[str]:
    """The fp8 run of a call with these operands (F.conv*'s arguments, after autocast),
    or the reasons fp8 does not apply."""
    if not torch.compiler.is_compiling():
        return _eager_decision(dims, input, weight, bias, stride, padding, dilation, groups,
                               config)  # fmt: skip
    found = _decision_index(
        dims, _ints(input.shape), _ints(input.stride()), input.dtype, input.device,
        _ints(weight.shape), _ints(weight.stride()), weight.dtype,
        None if bias is None else bias.dtype, stride, padding, dilation, groups,
        (config.forward_dtype, config.grad_dtype, config.scaling,
         config.round_scales_to_power_of_2),
    )  # fmt: skip
    return _RUNS[found] if isinstance(found, int) else list(found)


def _eager_decision(
    dims, input, weight, bias, stride, padding, dilation, groups, config
) -> Float8Run | list[str]:  # fmt: skip
    key = _key(dims, input.shape, input.stride(), input.dtype, input.device, weight.shape,
               weight.stride(), weight.dtype, None if bias is None else bias.dtype, stride,
               padding, dilation, groups, config)  # fmt: skip
    found = _EAGER.get(key)
    if found is None:
        decided = _decide(*key)
        found = decided if isinstance(decided, Float8Run) else tuple(decided)
        _EAGER[key] = found
        if len(_EAGER) > EAGER_DECISIONS:
            _EAGER.popitem(last=False)
    else:
        _EAGER.move_to_end(key)
    return found if isinstance(found, Float8Run) else list(found)


def convolve(
    run: Float8Run, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The fp8 convolution; an autograd node only where some operand needs a gradient."""
    if torch.is_grad_enabled() and (
        input.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        return Float8Convolution.apply(input, weight, bias, run)
    with _autocast_off(input):
        return run.forward(input, weight, bias)[0]


def explanation_note(
    config: Float8Config, decision: Float8Run | list[str], where: str = "this call"
) -> str:
    """The line explain() and module.solvers() add: whether fp8 runs, and why not."""
    if isinstance(decision, Float8Run):
        return (
            f"fp8: {where} runs all three directions as fp8 GEMMs (torch._scaled_mm, "
            f"fp32 accumulation; {config.describe()}) in place of the solvers above."
        )
    return (
        f"fp8 is configured ({config.describe()}) but does not apply to {where}: "
        + "; ".join(decision)
        + ". It runs the solvers above."
    )


def clear_decisions() -> None:
    """Forget every decision (runs stay, for compiled code that holds one)."""
    _DECISIONS.clear()
    _EAGER.clear()


__all__ = [
    "Float8Convolution",
    "clear_decisions",
    "convolve",
    "decision_of",
    "explanation_note",
]
