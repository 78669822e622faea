"""The eager road: gemmconv.conv* in plain eager code, without the custom-op dispatcher.

The custom ops (gemmconv.roads.ops) are what torch.compile, torch.export, fx, jit tracing,
torch.func transforms and dispatch modes see. In plain eager code their wrapper, with
the argument checks, autocast and padding resolution around it, is pure cost: on the
H200's host it made a tiny convolution 130-290 us slower than torch's
(bench/results/overhead_h200.md, whose earlier version is in the git history), far
more than the kernels of most convolutions. Here a call is one dictionary lookup on
everything those steps depend on (operand metadata, convolution arguments, autocast
and selection state), then the very implementation the ops run: the forward plan
directly under no_grad, and inside a torch.autograd.Function when a gradient is
needed, whose backward calls the backward ops' implementations (or the custom ops
themselves when the backward is being differentiated, so double backward keeps their
autograd formulas).

Anything this road does not cover (an argument that cannot be hashed, 'same' padding
that pads the input first, a tensor subclass, a device other than cpu/cuda, arguments
equal to a checked call's but of other types) takes the custom-op road, which checks
and computes everything afresh.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.autograd.forward_ad as forward_ad
import torch.nn.functional as F

from gemmconv.core import device_rates
from gemmconv.core.arguments import handed_to_torch, resolve_arguments
from gemmconv.core.invariance import batch_invariant_enabled
from gemmconv.core.memory_format import Layout, dense_strides
from gemmconv.core.precision import widens_reduction
from gemmconv.core.problem import ConvProblem, Direction
from gemmconv.roads import native_node, ops
from gemmconv.roads.autograd import under_vmap, vmap_safe_gradients
from gemmconv.selection import dispatch
from gemmconv.solvers import Solver, get_solver
from gemmconv.solvers.cpu_conv_hazards import (
    hazard_layout,
    run_at_unit_stride,
    run_avoiding,
    unit_stride_reads,
)
from gemmconv.solvers.views import BATCH_AND_SPACE, bias_grad

# A forward's input without its data, as a gemmconv.nn module remembers it for
# ``solvers()``: (shape, strides, dtype, device), the dtype the convolution ran in
# (autocast resolved), as the eager road reads them for its key. A plain tuple: one is
# built on every eager forward of a module, and a NamedTuple costs 0.2 us more.
SeenInput = tuple[torch.Size, tuple[int, ...], torch.dtype, torch.device]


# The attribute under which a gemmconv.nn module keeps the SeenInput of its last
# eager forward.
LAST_INPUT = "_gemmconv_last_input"


def remember_input(module: torch.nn.Module, input: torch.Tensor) -> None:
    """Keep ``input``'s SeenInput on ``module`` (a gemmconv.nn module)."""
    # Past nn.Module.__setattr__, whose checks for parameters, buffers and submodules
    # cost a microsecond a forward.
    module.__dict__[LAST_INPUT] = (input.shape, input.stride(), input.dtype, input.device)


# torch's C questions, bound once: every eager call asks them, and the lookups through
# the torch module cost a fifth of the answers.
_is_tracing = torch._C._is_tracing
_dispatch_modes = torch._C._len_torch_dispatch_stack
_functorch_transforms = torch._C._are_functorch_transforms_active
_is_grad_enabled = torch.is_grad_enabled
_any_autocast_enabled = torch._C._is_any_autocast_enabled
# The devices the road covers; a call on any other takes the op road.
_DEVICE_TYPES = frozenset({"cpu", "cuda"})


