"""What users pay: the wall clock of the public call, for torch, the rewrite and gemmconv.

For one convolution problem and one kind of call, three implementations are built as a
user would call them:
- ``torch``:    torch.nn.functional.conv1d/2d/3d (cuDNN on CUDA);
- ``linear``:   the reshape + F.linear rewrite serving frameworks use (only for problems
                with stride == kernel, no padding, unit dilation, groups 1), its
                gradients through autograd;
- ``gemmconv``: gemmconv.conv1d/2d/3d, the public functional call.

Kinds of call (``CALL_KINDS``):
- ``fwd``:          the forward under torch.no_grad();
- ``bwd_data``:     ``torch.autograd.grad(y, x, dy, retain_graph=True)`` of a graph built
                    once, the input requiring grad and the weight not;
- ``bwd_weights``:  the same with respect to the weight, the input not requiring grad;
- ``fwd_bwd``:      forward then the gradients of input, weight (and bias): a layer in
                    the middle of a network being trained;
- ``fwd_wgrad``:    forward then the gradients of weight (and bias) only: a patch embed
                    being trained, its pixels needing no gradient.

Timing: each repetition times ``k`` back-to-back calls of one implementation and
divides by ``k``; nothing runs ahead of them (the device is idle when the first is
launched, no spin kernel) and nothing synchronises between them, so the host's
launch work is paid as a user pays it. On CUDA the block is bracketed by two events,
on the CPU by time.perf_counter. The implementations are interleaved repetition by
repetition (their order rotating) in one run; the result is the median over
repetitions. On CUDA the calls rotate over several operand sets, together at least
twice the L2 cache where 8 sets reach that, so the cache does not flatter them.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

import gemmconv
from gemmconv.bench import rewrite_fn
from gemmconv.memory_format import empty_in, output_layout
from gemmconv.problem import ConvProblem, Direction
from gemmconv.solvers import ConvTensors
from gemmconv.timing import Timing

CALL_KINDS = ("fwd", "bwd_data", "bwd_weights", "fwd_bwd", "fwd_wgrad")
IMPLEMENTATIONS = ("torch", "linear", "gemmconv")
# The kinds of call a suite direction is measured as.
DIRECTION_KINDS = {
    Direction.FORWARD: "fwd",
    Direction.BACKWARD_DATA: "bwd_data",
    Direction.BACKWARD_WEIGHTS: "bwd_weights",
}

_TORCH_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_GEMMCONV_CONV = {1: gemmconv.conv1d, 2: gemmconv.conv2d, 3: gemmconv.conv3d}

_MAX_OPERAND_SETS = 8
# A block of back-to-back calls lasts about this long (calls of one implementation
# per repetition, between these bounds).
_BLOCK_MS = {"cuda": 5.0, "cpu": 20.0}
_CALLS_PER_BLOCK = (1, 100)

Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def linear_applies(p: ConvProblem) -> bool:
    """Whether the reshape + F.linear rewrite computes this convolution."""
    return (
        p.stride == p.kernel
        and not any(p.padding)
        and all(d == 1 for d in p.dilation)
        and p.groups == 1
    )


@dataclasses.dataclass(frozen=True)
class Operands:
    """One set of operands, dense in the problem's layout; ``bias`` only with has_bias."""

    input: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    grad_output: torch.Tensor

    @property
    def nbytes(self) -> int:
        tensors = (self.input, self.weight, self.bias, self.grad_output)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def random_operands(p: ConvProblem, device: torch.device, seed: int) -> Operands:
    """Fresh seeded uniform(-1, 1) operands (never zeros); the output gradient in the
    layout F.conv* gives the output."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def uniform(shape, layout):
        return empty_in(shape, layout, p.dtype, device).uniform_(-1.0, 1.0, generator=gen)

    bias = None
    if p.has_bias:
        bias = torch.empty(p.k, dtype=p.dtype, device=device).uniform_(-1.0, 1.0, generator=gen)
    out_layout = output_layout(p.layout, p.dims, p.dtype, device.type)
    return Operands(
        input=uniform(p.input_shape, p.layout),
        weight=uniform(p.weight_shape, p.layout),
        bias=bias,
        grad_output=uniform(p.output_shape, out_layout),
    )


def _functional(conv: Callable, p: ConvProblem) -> Forward:
    def forward(x, w, b):
        return conv(x, w, b, p.stride, p.padding, p.dilation, p.groups)

    return forward


def _public_call(forward: Forward, kind: str, t: Operands) -> Callable[[], object]:
    """The call of ``kind`` a user makes, with ``forward`` as the convolution."""
    x, w, b, dy = t.input, t.weight, t.bias, t.grad_output
    if kind == "fwd":

        def call():
            with torch.no_grad():
                return forward(x, w, b)

        return call
    if kind in ("bwd_data", "bwd_weights"):
        x = x.detach().requires_grad_(kind == "bwd_data")
        w = w.detach().requires_grad_(kind == "bwd_weights")
        y = forward(x, w, b)  # the graph is built once and retained
        wrt = x if kind == "bwd_data" else w
        return lambda: torch.autograd.grad(y, wrt, dy, retain_graph=True)
    if kind in ("fwd_bwd", "fwd_wgrad"):
        x = x.detach().requires_grad_(kind == "fwd_bwd")
        w = w.detach().requires_grad_(True)
        b = None if b is None else b.detach().requires_grad_(True)
        wrt = tuple(v for v in (x, w, b) if v is not None and v.requires_grad)
        return lambda: torch.autograd.grad(forward(x, w, b), wrt, dy)
    raise ValueError(f"kind={kind!r}: expected one of {', '.join(CALL_KINDS)}")


def public_calls(
    p: ConvProblem, kind: str, operands: Sequence[Operands]
) -> dict[str, list[Callable[[], object]]]:
    """Per implementation, the call of ``kind`` on each operand set (``linear`` only
    where the rewrite applies)."""
    if kind not in CALL_KINDS:
        raise ValueError(f"kind={kind!r}: expected one of {', '.join(CALL_KINDS)}")
    forward_problem = p.with_direction(Direction.FORWARD)

    def linear(x, w, b):
        return rewrite_fn(forward_problem, ConvTensors(input=x, weight=w, bias=b))()

    forwards = {
        "torch": _functional(_TORCH_CONV[p.dims], p),
        "linear": linear if linear_applies(p) else None,
        "gemmconv": _functional(_GEMMCONV_CONV[p.dims], p),
    }
    return {
        name: [_public_call(forward, kind, t) for t in operands]
        for name, forward in forwards.items()
        if forward is not None
    }


def operand_sets(p: ConvProblem, device: torch.device, seed: int = 0) -> list[Operands]:
    """Enough operand sets that one pass over them overflows the L2 cache twice (on
    CUDA, at most 8 sets); one set on the CPU."""
    first = random_operands(p, device, seed)
    if device.type != "cuda":
        return [first]
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
    count = min(_MAX_OPERAND_SETS, max(1, math.ceil(2 * l2 / max(first.nbytes, 1))))
    return [first] + [random_operands(p, device, seed + i) for i in range(1, count)]


def time_interleaved(
    calls: dict[str, Sequence[Callable[[], object]]],
    device: torch.device,
    *,
    reps: int,
    warmup: int = 2,
    calls_per_rep: int | None = None,
) -> dict[str, Timing]:
    """Per implementation, milliseconds per call: ``reps`` repetitions of back-to-back
    calls (rotating over its operand sets), implementations interleaved."""
    if reps < 1:
        raise ValueError(f"reps={reps}: expected at least 1")
    if warmup < 0:
        raise ValueError(f"warmup={warmup}: expected 0 or more")
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for fns in calls.values():
        for _ in range(warmup):
            for fn in fns:
                fn()
    block = {name: calls_per_rep or _calls_per_block(fns, device.type, sync)
             for name, fns in calls.items()}  # fmt: skip
    names = list(calls)
    marks: dict[str, list] = {name: [] for name in names}
    for rep in range(reps):
        shift = rep % len(names)  # rotate the order: no implementation always runs first
        for name in names[shift:] + names[:shift]:
            fns, k = calls[name], block[name]
            sync()  # the device is idle: no head start for the block
            if cuda:
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                for i in range(k):
                    fns[i % len(fns)]()
                end.record()
                marks[name].append((start, end))
            else:
                begin = time.perf_counter()
                for i in range(k):
                    fns[i % len(fns)]()
                marks[name].append((begin, time.perf_counter()))
    sync()
    result = {}
    for name in names:
        k = block[name]
        if cuda:
            samples = tuple(s.elapsed_time(e) / k for s, e in marks[name])
        else:
            samples = tuple((e - s) * 1000.0 / k for s, e in marks[name])
        result[name] = Timing.from_samples(samples)
    return result


def _calls_per_block(fns: Sequence[Callable[[], object]], device_type: str, sync) -> int:
    """Calls that fill a block of about _BLOCK_MS, from one synchronised pass."""
    sync()
    begin = time.perf_counter()
    for fn in fns:
        fn()
    sync()
    per_call_ms = (time.perf_counter() - begin) * 1000.0 / len(fns)
    low, high = _CALLS_PER_BLOCK
    return min(high, max(low, round(_BLOCK_MS[device_type] / max(per_call_ms, 1e-6))))


def solvers_of(p: ConvProblem, t: Operands) -> dict[str, str]:
    """The solver gemmconv chooses per direction for these operands (runs nothing in
    the immediate and database modes)."""
    choices = gemmconv.explain(t.input, t.weight, t.bias, p.stride, p.padding, p.dilation, p.groups)
    return {direction: choice.solver for direction, choice in choices.items()}


def api_times(
    p: ConvProblem,
    device: torch.device | str,
    kind: str | None = None,
    *,
    reps: int = 15,
    warmup: int = 2,
    seed: int = 0,
) -> dict[str, float | None]:
    """The suite's user-facing columns for one row: ``api_ms`` (gemmconv),
    ``vendor_api_ms`` (torch) and ``linear_api_ms`` (the rewrite; None where it does
    not apply), each the median ms per call of the public call of ``kind`` (default:
    the problem's direction), measured side by side in one run."""
    device = torch.device(device)
    kind = kind or DIRECTION_KINDS[p.direction]
    operands = operand_sets(p, device, seed)
    times = time_interleaved(public_calls(p, kind, operands), device, reps=reps, warmup=warmup)
    return {
        "api_ms": times["gemmconv"].median_ms,
        "vendor_api_ms": times["torch"].median_ms,
        "linear_api_ms": times["linear"].median_ms if "linear" in times else None,
    }


__all__ = [
    "CALL_KINDS",
    "IMPLEMENTATIONS",
    "Operands",
    "api_times",
    "linear_applies",
    "random_operands",
    "operand_sets",
    "public_calls",
    "solvers_of",
    "time_interleaved",
]
