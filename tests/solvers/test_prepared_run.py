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
from gemmconv.measuring.verify import rms_range, tolerance
from gemmconv.roads import eager
from gemmconv.selection import dispatch
from gemmconv.solvers.patch.prepared import ColumnKeepingForward
from gemmconv.solvers.views import ViewRecipe, meta_like, rows_view

from rows_in_place import force_in_place_on_cuda


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


@pytest.mark.parametrize("dy_layout", ["channels_first", "channels_last"])
@pytest.mark.parametrize("x_layout", ["channels_first", "channels_last"])
@pytest.mark.parametrize(
    ("solver", "kernel"), [("patch", 3), ("patch_padded", 3), ("point_output", 6)]
)
def test_a_weight_gradient_reuses_the_columns_its_forward_gathered(
    solver, kernel, x_layout, dy_layout, monkeypatch
):
    """The forward keeps the column matrix its GEMM (or per-sample batched GEMM) read,
    and the weight gradient is one GEMM on it: its plan is decided but never run. dW
    and db match float64, with uninitialised memory filled with NaN so an element left
    unwritten shows."""
    monkeypatch.setenv("GEMMCONV_SOLVER", solver)
    formats = {"channels_first": torch.contiguous_format, "channels_last": torch.channels_last}
    x = torch.randn(2, 3, 6, 6).to(memory_format=formats[x_layout])
    w = torch.randn(5, 3, kernel, kernel, requires_grad=True)
    b = torch.randn(5, requires_grad=True)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # empty tensors come filled with NaN
    try:
        y = gemmconv.conv2d(x, w, b, stride=kernel)
        dy = torch.randn(y.shape).to(memory_format=formats[dy_layout])
        saved = [t for t in y.grad_fn.saved_tensors if t is not None]
        dw, db = torch.autograd.grad(y, (w, b), dy)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    (call,) = [c for c in eager._calls.values() if c is not None]
    assert call.plan.solver.id == solver
    assert isinstance(call.plan.runner, ColumnKeepingForward)
    rows = y.shape[0] * y[0, 0].numel()
    assert any(t.dim() == 2 and t.shape[0] == rows for t in saved)
    # dW's solver is decided as always (the same column GEMM); it needs no plan.
    assert call.columns_serve_weight_gradient() and call._backward_plans == ({}, {})
    leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
    ref = torch.autograd.grad(F.conv2d(*leaves, stride=kernel), leaves[1:], dy.double())
    for mine, theirs in zip((dw, db), ref):
        assert rms_range(mine, theirs) <= tolerance(torch.float32, "cpu")
    assert dw.is_contiguous(memory_format=formats[x_layout])


def test_a_channels_first_dy_reaches_the_column_gemm_through_the_transpose_kernel(monkeypatch):
    """Where the transpose kernel runs (CUDA; here Triton's interpreter, made to apply
    on the CPU), the forward's columns meet a dense channels-first dY copied to rows
    by it rather than by torch: the same dW, bit for bit."""
    from gemmconv.solvers.patch import rows_path

    monkeypatch.setenv("GEMMCONV_SOLVER", "patch")
    x = torch.randn(3, 3, 6, 6)
    w = torch.randn(5, 3, 3, 3, requires_grad=True)
    dy = torch.randn(3, 5, 2, 2)
    (by_torch,) = torch.autograd.grad(gemmconv.conv2d(x, w, stride=3), w, dy)
    transposed, by_transpose_kernel = [], rows_path.channels_first_rows

    def spy(t):
        transposed.append(t.shape)
        return by_transpose_kernel(t)

    monkeypatch.setattr(rows_path, "transpose_kernel_runs", lambda p: True)
    monkeypatch.setattr(rows_path, "channels_first_rows", spy)
    dispatch.clear_cache()  # plans are made afresh, with the transpose kernel
    (by_kernel,) = torch.autograd.grad(gemmconv.conv2d(x, w, stride=3), w, dy)
    assert transposed == [dy.shape]
    assert torch.equal(by_kernel, by_torch)