class _Call:
    """What one distinct eager call needs besides its tensors."""

    __slots__ = ("plan", "unbatched", "accepted", "conv_args", "vendor_function",
                 "vendor_arguments", "input_size", "weight_size", "channels_last",
                 "vendor_forward", "bias_dims", "keeps_columns", "column_plan",
                 "_vendor_serves", "_backward_plans", "rows_form", "_native_serves")  # fmt: skip

    def __init__(self, dims: int, plan: ops.Plan, unbatched: bool, arguments: tuple,
                 conv_args: tuple, input: torch.Tensor, weight: torch.Tensor) -> None:  # fmt: skip
        self.plan = plan
        self.unbatched = unbatched
        # The stride, padding, dilation and groups objects calls have passed, the checked
        # call's first: a call passing these very objects needs no check of their types.
        # Modules of one configuration share an entry, each with its own tuples.
        self.accepted = [arguments]
        self.conv_args = conv_args  # the same resolved: stride, padding, dilation (lists), groups
        self.vendor_function = _TORCH_CONVOLUTIONS[dims]
        hazard = None if unbatched else hazard_layout(input, weight, plan.problem.output_shape,
                                                      *conv_args)  # fmt: skip
        if hazard is not None:
            self.vendor_function = functools.partial(run_avoiding, hazard, self.vendor_function)
        # torch's own autograd records this function where it serves a training call.
        reads = unit_stride_reads(input, weight, *conv_args)
        if reads is not None:
            self.vendor_function = functools.partial(
                run_at_unit_stride, reads, self.vendor_function, conv_args[3]
            )
        self.vendor_arguments = _shortest_arguments(*conv_args)
        self.input_size = list(input.shape)
        self.weight_size = list(weight.shape)
        self.channels_last = plan.problem.layout is Layout.CHANNELS_LAST
        self.vendor_forward = plan.solver.id == "vendor"
        # The dimensions dY is summed over for the bias's gradient (batch and space);
        # None for a zero-channel input, whose dY has no channels though the bias has
        # some (bias_grad gives zeros).
        self.bias_dims = None if plan.problem.c == 0 else BATCH_AND_SPACE[dims + 2]
        # Per (dx needed, dW needed): whether torch's convolution serves the call.
        self._vendor_serves: dict[tuple[bool, bool], bool] = {}
        # Backward plans of backward-data, then of backward-weights.
        self._backward_plans: tuple[dict[tuple, ops.Plan], ...] = ({}, {})
        # columns_serve_weight_gradient's verdict, None until a forward needing dW asks,
        # and the forward plan such a forward runs (column_forward_solver).
        self.keeps_columns: bool | None = None
        self.column_plan: ops.Plan = plan
        # The C++ node's arguments after the operands where the call is one GEMM over
        # views of them (rows_form), and per (dx needed, dW needed) whether it serves.
        device_type = plan.problem.device_type
        wanted = not unbatched and native_node.wanted_on(device_type)
        self.rows_form = rows_form(plan) if wanted else None
        self._native_serves: dict[tuple[bool, bool], bool] = {}
        if self.rows_form is not None:
            native_node.request(device_type)

    def accepts(self, arguments: tuple) -> bool:
        """Whether ``arguments``, equal to the checked call's, are of the same types all
        through; if so they are remembered (a bounded few), so their next call finds
        them by identity."""
        if not _same_kinds(arguments, self.accepted[0]):
            return False
        if len(self.accepted) >= _ACCEPTED_MAX:
            del self.accepted[1:]
        self.accepted.append(arguments)
        return True

    def vendor_serves(self, need_dx: bool, need_dw: bool) -> bool:
        """Whether torch's convolution, with its fused backward, serves a call that
        needs these gradients (training_road). Asked only when a call needs
        gradients, so inference never decides (or benchmarks) them."""
        needed = (need_dx, need_dw)
        verdict = self._vendor_serves.get(needed)
        if verdict is None:
            road = training_road(self.plan.problem, need_dx, need_dw)
            verdict = self._vendor_serves[needed] = road.on_torch
            if road.on_torch and road.gemm_solvers:
                dispatch.log.info("%s: %s", self.plan.problem.key(), road.describe())
        return verdict

    def native_serves(self, need_dx: bool, need_dw: bool) -> bool:
        """Whether the C++ node (native_node) serves a call that needs these gradients:
        where the backward directions needed chose the GEMM the forward did, on the
        same views (one-patch or channels-last 1x1)."""
        needed = (need_dx, need_dw)
        verdict = self._native_serves.get(needed)
        if verdict is None:
            verdict = _backward_rows(self.plan.problem, need_dx, need_dw)
            self._native_serves[needed] = verdict
        return verdict

    def columns_serve_weight_gradient(self) -> bool:
        """Whether dW multiplies the forward's columns: where the weight gradient's
        solver, decided (found, logged) as for any call, is a column GEMM. Decided once,
        in the first forward that needs dW: the entry's key holds the selection state,
        and the weight gradient's problem is the forward's in another direction. Such
        forwards run ``column_plan``: the forward's plan, or the weight gradient's
        solver's (column_forward_solver)."""
        verdict = self.keeps_columns
        if verdict is None:
            weights = backward_problem(self.plan.problem, Direction.BACKWARD_WEIGHTS)
            solver = dispatch.solver_for(weights)
            verdict = solver.weight_gradient_multiplies_columns
            if verdict and column_forward_solver(self.plan.problem, self.plan.solver, solver):
                plan = self.plan
                self.column_plan = ops.Plan(
                    plan.problem, solver, plan.copy_first, plan.copy_second,
                    plan.result_layout, plan.result_strides,
                )  # fmt: skip
            self.keeps_columns = verdict
        return verdict

    def gradients(
        self,
        grad_output: torch.Tensor,
        input: torch.Tensor | None,
        weight: torch.Tensor | None,
        columns: torch.Tensor | None,
        need_dx: bool,
        need_dw: bool,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """dx and dW of this call, each where needed: dW from the forward's ``columns``
        where it kept them (columns_serve_weight_gradient), else each by its backward
        plan."""
        dw = None
        if need_dw and columns is not None:
            dw = ops.weight_gradient_from_columns(self.column_plan, grad_output, columns)
            need_dw = False
        if not (need_dx or need_dw):
            return None, dw
        # Everything else a backward plan's key holds is fixed by the call (its operand
        # is the forward's own weight or input).
        key = (grad_output.stride(), grad_output.dtype, dispatch.selection_key())
        dx = None
        if need_dx:
            plan = self._backward_plan(Direction.BACKWARD_DATA, key, grad_output, weight)
            dx = ops.run_backward(plan, grad_output, weight)
        if need_dw:
            plan = self._backward_plan(Direction.BACKWARD_WEIGHTS, key, grad_output, input)
            dw = ops.run_backward(plan, grad_output, input)
        return dx, dw

    def _backward_plan(
        self, direction: Direction, key: tuple, grad_output: torch.Tensor, operand: torch.Tensor
    ) -> ops.Plan:
        """The plan of a backward direction under ``key`` (dY's strides and dtype, the
        selection state), kept per direction."""
        plans = self._backward_plans[direction is Direction.BACKWARD_WEIGHTS]
        plan = plans.get(key)
        if plan is None:
            size = self.input_size if direction is Direction.BACKWARD_DATA else self.weight_size
            plan = ops.backward_plan(
                direction, grad_output, operand, size, *self.conv_args, self.channels_last
            )
            if len(plans) >= _BACKWARD_PLANS_MAX:
                plans.clear()
            plans[key] = plan
        return plan


def column_forward_solver(problem: ConvProblem, forward: Solver, weights: Solver) -> bool:
    """Whether a forward of ``problem`` that needs dW runs the weight gradient's solver
    ``weights`` in place of its own, ``forward``: where dW multiplies a copy of x's
    patches that ``forward`` does not keep (an implicit GEMM, im2col) and ``weights``
    computes the forward too, gathering them once for both GEMMs, as the rewrite does.
    Not where the columns are x's own memory (nothing to gather again), where the
    forward went to the vendor (its kernel may beat gather and GEMM), where ``weights``'
    forward GEMM reads unaligned rows (an implicit GEMM beats cuBLAS there: 0.048 ms
    against 0.089 of device time on point 2D's 588-element rows, H100), nor under batch
    invariance (the forward's invariant form is the one chosen). find picked
    patch_implicit for ViT-B/16's channels-first forward and patch_triton for its weight
    gradient, which then gathered again: the weight-gradient call ran 0.474 ms against
    immediate's 0.281 (H100 at dea76e9)."""
    if not weights.weight_gradient_multiplies_columns or forward.weight_gradient_multiplies_columns:
        return False
    return (
        forward.id != "vendor"
        and not batch_invariant_enabled()
        and weights.gathers_columns(backward_problem(problem, Direction.BACKWARD_WEIGHTS))
        and weights.is_applicable(problem)
        and weights.gemm_is_aligned(problem)
    )


# The solvers whose GEMM in every direction is the C++ node's, over views of the
# operands as rows: one row a sample (point_output on a one-patch input) or a pixel
# (pointwise on channels-last operands).
_ROWS_SOLVERS = frozenset({"point_output", "pointwise"})
# The dtypes the node computes on CUDA: fp32 follows the convolution's TF32 rule,
# which the Python node applies through torch's per-backend precision settings.
_NATIVE_CUDA_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float64})


