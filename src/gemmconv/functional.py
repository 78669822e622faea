"""conv1d / conv2d / conv3d with the signatures and defaults of torch.nn.functional.

Argument checks, string padding, unbatched inputs and autocast are handled here, in
traceable Python. In plain eager code the convolution takes the eager road
(gemmconv.roads.eager), a cached call of the op implementations; otherwise it is the
``gemmconv::conv_forward`` custom op, whose autograd formula (gemmconv.roads.autograd) runs
the two backward ops, and while a torch.func transform or a forward-AD level is
active the same op runs through gemmconv.roads.func_transforms, which has the rules those
need. Operands with a ``__torch_function__`` (fx's symbolic-tracing Proxy among them)
and torch-function modes see the public function first, as they see F.conv*.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import handle_torch_function, has_torch_function_variadic

import gemmconv.roads.autograd  # noqa: F401  (registers the forward op's backward)
import gemmconv.roads.in_call  # noqa: F401  (gives find its candidates' public calls)
from gemmconv.core.arguments import (
    IntOrTuple,
    Padding,
    ResolvedArguments,
    _resolved,
    check_against_tensors,
    check_argument_kinds,
    handed_to_torch,
    handed_to_torch_reason,
    resolve_arguments,
)
from gemmconv.core.float8 import Float8Config, as_config
from gemmconv.core.problem import ConvProblem
from gemmconv.roads import decompositions, eager, float8, func_transforms, onnx_symbolic
from gemmconv.roads.transform_state import transforms_active
from gemmconv.selection.dispatch import Choice, explain_problem

# Devices whose is_autocast_enabled raises. A fixed set rather than asking
# torch.amp.is_autocast_available, which torch 2.11's dynamo cannot trace (fullgraph
# compiles of converted models broke on it).
_DEVICES_WITHOUT_AUTOCAST = frozenset({"meta"})


def _autocast(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The operands cast as torch's convolutions are when autocast is on for the
    input's device: autocast casts floating-point operands except float64 ones
    (torch's is_eligible). Cast first, then checked as any call, as torch's autocast
    casts before its convolution checks: mixed operand dtypes are fine, and a dtype
    autocast leaves alone (float64, an integer) is named as torch names it."""
    device_type = "cuda" if input.is_cuda else input.device.type
    if device_type in _DEVICES_WITHOUT_AUTOCAST or not torch.is_autocast_enabled(device_type):
        return input, weight, bias
    dtype = torch.get_autocast_dtype(device_type)
    input, weight, bias = (
        t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t
        for t in (input, weight, bias)
    )
    return input, weight, bias


# Bound once for the eager branch of _conv, where each lookup through the torch
# module shows (bench/results/overhead_cpu.md); dynamo's trace reads torch's own.
_any_autocast_enabled = torch._C._is_any_autocast_enabled


def _remember_off_the_road(module: torch.nn.Module | None, input: object) -> None:
    """Remember a module's input that did not take the eager road, except while
    compiling (a side effect on a symbolic shape), under torch.func transforms (they
    run other problems: vmap folds its batch in), for fx's symbolic tracing (its
    Proxy has no metadata) and on the meta device, where no solver runs."""
    if (
        module is not None
        and not torch.compiler.is_compiling()
        and not transforms_active()
        and isinstance(input, torch.Tensor)
        and not input.is_meta
    ):
        eager.remember_input(module, input)