@pytest.mark.parametrize("kernel", [4, 3], ids=["aligned", "padded"])
def test_a_channels_first_dy_is_read_in_place_by_the_weight_gradient_kernel(kernel, monkeypatch):
    """Where the rows path's GEMMs run in place (half precision; CUDA behind
    its estimate, here Triton's interpreter made to apply on the CPU), dW from the
    forward's columns reads a dense channels-first dY as it is, with no copy to rows:
    dW against float64, NaN where unwritten, in the weight's own layout. The padded
    case (patch_padded: 27 columns padded to 32) multiplies the first 27."""
    from gemmconv.kernels import pixel_rows_gemm
    from gemmconv.solvers.patch import rows_path

    monkeypatch.setenv("GEMMCONV_SOLVER", "patch" if kernel == 4 else "patch_padded")
    monkeypatch.setattr(rows_path, "transpose_kernel_runs", lambda p: True)
    calls, kernel_run = [], pixel_rows_gemm.channels_first_weight_gradient

    def spy(dy3, col, out, splits):
        calls.append((tuple(dy3.shape), tuple(col.shape)))
        return kernel_run(dy3, col, out, splits)

    monkeypatch.setattr(pixel_rows_gemm, "channels_first_weight_gradient", spy)
    x = torch.randn(3, 3, 4 * kernel, 2 * kernel).half()
    w = torch.randn(5, 3, kernel, kernel).div_(kernel).half().requires_grad_()
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # empty tensors come filled with NaN
    try:
        y = gemmconv.conv2d(x, w, stride=kernel)
        dy = torch.randn(y.shape).half()
        (dw,) = torch.autograd.grad(y, w, dy)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    (call,) = [c for c in eager._calls.values() if c is not None]
    assert isinstance(call.plan.runner, ColumnKeepingForward)
    assert calls == [((3, 5, 8), (24, 3 * kernel * kernel))]
    leaves = [t.detach().double().requires_grad_() for t in (x, w)]
    (ref,) = torch.autograd.grad(F.conv2d(*leaves, stride=kernel), leaves[1], dy.double())
    assert dw.dtype == torch.float16 and dw.is_contiguous()
    assert rms_range(dw, ref) <= tolerance(torch.float16, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("x_layout", ["channels_first", "channels_last"])
@pytest.mark.parametrize("solver", ["patch", "patch_triton"])
@pytest.mark.parametrize("in_place", [False, True], ids=["cublas", "in_place"])
def test_a_weight_gradient_reuses_the_forwards_columns_on_cuda(
    solver, x_layout, dtype, in_place, monkeypatch
):
    """ViT-B/16's patch geometry (196 pixels a sample: the channels-first output goes
    through the rows path) on CUDA: the forward's columns serve dW, which matches
    float64, with the rows path's GEMMs in place in every direction (bf16: dY read as
    it is) or in none."""
    # Every direction in place, or none (the forward needs 32768 rows by default).
    force_in_place_on_cuda(monkeypatch, in_place)
    monkeypatch.setenv("GEMMCONV_SOLVER", solver)
    formats = {"channels_first": torch.contiguous_format, "channels_last": torch.channels_last}
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(4, 3, 224, 224, device="cuda", generator=gen).to(dtype)
    x = x.contiguous(memory_format=formats[x_layout])
    w = torch.randn(64, 3, 16, 16, device="cuda", generator=gen).div_(16).to(dtype)
    w.requires_grad_(True)
    y = gemmconv.conv2d(x, w, stride=16)
    dy = torch.randn(y.shape, device="cuda", generator=gen).to(dtype)
    (dw,) = torch.autograd.grad(y, w, dy)
    (call,) = [c for c in eager._calls.values() if c is not None]
    assert isinstance(call.plan.runner, ColumnKeepingForward)
    assert call.columns_serve_weight_gradient() and call._backward_plans == ({}, {})
    leaves = [t.detach().double().requires_grad_() for t in (x, w)]
    (ref,) = torch.autograd.grad(F.conv2d(*leaves, stride=16), leaves[1], dy.double())
    assert dw.dtype == dtype and rms_range(dw, ref) <= tolerance(dtype, "cuda")


def test_a_weight_gradient_solver_of_another_kind_runs_its_own_plan(monkeypatch):
    """Where the weight gradient's solver does not multiply the forward's columns, the
    forward keeps none and the weight gradient's own plan runs."""
    monkeypatch.setenv("GEMMCONV_SOLVER", "patch")
    monkeypatch.setattr(
        type(gemmconv.get_solver("patch")), "weight_gradient_multiplies_columns", False
    )
    x = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)
    w = torch.randn(5, 3, 3, 3, requires_grad=True)
    y = gemmconv.conv2d(x, w, stride=3)
    assert not any(t is not None and t.dim() == 2 for t in y.grad_fn.saved_tensors)
    (dw,) = torch.autograd.grad(y, w, torch.ones_like(y))
    (call,) = [c for c in eager._calls.values() if c is not None]
    (dw_plan,) = call._backward_plans[1].values()
    assert isinstance(call.plan.runner, ColumnKeepingForward) and dw_plan.runner is not None
    w_ref = w.detach().requires_grad_()
    y_ref = F.conv2d(x, w_ref, stride=3)
    torch.testing.assert_close(dw, torch.autograd.grad(y_ref, w_ref, torch.ones_like(y_ref))[0])