def rows_form(plan: ops.Plan) -> tuple[bool, bool, bool, bool] | None:
    """The C++ node's arguments after the operands (one patch, channels-last rows,
    channels-last output, widened weight gradient) where ``plan``'s problem runs as one
    GEMM over views of its operands (rows_solver), with the result's strides torch
    gives; else None."""
    p = plan.problem
    solver_id = rows_solver(p, plan.solver)
    if (
        solver_id is None
        or plan.copy_first
        or plan.copy_second
        or not _one_gemm_over_views(p, solver_id)
    ):
        return None
    one_patch = solver_id == "point_output"
    strides = tuple(plan.result_strides)
    if strides == dense_strides(p.output_shape, Layout.CHANNELS_LAST):
        channels_last_output = True
    elif one_patch and strides == dense_strides(p.output_shape, Layout.CHANNELS_FIRST):
        channels_last_output = False
    else:
        return None
    channels_last = p.layout is Layout.CHANNELS_LAST
    widen = widens_reduction(p.dtype, p.device_type, p.gemm_m, p.k, p.gemm_k)
    return one_patch, channels_last, channels_last_output, widen


def rows_solver(p: ConvProblem, forward: Solver) -> str | None:
    """The rows solver whose GEMM the C++ node runs for training calls of ``p``: the
    forward's own where it chose one; else the rows solver of its geometry
    (point_output, or pointwise for a 1x1), where that applies, after
    - another column GEMM that reads x's own memory as its columns (`patch` on one
      patch a sample): the same GEMM under another name. find picked `patch` for
      Qwen3-VL's channels-last forward and point_output for both backward directions:
      the backward-data call took the Python node, 0.171 ms against immediate's 0.116
      (H100 at dea76e9);
    - the implicit GEMM over rows cuBLAS reads aligned: it is chosen there on its host
      price alone (a Triton launch against a torch op, 5 us), at about half cuBLAS's
      device speed (point 3D's forward 100 us against 51, H100), and its Python node
      cost more than that: Qwen2-VL's one-patch step with dW ran 1.019x the rewrite
      where its larger steps, served by the C++ node, ran 0.947-0.962x (dea76e9).
    The node then serves where the backward directions chose the rows solver
    (native_serves). None after any other forward: the vendor's kernel, or an implicit
    GEMM where the rows are unaligned for cuBLAS, may beat the node's GEMM."""
    if forward.id in _ROWS_SOLVERS:
        return forward.id
    geometry = "point_output" if tuple(p.spatial) == tuple(p.kernel) else "pointwise"
    rows = get_solver(geometry)
    if not rows.is_applicable(p):
        return None
    if forward.weight_gradient_multiplies_columns and not forward.gathers_columns(p):
        return geometry
    if forward.id == "patch_implicit" and rows.gemm_is_aligned(p):
        return geometry
    return None