def _conv(
    dims, input, weight, bias, stride, padding, dilation, groups, module=None
) -> torch.Tensor:
    """The convolution behind conv1d/2d/3d and the gemmconv.nn modules; ``module``
    is the module calling, which remembers its input for ``solvers()``."""
    if has_torch_function_variadic(input, weight, bias):
        _remember_off_the_road(module, input)
        # As F.conv* do: fx's symbolic tracing records the public function as one node
        # (its Proxy has no shapes to run the rest with), and __torch_function__
        # subclasses and modes see it too.
        return handle_torch_function(
            _PUBLIC[dims], (input, weight, bias), input, weight, bias, stride, padding,
            dilation, groups,
        )  # fmt: skip
    if (
        isinstance(input, torch.Tensor)
        and isinstance(weight, torch.Tensor)
        and (bias is None or isinstance(bias, torch.Tensor))
    ):
        if torch.compiler.is_dynamo_compiling():
            return _traced_convolution(dims, input, weight, bias, stride, padding, dilation, groups)
        if _any_autocast_enabled():  # one C call where autocast is off
            input, weight, bias = _autocast(input, weight, bias)
        y = eager.convolve(dims, input, weight, bias, stride, padding, dilation, groups, module)
        if y is not None:
            return y
        # The op road. The eager road remembered a module's input only where it found
        # the call's entry; remembering it again is harmless.
        _remember_off_the_road(module, input)
        if handed_to_torch(input, weight, bias):
            return _torch_convolution(dims, input, weight, bias, stride, padding, dilation, groups)
    args = resolve_arguments(dims, input, weight, bias, stride, padding, dilation, groups)
    onnx_symbolic.register_if_tracing()
    if decompositions.exporting():
        convolve = decompositions.conv_forward  # an exported program: portable aten
    elif transforms_active():
        convolve = func_transforms.conv_forward
    else:
        convolve = torch.ops.gemmconv.conv_forward
    return _convolve_resolved(convolve, dims, input, weight, bias, args)


def _conv_fp8(
    dims, input, weight, bias, stride, padding, dilation, groups, module, config: Float8Config
) -> torch.Tensor:
    """The convolution of a module configured for fp8 (``module.set_fp8``): the fp8
    run where it applies (gemmconv.roads.float8), else ``_conv``, as without fp8."""
    if (
        has_torch_function_variadic(input, weight, bias)
        or not (
            isinstance(input, torch.Tensor)
            and isinstance(weight, torch.Tensor)
            and (bias is None or isinstance(bias, torch.Tensor))
        )
        or transforms_active()
    ):
        # fx's Proxy, __torch_function__ subclasses and torch.func transforms see the
        # ordinary convolution, whose rules they have.
        return _conv(dims, input, weight, bias, stride, padding, dilation, groups, module)
    if torch._C._is_any_autocast_enabled():
        # Cast as _conv would: under autocast the fp8 GEMMs write autocast's dtype.
        input, weight, bias = _autocast(input, weight, bias)
    decision = float8.decision_of(
        dims, input, weight, bias, stride, padding, dilation, groups, config
    )
    if isinstance(decision, list):
        return _conv(dims, input, weight, bias, stride, padding, dilation, groups, module)
    _remember_off_the_road(module, input)
    if input.dim() == dims + 1:
        return float8.convolve(decision, input.unsqueeze(0), weight, bias).squeeze(0)
    return float8.convolve(decision, input, weight, bias)


def _traced_convolution(dims, input, weight, bias, stride, padding, dilation, groups):
    """The convolution as dynamo traces it (torch.compile, strict export). Every module
    global and function a trace reads becomes a guard that each call of the compiled
    code checks. So only the arguments' kinds are checked here; their values against
    the tensors are checked by the op's fake implementation, which dynamo runs without
    guarding what it reads (a mistake is raised from there, wrapped by dynamo, as
    torch's own convolution's are under torch.compile). On the CPU machine that took
    2 us off each call of a compiled function (bench/NOTES.md)."""
    if torch._C._is_any_autocast_enabled():
        input, weight, bias = _autocast(input, weight, bias)
    if handed_to_torch(input, weight, bias):
        return _torch_convolution(dims, input, weight, bias, stride, padding, dilation, groups)
    kinds = check_argument_kinds(dims, input, weight, bias, stride, padding, dilation, groups)
    transformed = transforms_active()
    if transformed or input.dtype == torch.bool:
        # torch.func's form of the op has no fake implementation of its own, and a bool
        # input is refused with NotImplementedError, which dynamo takes from a fake
        # implementation as "run this op eagerly", where it would run unchecked.
        check_against_tensors(dims, input, weight, bias, kinds)
    convolve = func_transforms.conv_forward if transformed else torch.ops.gemmconv.conv_forward
    return _convolve_resolved(convolve, dims, input, weight, bias, _resolved(kinds, weight))