def test_a_forward_needing_no_copy_runs_the_column_keeping_form_on_its_operands(monkeypatch):
    """Where the column-keeping run needs no operand copied, a forward calls its form
    on the operands themselves (Plan.keeping_columns): bit for bit the general run's
    y. Under autocast, and for a plan that copies an operand first, the general run
    serves instead."""
    from gemmconv.roads import ops
    from gemmconv.solvers.base import ConvTensors

    monkeypatch.setenv("GEMMCONV_SOLVER", "patch")
    x, w = torch.randn(2, 3, 8, 8), torch.randn(6, 3, 4, 4)
    y = gemmconv.conv2d(x, w, stride=4)
    (plan,) = [call.plan for call in eager._calls.values() if call is not None]
    assert plan.keeping_columns is not None
    general = plan.runner(ConvTensors(x, w, None))
    assert torch.equal(y, general)
    y_kept, columns = ops.run_forward_keeping_columns(plan, x, w, None)
    assert torch.equal(y_kept, general) and columns.shape == (2 * 2 * 2, 3 * 4 * 4)

    def refused(*operands):
        raise AssertionError("the operands' form ran under autocast")

    plan.keeping_columns = refused
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(ops.run_forward(plan, x, w, None), general)
    eager.clear()
    strided = torch.randn(2, 3, 8, 16)[..., ::2]  # not dense: the plan copies it first
    y = gemmconv.conv2d(strided, w, stride=4)
    (plan,) = [call.plan for call in eager._calls.values() if call is not None]
    assert plan.copy_first and plan.keeping_columns is None
    torch.testing.assert_close(y, F.conv2d(strided, w, stride=4))


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_a_channels_first_forward_returns_the_view_of_its_products_blocks(bias, monkeypatch):
    """A channels-first y's memory is the per-sample product's [N, K, P] blocks in
    order, so the prepared forward lets bmm allocate them and returns y as their view
    (no allocation of its own, no out=): the run's y is dense channels-first, its base
    is the blocks, and the bias is added in place. The y a caller gets is a base tensor
    of that very memory (ops.as_base), so in-place ops on it work as on torch's."""
    monkeypatch.setenv("GEMMCONV_SOLVER", "patch")
    x, w = torch.randn(3, 4, 8, 8), torch.randn(6, 4, 2, 2)
    b = torch.randn(6) if bias else None
    with torch.no_grad():
        y = gemmconv.conv2d(x, w, b, stride=2)
    torch.testing.assert_close(y, F.conv2d(x, w, b, stride=2))
    assert y.is_contiguous() and y._base is None
    assert y.untyped_storage().nbytes() == y.numel() * y.element_size()
    (plan,) = [call.plan for call in eager._calls.values() if call is not None]
    assert plan.solver.id == "patch" and plan.keeping_columns is not None
    run_y, _ = plan.keeping_columns(x, w, b)
    assert run_y.is_contiguous()
    assert run_y._base is not None and run_y._base.shape == (3, 6, 16)


@pytest.fixture
def implicit_on_the_cpu(monkeypatch):
    """patch_implicit let onto the CPU, where its kernels run in Triton's interpreter."""
    from gemmconv.solvers import get_solver

    solver = get_solver("patch_implicit")
    monkeypatch.setattr(type(solver), "devices", solver.devices | {"cpu"})
    monkeypatch.setenv("GEMMCONV_SOLVER", "patch_implicit")
    return solver


@pytest.mark.parametrize("weight_format", [torch.contiguous_format, torch.channels_last])
def test_the_implicit_gemms_keep_a_prepared_launch_per_direction(
    implicit_on_the_cpu, weight_format
):
    """An eager call of patch_implicit runs its prepared run (implicit_prepared), not
    the solver's own: forward, backward-data and the weight gradient each match torch,
    with the weight's rows a view (channels-first) or copied each call (a channels-last
    weight read in the channels-first column order)."""
    x = torch.randn(4, 3, 10, 10, requires_grad=True)
    w = torch.randn(6, 3, 4, 4).to(memory_format=weight_format).requires_grad_()
    b = torch.randn(6, requires_grad=True)
    y = gemmconv.conv2d(x, w, b, stride=4)
    x_ref, w_ref, b_ref = (t.detach().double().requires_grad_() for t in (x, w, b))
    y_ref = F.conv2d(x_ref, w_ref, b_ref, stride=4)
    torch.testing.assert_close(y, y_ref.float())
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, w, b), dy)
    refs = torch.autograd.grad(y_ref, (x_ref, w_ref, b_ref), dy.double())
    for got, want in zip(grads, refs):
        torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
    runners = [call.plan.runner for call in eager._calls.values() if call is not None]
    for call in eager._calls.values():
        runners += [plan.runner for plans in call._backward_plans for plan in plans.values()]
    assert len(runners) == 3
    assert all(r is not None and not isinstance(r, functools.partial) for r in runners)


def test_a_prepared_implicit_run_follows_a_changed_tf32_flag(implicit_on_the_cpu, monkeypatch):
    """The fp32 dot's precision is fixed in the launch from the cudnn TF32 flag at
    preparation: a call made under the other setting runs the solver's own
    direction, which reads the flag afresh."""
    from gemmconv.core.problem import ConvProblem
    from gemmconv.solvers.base import ConvTensors

    solver = implicit_on_the_cpu
    x, w = torch.randn(2, 3, 8, 8), torch.randn(5, 3, 4, 4)
    p = ConvProblem.from_tensors(x, w, None, stride=4)
    tensors = ConvTensors(x, w, None)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    runner = solver.prepare(p, tensors)
    own_runs = []
    monkeypatch.setattr(type(solver), "run", lambda self, *a: own_runs.append(a) or "own")
    runner(tensors)
    assert own_runs == []
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    assert runner(tensors) == "own" and len(own_runs) == 1