def _one_gemm_over_views(p: ConvProblem, solver_id: str) -> bool:
    """Whether ``solver_id`` computes ``p`` as the C++ node does: one GEMM over rows
    that are views of x (a one-patch input, or a channels-last 1x1), in a dtype the
    node computes, outside batch invariance's forms."""
    if solver_id not in _ROWS_SOLVERS:
        return False
    if p.device_type == "cuda" and p.dtype not in _NATIVE_CUDA_DTYPES:
        return False
    if get_solver(solver_id).runs_invariant(p):
        return False
    if solver_id == "point_output":
        return tuple(p.spatial) == tuple(p.kernel)  # else a cropped input: rows copied
    return p.layout is Layout.CHANNELS_LAST  # a channels-first 1x1 is batched products


def _backward_rows(problem: ConvProblem, need_dx: bool, need_dw: bool) -> bool:
    """Whether the backward directions of the forward ``problem`` that are needed chose
    a solver of the C++ node's GEMMs (decided, or found, as for any call)."""
    needed = ((Direction.BACKWARD_DATA, need_dx), (Direction.BACKWARD_WEIGHTS, need_dw))
    return all(
        dispatch.solver_for(backward_problem(problem, direction)).id in _ROWS_SOLVERS
        for direction, wanted in needed
        if wanted
    )


