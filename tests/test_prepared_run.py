"""Prepared runs (Solver.prepare) as eager calls meet them: the plan keeps one, views
are replayed at each call's own storage offset, and nothing of the weight is kept from
one call to the next. Bit-for-bit agreement with each solver's own run is checked for
every solver case by the solver matrix (solver_cases.check_prepared)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import gemmconv
from gemmconv import eager
from gemmconv.solvers.views import ViewRecipe, meta_like, rows_view


def test_a_view_recipe_replays_the_view_at_each_tensors_own_offset():
    base = torch.randn(3, 5, 4, 4).to(memory_format=torch.channels_last)
    recipe = ViewRecipe(rows_view(meta_like(base)), meta_like(base))
    buffer = torch.randn(2 * base.numel())
    shifted = buffer[7 : 7 + base.numel()].view(3, 4, 4, 5).permute(0, 3, 1, 2)
    for t in (base, shifted):
        assert torch.equal(recipe(t), t.movedim(1, -1).reshape(-1, 5))


@pytest.mark.parametrize(
    ("solver", "kernel"), [("patch", 2), ("point_output", 6), ("patch_padded", 3), ("pointwise", 1)]
)
def test_an_eager_call_keeps_its_solvers_prepared_run(solver, kernel, monkeypatch):
    monkeypatch.setenv("GEMMCONV_SOLVER", solver)
    x = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)
    w = torch.randn(8, 3, kernel, kernel)
    y = gemmconv.conv2d(x, w, stride=kernel)
    torch.testing.assert_close(y, F.conv2d(x, w, stride=kernel))
    plans = [call.plan for call in eager._calls.values() if call is not None]
    assert [plan.solver.id for plan in plans] == [solver]
    runner = plans[0].runner
    assert runner is not None and not isinstance(runner, functools.partial)


def test_a_solver_without_a_prepared_run_runs_itself(monkeypatch):
    monkeypatch.setenv("GEMMCONV_SOLVER", "im2col")
    x, w = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)
    torch.testing.assert_close(gemmconv.conv2d(x, w, padding=1), F.conv2d(x, w, padding=1))
    (plan,) = [call.plan for call in eager._calls.values() if call is not None]
    assert isinstance(plan.runner, functools.partial) and plan.runner.func == plan.solver.run


@pytest.mark.parametrize("update", ["in_place", "through_data"])
def test_a_weight_changed_between_calls_is_read_afresh(update, monkeypatch):
    """A channels-last input with a channels-first weight needs the weight's rows
    permuted (a copy): each call makes it again, so an update that moves no version
    counter (through ``.data``) is seen as well as one that does."""
    monkeypatch.setenv("GEMMCONV_SOLVER", "patch")
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    w = torch.nn.Parameter(torch.randn(6, 3, 4, 4))
    with torch.no_grad():
        gemmconv.conv2d(x, w, stride=4)
        if update == "in_place":
            w.mul_(-2.0)
        else:
            w.data.mul_(-2.0)
        torch.testing.assert_close(gemmconv.conv2d(x, w, stride=4), F.conv2d(x, w, stride=4))


def test_operands_at_an_offset_in_their_storage(monkeypatch):
    monkeypatch.setenv("GEMMCONV_SOLVER", "patch")
    storage = torch.randn(5, 3, 8, 8)
    x, w = storage[1:3], torch.randn(6, 3, 4, 4)
    gemmconv.conv2d(storage[:2], w, stride=4)  # the plan, prepared at offset 0
    torch.testing.assert_close(gemmconv.conv2d(x, w, stride=4), F.conv2d(x, w, stride=4))
    x = x.detach().requires_grad_()
    (dx,) = torch.autograd.grad(gemmconv.conv2d(x, w, stride=4).sum(), x)
    (ref,) = torch.autograd.grad(F.conv2d(x, w, stride=4).sum(), x)
    torch.testing.assert_close(dx, ref)