def _torch_convolution(dims, input, weight, bias, stride, padding, dilation, groups):
    """A call gemmconv does not compute (validate.handed_to_torch: an integer, complex,
    float8 or quantized dtype, a sparse or mkldnn operand), given to torch's
    convolution whole: its result, or its refusal with its exception type and a
    message that names the operand (the arguments' kinds are checked first, as torch's
    parser checks them before anything else)."""
    check_argument_kinds(dims, input, weight, bias, stride, padding, dilation, groups)
    try:
        # Looked up on every call, not bound: a wrapper of torch's function (a
        # profiler's, a test's) sees these calls as it sees the user's own.
        convolution = getattr(F, _TORCH_CONVOLUTIONS[dims])
        return convolution(input, weight, bias, stride, padding, dilation, groups)
    except Exception as e:
        reason = handed_to_torch_reason(input, weight, bias)
        message = f"conv{dims}d: {reason}; torch's convolution refuses the call: {e}"
        try:
            refusal = type(e)(message)
        except Exception:  # an exception type that takes other arguments: torch's own
            raise e from None
        raise refusal from e


_TORCH_CONVOLUTIONS = {1: "conv1d", 2: "conv2d", 3: "conv3d"}


def _convolve_resolved(convolve, dims, input, weight, bias, args: ResolvedArguments):
    """``convolve`` (the op, or a form of it) on batched, padded operands."""
    unbatched = input.dim() == dims + 1
    y = convolve(
        _op_input(input, dims, args), weight, bias, list(args.stride), list(args.padding),
        list(args.dilation), args.groups,
    )  # fmt: skip
    return y.squeeze(0) if unbatched else y


def _op_input(input: torch.Tensor, dims: int, args: ResolvedArguments) -> torch.Tensor:
    """``input`` as the op takes it: batched, and padded first where 'same' needs it."""
    if input.dim() == dims + 1:
        input = input.unsqueeze(0)
    if args.input_padding:
        input = F.pad(input, args.input_padding)
    return input


def conv1d(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: IntOrTuple = 1,
    padding: Padding = 0,
    dilation: IntOrTuple = 1,
    groups: int = 1,
) -> torch.Tensor:
    """1-D convolution with the arguments, defaults and result of
    ``torch.nn.functional.conv1d``, computed by gemmconv.

    ``input`` is [N, C, W] (or [C, W] unbatched), ``weight`` [K, C / groups, R];
    ``padding`` takes ints or ``'same'``/``'valid'``. A problem that is a matrix product (a
    patch embedding with stride == kernel and no padding, one window of any stride, a 1x1, a
    strided 1x1) runs as one GEMM in each direction; any other goes to torch's convolution.
    Differentiable in every input; ``gemmconv.explain`` with the same arguments says which
    solver runs each direction and why.
    """
    return _conv(1, input, weight, bias, stride, padding, dilation, groups)


def conv2d(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: IntOrTuple = 1,
    padding: Padding = 0,
    dilation: IntOrTuple = 1,
    groups: int = 1,
) -> torch.Tensor:
    """2-D convolution with the arguments, defaults and result of
    ``torch.nn.functional.conv2d``, computed by gemmconv.

    ``input`` is [N, C, H, W] (or [C, H, W] unbatched), in either memory format;
    ``weight`` is [K, C / groups, R, S]; ``padding`` takes ints or
    ``'same'``/``'valid'``. A problem that is a matrix product (a patch embedding with
    stride == kernel and no padding, one window of any stride, a 1x1, a strided 1x1) runs as
    one GEMM in each direction; any other goes to torch's convolution. The result has the
    memory format torch would give. Differentiable in every input; ``gemmconv.explain`` with
    the same arguments says which solver runs each direction and why.

    Example: ``gemmconv.conv2d(images, weight, stride=16)`` for a ViT-B/16 patch
    embedding with ``weight`` of shape [768, 3, 16, 16].
    """
    return _conv(2, input, weight, bias, stride, padding, dilation, groups)