def native_note(
    problem: ConvProblem, need_dx: bool, need_dw: bool, road: TrainingRoad
) -> str | None:
    """For explain(): where eager calls of ``problem`` that need these gradients (their
    ``road``, training_road's) run gemmconv's C++ autograd node, a sentence saying so
    (by the layout rule of thumb: a call whose output torch lays out otherwise keeps
    the Python node)."""
    if road.on_torch or not native_node.wanted_on(problem.device_type):
        return None
    forward = road.gemm_solvers.get(Direction.FORWARD)  # None: the vendor's, no rows
    solver_id = None if forward is None else rows_solver(problem, get_solver(forward))
    if solver_id is None or not _one_gemm_over_views(problem, solver_id):
        return None
    if not _backward_rows(problem, need_dx, need_dw):
        return None
    return (
        f"eager calls that need {road.needed} run gemmconv's C++ autograd node "
        f"({native_node.status()})"
    )


def backward_problem(problem: ConvProblem, direction: Direction) -> ConvProblem:
    """The problem of a backward direction of a forward ``problem``, as its backward
    plan builds it: the forward's, without the bias, in ``direction``."""
    return dataclasses.replace(problem, has_bias=False).with_direction(direction)


@dataclasses.dataclass(frozen=True)
class TrainingRoad:
    """Where eager calls of a forward problem that need some gradients run."""

    on_torch: bool  # torch's convolution with its fused backward, not gemmconv's node
    needed: str  # "dx and dW", "dx", "dW" or "only the bias's gradient"
    gemm_solvers: dict[Direction, str]  # the directions that chose a GEMM solver
    saving_ms: float | None  # what those save over the vendor; None where unknown
    node_ms: float  # what gemmconv's autograd node costs the host

    def describe(self) -> str:
        """The sentence the dispatch log and explain() say where torch's convolution
        serves calls in place of GEMM solvers (``on_torch`` with ``gemm_solvers``)."""
        chosen = ", ".join(f"{d.value} {s}" for d, s in self.gemm_solvers.items())
        return (
            f"eager calls that need {self.needed} run torch's convolution and its fused "
            f"backward in place of {chosen}: they would save {self.saving_ms * 1000:.1f} us, "
            f"less than gemmconv's autograd node costs the host ({self.node_ms * 1000:.0f} us)"
        )


def training_road(problem: ConvProblem, need_dx: bool, need_dw: bool) -> TrainingRoad:
    """Where an eager call of the forward ``problem`` that needs these gradients runs:
    torch's convolution, with its fused backward, where the forward and the needed
    backward directions chose the vendor, and where what the GEMM solvers among them
    save over it is less than gemmconv's autograd node costs the host
    (DeviceRates.autograd_node_us); never against a forced or tried solver or a saving
    nobody estimated, and never against a backward GEMM that find timed in the public
    call (its call, node paid, beat the vendor's). Decides (or, in find modes,
    benchmarks) the directions it counts."""
    problems = {Direction.FORWARD: problem}
    for direction, needed_here in (
        (Direction.BACKWARD_DATA, need_dx),
        (Direction.BACKWARD_WEIGHTS, need_dw),
    ):
        if needed_here:
            problems[direction] = backward_problem(problem, direction)
    choices = {d: dispatch.choose(p) for d, p in problems.items()}
    rates = device_rates.rates_for(problem.device_type)
    savings = [_saving_over_vendor(choices[d], p, rates) for d, p in problems.items()]
    node_ms = rates.autograd_node_us / 1000
    saving_ms = None if None in savings else sum(savings)
    on_torch = saving_ms is not None and (not any(savings) or saving_ms < node_ms)
    needed = " and ".join(name for name, n in (("dx", need_dx), ("dW", need_dw)) if n)
    return TrainingRoad(
        on_torch=on_torch,
        needed=needed or "only the bias's gradient",
        gemm_solvers={d: c.solver for d, c in choices.items() if c.solver != "vendor"},
        saving_ms=saving_ms,
        node_ms=node_ms,
    )


def training_notes(problem: ConvProblem, needs: list[tuple[bool, bool]]) -> list[str]:
    """For explain(): per (dx needed, dW needed) in ``needs``, a sentence where such
    eager calls run torch's convolution though some direction chose a GEMM solver, one
    where they run gemmconv's C++ autograd node (native_note), and one where their
    forward runs the weight gradient's solver (column_forward_solver)."""
    notes = []
    for need_dx, need_dw in needs:
        road = training_road(problem, need_dx, need_dw)
        if road.on_torch and road.gemm_solvers:
            notes.append(road.describe())
        native = native_note(problem, need_dx, need_dw, road)
        if native is not None:
            notes.append(native)
        else:
            column = _column_note(problem, road)
            if column is not None:
                notes.append(column)
    return notes


