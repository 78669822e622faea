"""What users pay: the wall clock of the public call, for torch, the rewrite and gemmconv.

For one convolution problem and one kind of call, three implementations are built as a
user would call them:
- ``torch``:    torch.nn.functional.conv1d/2d/3d (cuDNN on CUDA);
- ``linear``:   the reshape + F.linear rewrite serving frameworks use (only for problems
                with stride == kernel, no padding, unit dilation, groups 1), as
                gemmconv.bench.linear_patch_embed writes it, its gradients through autograd;
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

Timing is gemmconv.measuring.timing.time_interleaved: each repetition times a block of
back-to-back calls of one implementation with nothing ahead of them, so the host's
launch work is paid as a user pays it; the implementations are interleaved in one
run; the result is the median over repetitions. The operands are gemmconv.measuring.measure's
(every operand of the problem, dY in the output's layout); on CUDA the calls rotate
over several operand sets, together at least twice the L2 cache where 8 sets reach
that, so the cache does not flatter them.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

import gemmconv
from gemmconv.bench.kernel_count import launched_kernels
from gemmconv.bench.linear_patch_embed import linear_patch_embed, patch_orders
from gemmconv.core.problem import ConvProblem, Direction
from gemmconv.measuring.measure import operand_sets
from gemmconv.measuring.timing import time_interleaved
from gemmconv.selection import dispatch
from gemmconv.solvers import ConvTensors

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

Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def linear_applies(p: ConvProblem) -> bool:
    """Whether the reshape + F.linear rewrite computes this convolution."""
    return (
        p.stride == p.kernel
        and not any(p.padding)
        and all(d == 1 for d in p.dilation)
        and p.groups == 1
    )


def _functional(conv: Callable, p: ConvProblem) -> Forward:
    def forward(x, w, b):
        return conv(x, w, b, p.stride, p.padding, p.dilation, p.groups)

    return forward


def _public_call(forward: Forward, kind: str, t: ConvTensors) -> Callable[[], object]:
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
    p: ConvProblem, kind: str, operands: Sequence[ConvTensors]
) -> dict[str, list[Callable[[], object]]]:
    """Per implementation, the call of ``kind`` on each operand set (every operand of
    the problem: ``measure.operand_sets(..., every_operand=True)``); ``linear`` only
    where the rewrite applies."""
    if kind not in CALL_KINDS:
        raise ValueError(f"kind={kind!r}: expected one of {', '.join(CALL_KINDS)}")
    # The rewrite as a framework writes it (linear_patch_embed): the general helpers
    # of linear_rewrite build a problem's views in Python on every call, which
    # measured 35 us a call against 24 for linear_patch_embed on the CPU machine.
    orders = patch_orders(p.dims)

    def linear(x, w, b):
        return linear_patch_embed(x, w, b, p.kernel, orders)

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


def solvers_of(p: ConvProblem, t: ConvTensors) -> dict[str, str]:
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
    block_ms: float | None = None,
    find: bool = False,
) -> dict[str, float | str | None]:
    """The suite's user-facing columns for one row: ``api_ms`` (gemmconv),
    ``vendor_api_ms`` (torch) and ``linear_api_ms`` (the rewrite; None where it does
    not apply), each the median ms per call of the public call of ``kind`` (default:
    the problem's direction), measured side by side in one run, in blocks of about
    ``block_ms`` (default: timing.DEFAULT_BLOCK_MS). With ``find``, also
    ``find_api_ms``: gemmconv's public call in find mode, after find has run (its
    finds stored in a database of their own, so no later call in the default mode
    reads them), timed in the same run, and ``find_api_solver``, find's pick for the
    problem (None where the call did not decide it: the vendor's road)."""
    device = torch.device(device)
    kind = kind or DIRECTION_KINDS[p.direction]
    operands = operand_sets(p, device, seed, every_operand=True)
    calls = public_calls(p, kind, operands)
    settings = {}
    picked = None
    if find:
        with tempfile.TemporaryDirectory(prefix="gemmconv-find-") as folder:
            path = os.path.join(folder, "find.sqlite")

            def finding() -> contextlib.AbstractContextManager:
                return find_selection(path)

            # The first build and call find the problem's directions (building a
            # backward call's graph runs its forward; its first call the backward). A
            # graph kept from that build would replay what the trials left (a forward
            # that kept no columns for dW, say), which no user's next step replays, so
            # the timed calls are built again once find has decided.
            with finding():
                for call in public_calls(p, kind, operands)["gemmconv"]:
                    call()
                calls["gemmconv_find"] = public_calls(p, kind, operands)["gemmconv"]
            settings["gemmconv_find"] = finding
            times = _interleaved_twice(calls, device, reps, warmup, block_ms, settings)
            with finding():
                choice = dispatch.decided(p)
            picked = None if choice is None else choice.solver
    else:
        times = _interleaved_twice(calls, device, reps, warmup, block_ms, settings)
    columns: dict[str, float | str | None] = {
        "api_ms": times["gemmconv"].median_ms,
        "vendor_api_ms": times["torch"].median_ms,
        "linear_api_ms": times["linear"].median_ms if "linear" in times else None,
    }
    if find:
        columns["find_api_ms"] = times["gemmconv_find"].median_ms
        columns["find_api_solver"] = picked
    return columns


def _interleaved_twice(calls, device, reps, warmup, block_ms, settings) -> dict:
    # One interleaved round is timed and thrown away first: on the H200 the first
    # blocks after a row's operands are made ran up to 2.5x slow for every
    # implementation alike (clocks and the allocator settling).
    time_interleaved(calls, device, reps=1, warmup=warmup, block_ms=block_ms, settings=settings)
    return time_interleaved(
        calls, device, reps=reps, warmup=0, block_ms=block_ms, settings=settings
    )


@contextlib.contextmanager
def find_selection(database: str) -> Iterator[None]:
    """gemmconv's find mode, its finds stored in the find database at ``database``."""
    saved = os.environ.get("GEMMCONV_DB")
    os.environ["GEMMCONV_DB"] = database
    try:
        with dispatch.find_mode("find"):
            yield
    finally:
        if saved is None:
            del os.environ["GEMMCONV_DB"]
        else:
            os.environ["GEMMCONV_DB"] = saved


def public_call_kernels(
    p: ConvProblem, device: torch.device | str, seed: int = 0
) -> list[str] | None:
    """The device kernels, by name, one gemmconv public call of the problem's direction
    launches (kernel_count.launched_kernels) on operands made from ``seed``, after one
    call that builds its plan and compiles its kernels; None off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    operands = operand_sets(p, device, seed, every_operand=True)[:1]
    call = public_calls(p, DIRECTION_KINDS[p.direction], operands)["gemmconv"][0]
    call()
    return launched_kernels(call, device)


__all__ = [
    "CALL_KINDS",
    "IMPLEMENTATIONS",
    "api_times",
    "find_selection",
    "linear_applies",
    "public_call_kernels",
    "public_calls",
    "solvers_of",
]