def conv3d(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: IntOrTuple = 1,
    padding: Padding = 0,
    dilation: IntOrTuple = 1,
    groups: int = 1,
) -> torch.Tensor:
    """3-D convolution with the arguments, defaults and result of
    ``torch.nn.functional.conv3d``, computed by gemmconv.

    ``input`` is [N, C, D, H, W] (or [C, D, H, W] unbatched), in either memory
    format; ``weight`` is [K, C / groups, T, R, S]; ``padding`` takes ints or
    ``'same'``/``'valid'``. A problem that is a matrix product (a video or Qwen-VL patch
    embedding with stride == kernel and no padding, one window of any stride, a 1x1x1, a
    strided 1x1x1) runs as one GEMM in each direction; any other goes to torch's
    convolution. Differentiable in every input; ``gemmconv.explain`` with the same arguments
    says which solver runs each direction and why.
    """
    return _conv(3, input, weight, bias, stride, padding, dilation, groups)


_PUBLIC = {1: conv1d, 2: conv2d, 3: conv3d}


def explain(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: IntOrTuple = 1,
    padding: Padding = 0,
    dilation: IntOrTuple = 1,
    groups: int = 1,
    *,
    fp8: Float8Config | bool | None = None,
) -> dict[str, Choice]:
    """Which solver would run each direction for these ``conv1d/2d/3d`` arguments, and
    why each other solver would not. With ``fp8`` (a ``gemmconv.Float8Config`` or True,
    as a module's ``set_fp8`` takes it), ``.notes`` also says whether a module so
    configured would run this call in fp8, and if not, why. Runs nothing in the
    immediate and database find modes (in find and hybrid modes an undecided problem
    is benchmarked, as the convolution itself would be).

    Returns a dict keyed by "forward", "backward_data" and "backward_weights" whose
    repr is a table; each value is a ``gemmconv.Choice`` with ``.solver`` (an id),
    ``.source`` (estimate, database, find, forced), ``.reason``, ``.estimates_ms``
    and ``.rejected`` (id -> list of reasons). The dimensionality comes from the
    weight. Where the tensors need gradients and an eager call with them would run
    torch's convolution with its fused backward in place of the GEMM solvers named
    (their saving below what gemmconv's autograd node costs), ``.notes`` says so, and
    so does the table. For tensors off CUDA, ``.on_cuda`` holds the choices the cost
    model would make for the same call on CUDA (what runs here and on a GPU can
    differ), and the table ends with them. Example:
    ``gemmconv.explain(x, w, stride=16)["forward"].solver``.
    """
    config = as_config(fp8, "explain(fp8)")
    problem = problem_of(input, weight, bias, stride, padding, dilation, groups)
    explanation = explain_problem(problem)
    if any(t is not None and t.requires_grad for t in (input, weight, bias)):
        needs = [(input.requires_grad, weight.requires_grad)]
        explanation.notes += eager.training_notes(problem, needs)
    if config is not None:
        explanation.notes.append(fp8_note(input, weight, bias, stride, padding, dilation,
                                          groups, config))  # fmt: skip
    return explanation


def fp8_note(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: IntOrTuple,
    padding: Padding,
    dilation: IntOrTuple,
    groups: int,
    config: Float8Config,
    where: str = "this call",
) -> str:
    """Whether a convolution configured with ``config`` runs these arguments in fp8, and
    if not, why (a line of explain()'s and module.solvers()'s notes)."""
    dims = weight.dim() - 2
    input, weight, bias = _autocast(input, weight, bias)
    decision = float8.decision_of(
        dims, input, weight, bias, stride, padding, dilation, groups, config
    )
    return float8.explanation_note(config, decision, where)


def problem_of(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: IntOrTuple = 1,
    padding: Padding = 0,
    dilation: IntOrTuple = 1,
    groups: int = 1,
) -> ConvProblem:
    """The forward ConvProblem the custom op would build for these F.conv* arguments."""
    dims = weight.dim() - 2
    if isinstance(input, torch.Tensor) and (bias is None or isinstance(bias, torch.Tensor)):
        # As the convolution does: cast as autocast would, then check.
        input, weight, bias = _autocast(input, weight, bias)
    args = resolve_arguments(dims, input, weight, bias, stride, padding, dilation, groups)
    return ConvProblem.from_tensors(
        _op_input(input, dims, args),
        weight,
        bias,
        args.stride,
        args.padding,
        args.dilation,
        args.groups,
    )