def _column_note(problem: ConvProblem, road: TrainingRoad) -> str | None:
    """For explain(): where eager calls on ``road`` (training_road's) run their forward
    with the weight gradient's solver (column_forward_solver), a sentence saying so. The
    road holds the GEMM solvers its directions chose; a vendor's direction has none, and
    no switch either way."""
    forward = road.gemm_solvers.get(Direction.FORWARD)
    weights = road.gemm_solvers.get(Direction.BACKWARD_WEIGHTS)
    if road.on_torch or forward is None or weights is None:
        return None
    if not column_forward_solver(problem, get_solver(forward), get_solver(weights)):
        return None
    return (
        f"eager calls that need {road.needed} run the forward with {weights} in place of "
        f"{forward}: it gathers the columns {weights}'s weight gradient multiplies, once "
        "for both GEMMs"
    )


def _saving_over_vendor(
    choice: dispatch.Choice, problem: ConvProblem, rates: device_rates.DeviceRates
) -> float | None:
    """How many ms ``choice`` saves over the vendor on ``problem``, by the times it was
    decided on (measured by find, else estimated); None where it was forced or tried
    (dispatch.trial) or no time says. A backward direction's GEMM that find timed in
    the public call (``Choice.in_call``) beat the vendor's call on the road the
    vendor's takes, its node paid: it saves without bound, so the node serves.

    Estimated backward calls are compared without the node (``in_node=False``): the
    rule counts it once. Each estimate pays it as host time, which a device-bound
    vendor's call hides and a host-bound GEMM's does not, so the saving came out a node
    short: SD3's channels-last backward-data was estimated to save 35 us, under the
    node's 60, and went to cuDNN at 0.163 ms a call against patch_implicit's 0.079
    (H100 at 5202680)."""
    if choice.solver == "vendor":
        return 0.0
    times = choice.times_ms or choice.estimates_ms
    if choice.source in ("forced", "trial") or choice.solver not in times or "vendor" not in times:
        return None
    backward = problem.direction is not Direction.FORWARD
    if choice.in_call and choice.times_ms and backward:
        return math.inf
    if backward and not choice.times_ms:
        return get_solver("vendor").call_ms(problem, rates, in_node=False) - get_solver(
            choice.solver
        ).call_ms(problem, rates, in_node=False)
    return times["vendor"] - times[choice.solver]


# torch's public convolution per spatial rank, for the calls that go to the vendor.
_TORCH_CONVOLUTIONS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
# Argument objects an entry remembers: a model's modules of one configuration each pass
# their own; past this many, the entry starts again from the checked call's.
_ACCEPTED_MAX = 64
# dY of one call comes in few layouts (usually one); a bound all the same.
_BACKWARD_PLANS_MAX = 8
# Bounded like the ops' plans; emptied by dispatch.clear_cache() with the choices.
_CALLS_MAX = 4096
_calls: dict[tuple, _Call | None] = dispatch.dependent_cache()


