"""Find's candidates in the call users make: the public call of a problem's direction on
the eager road, with one candidate tried for the problem (dispatch.trial).

Find decides on what a call costs. Timed bare, a candidate's run lacks what the public
call adds around it: the eager road's lookup, gemmconv's autograd node for a backward
direction, or torch's own convolution with its fused backward where the training road
sends the call (the vendor's candidate, where every other direction the call counts
chose the vendor too), and the copies that give a result the layout torch gives it. On
the H100 find's picks made three of seven probed public calls slower than immediate's
(issue 44: 0.549 against 0.418 ms, 0.217 against 0.091). Timed here, each candidate
runs inside that call, as the suite's rows time users' calls
(gemmconv.bench.call_timing): a forward under no_grad; a backward direction as one
``torch.autograd.grad`` of a graph built once, only that direction's operand requiring
grad, every other direction decided as the selection state decides it.

Importing this module gives dispatch the builder (gemmconv.functional imports it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator

import torch

from gemmconv.core.problem import ConvProblem, Direction
from gemmconv.measuring import measure
from gemmconv.roads import eager
from gemmconv.roads.transform_state import transforms_active
from gemmconv.selection import dispatch
from gemmconv.solvers import ConvTensors, Solver

log = logging.getLogger("gemmconv.find")


def road_open() -> bool:
    """Whether the eager road takes calls now (as eager.convolve asks): nothing traces,
    intercepts or transforms them."""
    return not (
        torch._C._is_tracing() or torch._C._len_torch_dispatch_stack() or transforms_active()
    )


def public_calls(problem: ConvProblem) -> measure.InCall | None:
    """For find on ``problem``: a function of a candidate giving a context in which its
    public calls run (one per operand set, every operand made as measure.operand_sets
    makes them), or None where the eager road is closed (find then times bare runs).
    A candidate whose call never reaches the problem (another problem decided) is
    timed bare, with a warning."""
    if not road_open():
        return None
    device = measure.problem_device(problem)
    with torch.inference_mode(False):
        sets = measure.operand_sets(problem, device, every_operand=True)
        if problem.direction is not Direction.FORWARD and _forward_has_bias(problem):
            # The user's forward has a bias (its problem is the one decided): the graph's
            # forward is that one, and the trial meets the choice the user's call met.
            for t in sets:
                t.bias = torch.zeros(problem.k, dtype=problem.dtype, device=device)

    # A backward direction's call decides its problem without the bias (as the eager
    # road's backward plans build it; explain() asks with the forward's bias kept).
    met = problem
    if problem.direction is not Direction.FORWARD:
        met = dataclasses.replace(problem, has_bias=False)

    @contextlib.contextmanager
    def tried(solver: Solver) -> Iterator[measure.PublicCalls | None]:
        with dispatch.trial(met, solver.id) as number:
            calls = [public_call(problem, t) for t in sets]
            reached = all(c is not None for c in calls) and calls[0]() is not None
            if reached and dispatch.trial_hits(number) == 0:
                log.warning(
                    "find %s: the public call did not reach the problem; %s timed bare",
                    problem.key(),
                    solver.id,
                )
                reached = False
            resumed = functools.partial(dispatch.resume_trial, met, solver.id, number)
            yield measure.PublicCalls(calls, resumed) if reached else None

    return tried


def _forward_has_bias(problem: ConvProblem) -> bool:
    """Whether the forward of a backward direction's ``problem`` (which holds no bias)
    was decided with a bias and not without: the forward a user's call made."""
    forward = dataclasses.replace(problem, direction=Direction.FORWARD)
    with_bias = dataclasses.replace(forward, has_bias=True)
    return dispatch.decided(with_bias) is not None and dispatch.decided(forward) is None


def public_call(problem: ConvProblem, t: ConvTensors) -> Callable[[], object] | None:
    """The call of the problem's direction a user makes on the eager road (the kinds of
    gemmconv.bench.call_timing); None where the road does not take it."""
    dims = problem.dims
    arguments = (problem.stride, problem.padding, problem.dilation, problem.groups)
    if problem.direction is Direction.FORWARD:
        x, w, b = t.input, t.weight, t.bias

        def forward() -> object:
            with torch.no_grad():
                return eager.convolve(dims, x, w, b, *arguments)

        return forward
    data = problem.direction is Direction.BACKWARD_DATA
    with torch.inference_mode(False), torch.enable_grad():
        x = t.input.detach().requires_grad_(data)
        w = t.weight.detach().requires_grad_(not data)
        y = eager.convolve(dims, x, w, t.bias, *arguments)  # the graph, built once
    if y is None:
        return None
    wrt, dy = (x if data else w), t.grad_output

    def backward() -> object:
        return torch.autograd.grad(y, wrt, dy, retain_graph=True)

    return backward


dispatch.set_public_calls(public_calls)

__all__ = ["public_call", "public_calls", "road_open"]
