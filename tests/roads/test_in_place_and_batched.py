"""What torch's autograd allows on a convolution's output and gradients, gemmconv's
allow too, with every GEMM solver, on the eager road and the op road, in every layout
(channels-first, channels-last input, and the token-major output of a channels-last
weight):

- in-place ops on the output y (``relu_``, ``+=``, ``*=`` by a tensor that needs a
  gradient, slice assignment, in-place ops through a view of y, and on a y made under
  no_grad), with gradients equal to torch's and version tracking that raises where
  torch's does;
- batched gradients: ``torch.autograd.grad(..., is_grads_batched=True)``,
  ``torch.autograd.functional.jacobian(..., vectorize=True)`` and torch.func.vmap over
  a backward, equal to torch's.

Each solver is forced (GEMMCONV_SOLVER) on a problem of the first class of
solver_cases.GEOMETRIES it takes in every direction; everything is compared in float64
on the CPU with torch's convolution on the same operands.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F

import gemmconv
from gemmconv.core.problem import Direction
from gemmconv.functional import problem_of
from gemmconv.measuring.verify import rms_range, tolerance
from gemmconv.roads import eager
from gemmconv.solvers import get_solver

from solver_cases import GEOMETRIES, Geometry, applies

F64 = torch.float64
TIGHT = {"rtol": 1e-10, "atol": 1e-12}
TORCH_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
GEMMCONV_CONV = {1: gemmconv.conv1d, 2: gemmconv.conv2d, 3: gemmconv.conv3d}
# The solvers that run on the CPU in float64 (the Triton ones are checked apart, in
# float32 through the interpreter).
CPU_SOLVERS = ("point_output", "pointwise", "strided_pointwise", "patch", "patch_padded", "im2col")
# cf: all channels-first; cl: a channels-last input; token: a channels-last weight, whose
# output is channels-last (token-major) from a channels-first input, as torch's is.
LAYOUTS = {1: ("cf",), 2: ("cf", "cl", "token"), 3: ("cf", "cl", "token")}


def _cycle(values: tuple[int, ...], dims: int) -> tuple[int, ...]:
    return tuple(values[i % len(values)] for i in range(dims))


@dataclasses.dataclass(frozen=True)
class Case:
    solver: str
    geometry: Geometry
    dims: int
    layout: str
    bias: bool
    dtype: torch.dtype = F64

    def __str__(self) -> str:
        bias = "bias" if self.bias else "nobias"
        return f"{self.solver}-{self.geometry.label}-{self.dims}d-{self.layout}-{bias}"

    @property
    def arguments(self) -> dict:
        g, d = self.geometry, self.dims
        return dict(
            stride=_cycle(g.stride, d),
            padding=_cycle(g.padding, d),
            dilation=_cycle(g.dilation, d),
            groups=g.groups,
        )

    def operands(self, seed: int) -> tuple[torch.Tensor, ...]:
        """(x, w, b or None), fresh leaves that need gradients, in the case's layout."""
        g, d, dtype = self.geometry, self.dims, self.dtype
        gen = torch.Generator().manual_seed(seed)

        def uniform(*shape):
            return (torch.rand(shape, generator=gen, dtype=F64) * 2 - 1).to(dtype)

        x = uniform(g.n, g.c, *g.spatial[:d])
        w = uniform(g.k, g.c // g.groups, *_cycle(g.kernel, d))
        b = uniform(g.k) if self.bias else None
        if self.layout != "cf":
            fmt = torch.channels_last if d == 2 else torch.channels_last_3d
            if self.layout == "cl":
                x = x.to(memory_format=fmt)
            else:
                w = w.to(memory_format=fmt)
        return tuple(None if t is None else t.requires_grad_() for t in (x, w, b))

    def problem(self):
        x, w, b = self.operands(0)
        return problem_of(x, w, b, **self.arguments)


def _takes_every_direction(solver_id: str, case: Case) -> bool:
    solver, problem = get_solver(solver_id), case.problem()
    return all(
        applies(solver, eager.backward_problem(problem, d) if d is not Direction.FORWARD
                else problem)
        for d in Direction
    )  # fmt: skip


def _cases(solvers, dtype=F64) -> list[Case]:
    """Per solver, dims and layout: the first geometry the solver takes in every
    direction, with a bias every other case (the solver's index shifting which), so
    that each solver and each dims and layout meet both."""
    cases = []
    for index, solver in enumerate(solvers):
        shapes = [(dims, layout) for dims, layouts in LAYOUTS.items() for layout in layouts]
        for position, (dims, layout) in enumerate(shapes):
            bias = (index + position) % 2 == 1
            for geometry in (g for gs in GEOMETRIES.values() for g in gs):
                case = Case(solver, geometry, dims, layout, bias, dtype)
                if _takes_every_direction(solver, case):
                    cases.append(case)
                    break
    return cases


CASES = _cases(CPU_SOLVERS)


def _gemmconv_forward(case: Case, road: str):
    """gemmconv's forward on the eager road (the public function) or the op road (the
    custom op, as torch.compile, export and dispatch modes see it)."""
    arguments = case.arguments
    if road == "eager":
        conv = GEMMCONV_CONV[case.dims]
        return lambda x, w, b: conv(x, w, b, **arguments)
    stride, padding, dilation = (list(arguments[k]) for k in ("stride", "padding", "dilation"))
    return lambda x, w, b: torch.ops.gemmconv.conv_forward(
        x, w, b, stride, padding, dilation, arguments["groups"]
    )


def _torch_forward(case: Case):
    conv, arguments = TORCH_CONV[case.dims], case.arguments
    return lambda x, w, b: conv(x, w, b, **arguments)


def _flat_view(y: torch.Tensor) -> torch.Tensor:
    """A 1-D view of y's memory (channels-first or channels-last)."""
    return y.view(-1) if y.is_contiguous() else y.movedim(1, -1).view(-1)


def _slice_zero(y, r, s):
    y[:, :1] = 0


# In-place ops on y after the forward; each gets y, a tensor r like it and a scalar s
# that needs a gradient.
IN_PLACE_OPS = {
    "relu_": lambda y, r, s: F.relu(y, inplace=True),
    "add": lambda y, r, s: y.__iadd__(r),
    "mul_by_grad_tensor": lambda y, r, s: y.__imul__(s),
    "slice_assign": _slice_zero,
    "through_a_view": lambda y, r, s: _flat_view(y).add_(1),
    # relu_ saves its result, which add_ then modifies: backward must raise.
    "relu_then_add": lambda y, r, s: (F.relu(y, inplace=True), y.add_(1)),
}


# How the forward runs: recording gradients; under no_grad; with grad mode on but no
# operand needing a gradient. In the last two, y is then multiplied in place by s.
FORWARD_MODES = ("grad", "no_grad", "operands_without_grad")


def _run_in_place(forward, case: Case, op: str, mode: str):
    """(y after the op, its strides, gradients of x, w, b, s) or the exception raised."""
    x, w, b = case.operands(1)
    if mode == "operands_without_grad":
        x, w, b = (None if t is None else t.detach() for t in (x, w, b))
    s = torch.tensor(1.5, dtype=F64, requires_grad=True)
    try:
        if mode == "no_grad":
            with torch.no_grad():
                y = forward(x, w, b)
        else:
            y = forward(x, w, b)
        strides = y.stride()
        r = torch.rand(y.shape, generator=torch.Generator().manual_seed(2), dtype=F64)
        IN_PLACE_OPS[op](y, r, s)
        if mode != "grad":
            y.mul_(s)  # grad mode on: torch's y takes it
        g = torch.rand(y.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
        leaves = [t for t in (x, w, b, s) if t is not None and t.requires_grad]
        grads = torch.autograd.grad((y * g).sum(), leaves, allow_unused=True)
    except RuntimeError as error:
        return error
    return y, strides, grads


@pytest.mark.parametrize("road", ["eager", "op"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_in_place_ops_on_the_output_behave_as_on_torchs(case: Case, road: str, monkeypatch):
    monkeypatch.setenv("GEMMCONV_SOLVER", case.solver)
    forward = _gemmconv_forward(case, road)
    x, w, b = case.operands(0)
    y = forward(x, w, b)
    # What autograd's view checks read: y is a tensor of its own, as torch's output is.
    assert y._base is None and not y._is_view()
    with torch.no_grad():
        assert forward(x, w, b)._base is None
    for op in IN_PLACE_OPS:
        for mode in FORWARD_MODES:
            what = f"{op} after a forward with {mode}"
            ours = _run_in_place(forward, case, op, mode)
            theirs = _run_in_place(_torch_forward(case), case, op, mode)
            if isinstance(theirs, Exception):
                # The same tensor, node and error; the versions named may differ (a
                # bias added in place to the product counts one more on gemmconv's).
                assert isinstance(ours, type(theirs)), f"{what}: torch raised {theirs!r}"
                assert "modified by an inplace operation" in str(theirs), theirs
                same = str(theirs).split(" is at version")[0]
                assert str(ours).startswith(same), f"{what}: {ours}; torch: {theirs}"
                continue
            assert not isinstance(ours, Exception), f"{what}: {ours!r}"
            (y, strides, grads), (y_ref, strides_ref, grads_ref) = ours, theirs
            assert strides == strides_ref, what
            torch.testing.assert_close(y, y_ref, **TIGHT, msg=what)
            for got, want in zip(grads, grads_ref, strict=True):
                torch.testing.assert_close(got, want, **TIGHT, msg=what)


@pytest.mark.parametrize("solver", CPU_SOLVERS)
def test_in_place_ops_on_gradients_made_for_double_backward(solver, monkeypatch):
    """dx and dW of ``create_graph=True`` (the backward ops' outputs) modified in place,
    then differentiated, as torch's."""
    monkeypatch.setenv("GEMMCONV_SOLVER", solver)
    (case,) = (c for c in CASES if c.solver == solver and c.dims == 2 and c.layout == "token")
    results = []
    for forward in (_gemmconv_forward(case, "eager"), _torch_forward(case)):
        x, w, b = case.operands(7)
        y = forward(x, w, b)
        dy = torch.rand(y.shape, generator=torch.Generator().manual_seed(8), dtype=F64)
        dx, dw = torch.autograd.grad(y, (x, w), dy, create_graph=True)
        dx += 1
        dw.mul_(2)
        results.append(torch.autograd.grad(dx.pow(2).sum() + dw.pow(2).sum(), (x, w)))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, **TIGHT)


def test_the_issue_repro_a_patch_embed_output_takes_in_place_ops():
    """A Conv3d patch embedding converted with default settings, its output viewed as
    tokens and modified in place, then backpropagated (the report's repro)."""
    m = torch.nn.Conv3d(3, 64, (2, 14, 14), stride=(2, 14, 14), bias=False)
    ref = torch.nn.Conv3d(3, 64, (2, 14, 14), stride=(2, 14, 14), bias=False)
    ref.load_state_dict(m.state_dict())
    gemmconv.convert(m)
    x = torch.randn(8, 3, 2, 14, 14, generator=torch.Generator().manual_seed(0))
    grads = []
    for module in (m, ref):
        xg = x.clone().requires_grad_()
        h = module(xg).view(-1, 64)
        h += 1
        h.sum().backward()
        grads.append((xg.grad, module.weight.grad))
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("solver", ["patch_triton", "patch_implicit"])
def test_triton_solvers_outputs_take_in_place_ops(solver, monkeypatch):
    """The Triton solvers' outputs, in Triton's interpreter on the CPU, in float32."""
    solver_object = get_solver(solver)
    monkeypatch.setattr(type(solver_object), "devices", solver_object.devices | {"cpu"})
    monkeypatch.setenv("GEMMCONV_SOLVER", solver)
    (case,) = (c for c in _cases([solver], torch.float32) if c.dims == 2 and c.layout == "token")
    case = dataclasses.replace(case, bias=True)
    for road in ("eager", "op"):
        x, w, b = case.operands(0)
        y = _gemmconv_forward(case, road)(x, w, b)
        assert y._base is None and not y._is_view()
        y += 1
        y.sum().backward()
        x_ref, w_ref, b_ref = (t.detach().double().requires_grad_() for t in (x, w, b))
        y_ref = _torch_forward(case)(x_ref, w_ref, b_ref)
        y_ref.add_(1).sum().backward()
        torch.testing.assert_close(y, y_ref.float(), rtol=1e-5, atol=1e-5)
        for got, want in ((x.grad, x_ref.grad), (w.grad, w_ref.grad), (b.grad, b_ref.grad)):
            torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)


def test_a_compiled_convolutions_output_takes_in_place_ops():
    """torch.compile (the op road, traced by AOTAutograd): its output modified in place
    outside the compiled code, then backpropagated."""
    torch._dynamo.reset()
    conv = gemmconv.nn.Conv2d(3, 8, kernel_size=4, stride=4).double()
    compiled = torch.compile(conv, backend="aot_eager", fullgraph=True)
    x = torch.rand(2, 3, 8, 8, dtype=F64, requires_grad=True)
    y = compiled(x)
    y.mul_(2).relu_()
    y.sum().backward()
    x_ref = x.detach().requires_grad_()
    y_ref = F.conv2d(x_ref, conv.weight, conv.bias, stride=4).mul_(2).relu_()
    y_ref.sum().backward()
    torch.testing.assert_close(y, y_ref, **TIGHT)
    torch.testing.assert_close(x.grad, x_ref.grad, **TIGHT)


# ---- batched gradients ---------------------------------------------------------------

BATCHED_CALLS = ("is_grads_batched", "jacobian_vectorize", "func_vmap_over_backward")


def _batched_gradients(forward, case: Case, call: str):
    x, w, b = case.operands(4)
    leaves = tuple(t for t in (x, w, b) if t is not None)
    y = forward(x, w, b)
    if call == "jacobian_vectorize":
        # The jacobian of y projected onto 2 random directions per sample: a batch of
        # dense random dy as for y itself, 2 N rows rather than all of y's elements.
        gen = torch.Generator().manual_seed(5)
        projection = torch.rand(y[0].numel(), 2, generator=gen, dtype=F64)

        def projected(*ts):
            return forward(*ts, *((None,) if b is None else ())).flatten(1) @ projection

        return torch.autograd.functional.jacobian(projected, leaves, vectorize=True)
    gen = torch.Generator().manual_seed(5)
    v = torch.rand(3, *y.shape, generator=gen, dtype=F64)
    if call == "is_grads_batched":
        return torch.autograd.grad(y, leaves, v, is_grads_batched=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grads = torch.func.vmap(lambda t: torch.autograd.grad(y, leaves, t, retain_graph=True))(v)
    # torch.func runs an op without a batching rule once per batch entry, and says so.
    slow = [str(w.message) for w in caught if "performance drop" in str(w.message)]
    assert not slow, slow
    return grads


@pytest.mark.parametrize("call", BATCHED_CALLS)
@pytest.mark.parametrize("road", ["eager", "op"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_batched_gradients_match_torch(case: Case, road: str, call: str, monkeypatch):
    monkeypatch.setenv("GEMMCONV_SOLVER", case.solver)
    ours = _batched_gradients(_gemmconv_forward(case, road), case, call)
    theirs = _batched_gradients(_torch_forward(case), case, call)
    for got, want in zip(ours, theirs, strict=True):
        assert want.abs().sum() > 0, "torch's gradient is zero, so the check is void"
        torch.testing.assert_close(got, want, **TIGHT)


def test_a_vectorized_hessian_through_the_eager_road_matches_torch(monkeypatch):
    """A batched backward that is itself differentiated (vectorized hessian)."""
    monkeypatch.setenv("GEMMCONV_SOLVER", "patch")
    (case,) = (c for c in CASES if c.solver == "patch" and c.dims == 2 and c.layout == "cf")

    def loss(conv):
        def f(x, w):
            return conv(x, w, None, **case.arguments).pow(2).sum()

        return f

    x, w, _ = case.operands(6)
    ours = torch.autograd.functional.hessian(loss(gemmconv.conv2d), (x, w), vectorize=True)
    theirs = torch.autograd.functional.hessian(loss(F.conv2d), (x, w), vectorize=True)
    for got_row, want_row in zip(ours, theirs, strict=True):
        for got, want in zip(got_row, want_row, strict=True):
            torch.testing.assert_close(got, want, **TIGHT)


# ---- on the GPU ---------------------------------------------------------------------

CUDA_SOLVERS = (*CPU_SOLVERS, "patch_triton", "patch_implicit")


def _cuda_results(case: Case, forward, device: str, dtype: torch.dtype) -> tuple:
    """y after ``y += 1`` and relu_, its gradients for one dy and batched ones for 3."""
    x, w, b = (
        None if t is None else t.detach().to(device, dtype).requires_grad_()
        for t in case.operands(9)
    )
    leaves = tuple(t for t in (x, w, b) if t is not None)
    y = forward(x, w, b)
    y += 1
    F.relu(y, inplace=True)
    gen = torch.Generator().manual_seed(10)
    v = torch.rand(3, *y.shape, generator=gen, dtype=F64).to(device, dtype)
    batched = torch.autograd.grad(y, leaves, v, is_grads_batched=True, retain_graph=True)
    return (y, *torch.autograd.grad(y, leaves, v[0]), *batched)


@pytest.mark.gpu
@pytest.mark.parametrize("solver", CUDA_SOLVERS)
def test_in_place_ops_and_batched_gradients_on_cuda(solver, monkeypatch):
    """Each GEMM solver on the GPU in float32, in each 2-D layout: the output modified
    in place and backpropagated, and batched gradients, judged against torch's float64
    convolution of the same operands on the CPU by float32's tolerance.

    In full fp32, not TF32: relu_'s kink turns an element's rounding into a whole
    element of dY, and TF32's (about 1e-3 of y's range) moved point_output's 2-D case
    with a bias, whose y + 1 is 5e-4 in float64, to the kink's other side (dX off by
    0.15 of its range on an H100; bench/probes/results/in_place_point_output_h100.txt).
    gemmconv's fp32 GEMMs follow this flag, as torch's convolutions do."""
    monkeypatch.setenv("GEMMCONV_SOLVER", solver)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    limit = tolerance(torch.float32, "cuda")
    for case in (c for c in _cases([solver], torch.float32) if c.dims == 2):
        reference = _cuda_results(case, _torch_forward(case), "cpu", F64)
        for road in ("eager", "op"):
            ours = _cuda_results(case, _gemmconv_forward(case, road), "cuda", torch.float32)
            for i, (a, b) in enumerate(zip(ours, reference, strict=True)):
                error = rms_range(a, b)
                assert error <= limit, f"{case}-{road}[{i}]: rms_range {error:.3g} > {limit:.3g}"