def convolve(
    dims: int,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: object,
    padding: object,
    dilation: object,
    groups: object,
    module: torch.nn.Module | None = None,
) -> torch.Tensor | None:
    """The convolution on the eager road, or None where the road does not cover the
    call (the caller then takes the custom-op road). Operands are already cast as
    autocast would (the cast is autograd's business, outside this road). ``module``,
    a gemmconv.nn module making the call, remembers the input (remember_input).

    The road is closed (None) while anything traces, transforms or intercepts the
    call. The caller has already ruled out ``__torch_function__`` on every operand
    and dynamo's trace; torch.compile's other stages and non-strict export trace
    under dispatch modes, so ``torch.compiler.is_compiling()`` adds nothing here.
    The questions of transform_state.transforms_active are asked inline: a function
    call is a tenth of a microsecond on a path where each tenth shows against
    torch's own 5 us call (bench/results/overhead_cpu.md)."""
    if (
        _is_tracing() or _dispatch_modes() or _functorch_transforms()
        or forward_ad._current_level >= 0
    ):  # fmt: skip
        return None
    shape, strides, dtype, device = input.shape, input.stride(), input.dtype, input.device
    # One flat tuple: each level of nesting is another tuple built and hashed per call.
    # A bias's strides decide nothing the entry holds (a Triton launch keys on them).
    key = (
        dims, shape, strides, dtype, device,
        weight.shape, weight.stride(), weight.dtype, weight.device,
        None if bias is None else (bias.shape, bias.dtype, bias.device),
        stride, padding, dilation, groups, dispatch.selection_key(),
    )  # fmt: skip
    try:
        call = _calls[key]
    except TypeError:  # an argument that cannot be hashed (a list): the op road
        return None
    except KeyError:
        call = _new_call(dims, input, weight, bias, stride, padding, dilation, groups)
        if len(_calls) >= _CALLS_MAX:
            _calls.clear()
        _calls[key] = call
    if call is None:
        return None
    if module is not None:
        module.__dict__[LAST_INPUT] = (shape, strides, dtype, device)
    for known_stride, known_padding, known_dilation, known_groups in call.accepted:
        if (
            stride is known_stride and padding is known_padding
            and dilation is known_dilation and groups is known_groups
        ):  # fmt: skip
            break
    else:
        if not call.accepts((stride, padding, dilation, groups)):
            # Equal keys hold equal values, but 1.0 and True equal 1: arguments of other
            # types than the checked ones take the op road, which refuses them as
            # F.conv* would.
            return None
    needs_grad = _is_grad_enabled() and (
        input.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    if (
        call.vendor_serves(input.requires_grad, weight.requires_grad)
        if needs_grad
        else call.vendor_forward
    ):
        # Where every direction needed goes to the vendor, or the GEMM solvers save less
        # than gemmconv's autograd node costs (tiny problems, a 1x1 where cuBLAS and
        # cuDNN tie), torch's own convolution with its own fused backward is the
        # cheapest road: its public function, given as few arguments as say the same
        # (each parsed costs).
        if call.vendor_arguments:
            return call.vendor_function(input, weight, bias, *call.vendor_arguments)
        return call.vendor_function(input, weight, bias)
    if call.unbatched:
        input = input.unsqueeze(0)
    if needs_grad and call.rows_form is not None:
        node = native_node.rows_gemm
        if node is not None and call.native_serves(input.requires_grad, weight.requires_grad):
            if bias is not None:
                bias = _unwrap_if_dead(bias)
            return node(_unwrap_if_dead(input), _unwrap_if_dead(weight), bias, *call.rows_form)
    if needs_grad:
        if bias is not None:
            bias = _unwrap_if_dead(bias)
        y = _apply_convolution(_unwrap_if_dead(input), _unwrap_if_dead(weight), bias, call)
    else:
        y = ops.run_forward(call.plan, input, weight, bias)
    return y.squeeze(0) if call.unbatched else y


def _shortest_arguments(stride: list, padding: list, dilation: list, groups: int) -> tuple:
    """torch's convolution arguments after the operands, as few as say the same: a
    value equal in every dimension as one int, trailing defaults left out. Passing
    (1, 1), (0, 0), (1, 1), 1 costs torch's parser half a microsecond more than
    passing nothing (the CPU machine)."""
    given = [s[0] if len(set(s)) == 1 else tuple(s) for s in (stride, padding, dilation)]
    given.append(groups)
    while given and given[-1] == _DEFAULT_ARGUMENTS[len(given) - 1]:
        given.pop()
    return tuple(given)


_DEFAULT_ARGUMENTS = (1, 0, 1, 1)  # stride, padding, dilation, groups


def _same_kinds(arguments: tuple, checked: tuple) -> bool:
    """Whether ``arguments``, equal to ``checked``, are of the same types all through."""
    for value, known in zip(arguments, checked):
        if type(value) is not type(known):
            return False
        if isinstance(value, tuple) and any(map(_differ_in_type, value, known)):
            return False
    return True


def _differ_in_type(a: object, b: object) -> bool:
    return type(a) is not type(b)


def _holds_a_tensor(argument: object) -> bool:
    """Whether a stride, padding, dilation or groups argument is, or holds, a tensor."""
    if isinstance(argument, torch.Tensor):
        return True
    return isinstance(argument, tuple) and any(isinstance(a, torch.Tensor) for a in argument)


def _new_call(dims, input, weight, bias, stride, padding, dilation, groups) -> _Call | None:
    """Check the arguments (raising as F.conv* would) and build the call's plan; None
    for a call the road does not cover."""
    if input.device.type not in _DEVICE_TYPES or handed_to_torch(input, weight, bias):
        return None
    if any(map(_holds_a_tensor, (stride, padding, dilation, groups))):
        # A 0-d tensor's value can change while the object stays (s.fill_(4)), and the
        # key holds the object: the op road reads the value on every call. The entry
        # stays None, so the key's next calls go there at once.
        return None
    resolved = resolve_arguments(dims, input, weight, bias, stride, padding, dilation, groups)
    if resolved.input_padding:
        return None  # 'same' with an odd total pads the input first: the op road does it
    unbatched = input.dim() == dims + 1
    if unbatched:
        input = input.unsqueeze(0)
    conv_args = (
        list(resolved.stride),
        list(resolved.padding),
        list(resolved.dilation),
        resolved.groups,
    )
    plan = ops.forward_plan(input, weight, bias, *conv_args)
    return _Call(
        dims, plan, unbatched, (stride, padding, dilation, groups), conv_args, input, weight
    )


class _EagerConvolution(torch.autograd.Function):
    """The forward plan, with the backward directions as its gradient."""

    @staticmethod
    def forward(ctx, input, weight, bias, call: _Call):  # type: ignore[override]
        need_dx, need_dw, _, _ = ctx.needs_input_grad
        columns = None
        # The verdict read as an attribute once made: a method call per forward shows.
        if need_dw and (call.keeps_columns or call.columns_serve_weight_gradient()):
            # A forward that gathers columns keeps them for dW, as the reshape + linear
            # rewrite does: a column-GEMM weight gradient then runs its GEMM alone.
            y, columns = ops.run_forward_keeping_columns(call.column_plan, input, weight, bias)
        else:
            y = ops.run_forward(call.plan, input, weight, bias)
        # Keep only what the backward reads: the input (and columns) for dW, the weight
        # for dx. The input stays for a backward that is itself differentiated.
        ctx.save_for_backward(input if need_dw else None, weight if need_dx else None, columns)
        ctx.call = call
        return y

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        input, weight, columns = ctx.saved_tensors
        call: _Call = ctx.call
        need_dx, need_dw, need_db, _ = ctx.needs_input_grad
        if under_vmap(grad_output):
            dx, dw = vmap_safe_gradients(
                grad_output, input, weight, call.input_size, call.weight_size,
                call.conv_args, need_dx, need_dw,
            )  # fmt: skip
        elif _is_grad_enabled():
            dx, dw = _differentiable_gradients(call, grad_output, input, weight, need_dx, need_dw)
        elif columns is not None and not need_dx:
            # dW alone, from the kept columns (a patch embed's usual backward): the
            # shortest way, past call.gradients' and ops' frames where no autocast
            # would recast the GEMM's operands (ops.weight_gradient_from_columns).
            if _any_autocast_enabled():
                dw = ops.weight_gradient_from_columns(call.column_plan, grad_output, columns)
            else:
                dw = call.column_plan.runner.weight_gradient(grad_output, columns)
            dx = None
        else:
            dx, dw = call.gradients(grad_output, input, weight, columns, need_dx, need_dw)
        db = None
        if need_db:
            dims = call.bias_dims
            if dims is None:
                db = bias_grad(grad_output, out_channels=call.weight_size[0])
            else:  # bias_grad's sum, without its frame and checks
                db = grad_output.sum(dims)
        return dx, dw, db, None


# torch's Function.apply was a Python wrapper around the C apply up to torch 2.13 (2.11
# on the GPU machine): it routes calls made under torch.func transforms, which never
# take this road, and unwraps operands that are functorch wrappers of finished
# transforms (dead ones), about a dozen Python calls a convolution. The road calls the
# C apply itself and unwraps as the wrapper does.
_apply_convolution = torch._C._FunctionBase.__dict__["apply"].__get__(None, _EagerConvolution)
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


def _differentiable_gradients(call, grad_output, input, weight, need_dx, need_dw):
    """dx and dW through the custom ops, whose own autograd formulas make double
    backward work: the backward of a backward that is itself differentiated
    (create_graph=True)."""
    args = (*call.conv_args, call.channels_last)
    dx = dw = None
    if need_dx:
        dx = torch.ops.gemmconv.conv_backward_data(grad_output, weight, call.input_size, *args)
    if need_dw:
        dw = torch.ops.gemmconv.conv_backward_weights(grad_output, input, call.weight_size, *args)
    return dx, dw


def clear() -> None:
    """Forget every eager call (dispatch.clear_cache() does this too)."""
    _calls.clear()


__all__ = [
    "LAST_INPUT",
    "SeenInput",
    "TrainingRoad",
    "backward_problem",
    "clear",
    "convolve",
    "remember_input",
    "training_notes",
    "training_road",
]
