"""convert(model) and revert(model): swap torch convolutions for gemmconv's, in place.

A convolution is swapped when its problem class is a GEMM whatever the input size:
patch (stride == kernel, no padding, unit dilation; point-output when the input is
one patch), pointwise (1x1, stride 1) and strided pointwise (1x1, stride > 1), all
with groups 1. Everything else is left alone, with the reason in the report.

The swap changes the module's class and nothing else: the module object, its
Parameter objects, hooks and parametrizations (torch.nn.utils.parametrize, LoRA-style
wrappers of the weight) stay exactly as they were, so optimizer state and every
reference to the module remain valid. A parametrized module's class is a subclass
torch generates over the original; it is regenerated over the new base.

``memory_format=torch.channels_last`` also lays each swapped 2-D/3-D convolution's
weight out channels-last (channels_last_3d for Conv3d), in place: F.conv* returns a
channels-last output for a channels-last weight, so a patch embed writes its tokens as
rows [N*L, D] and the model's ``flatten(2).transpose(1, 2)`` is a view.

``fp8=gemmconv.Float8Config()`` (or True) also runs each swapped convolution in fp8
where fp8 applies (``module.set_fp8``); it touches nothing but convolutions, so
torchao's ``convert_to_float8_training`` (which swaps only ``nn.Linear``) and it
compose on one model, in either order.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import warnings
from collections.abc import Callable, Iterable, Sequence

import torch
from torch.nn.modules.conv import _ConvNd
from torch.nn.utils import parametrize

from gemmconv.core.float8 import Float8Config, as_config
from gemmconv.core.memory_format import (
    CHANNELS_LAST_FORMATS,
    check_weight_format,
    is_channels_last_format,
    layout_of,
    set_weight_format,
)
from gemmconv.core.problem import DIRECTIONS, ConvProblem
from gemmconv.nn import GEMMCONV_CLASS, TORCH_CLASS
from gemmconv.selection.dispatch import estimate, estimate_on_cuda
from gemmconv.solvers import float8 as float8_run

# include= / exclude=: glob pattern(s) on qualified module names, or a predicate.
ModuleFilter = str | Sequence[str] | Callable[[str, torch.nn.Module], bool] | None


@dataclasses.dataclass(frozen=True)
class SwappedConv:
    name: str
    torch_class: str
    problem_class: str
    in_channels: int
    out_channels: int
    kernel_size: tuple[int, ...]
    stride: tuple[int, ...]
    # What memory_format= did to the weight ("" when it was not given).
    weight_format: str = ""
    # Where the weight is and its dtype when converted, and per direction ("forward",
    # "backward_data", "backward_weights") the solver ids the cost model picks there
    # over the report's input sizes (_REPORT_SIZES): empty where it
    # picks none (a meta or other device). "vendor" is torch's own convolution.
    device: str = ""
    dtype: str = ""
    solvers: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict, hash=False)
    # The same for the module moved to CUDA; empty when it is on CUDA already.
    solvers_on_cuda: dict[str, tuple[str, ...]] = dataclasses.field(
        default_factory=dict, hash=False
    )
    # What fp8= configured ("" when it was not given), and why fp8 cannot apply to
    # this convolution whatever its input ("" when it can, on a capable GPU).
    fp8: str = ""
    fp8_not_applicable: str = ""


@dataclasses.dataclass(frozen=True)
class SkippedConv:
    name: str
    module_class: str
    reason: str


@dataclasses.dataclass
class ConversionReport:
    """What convert() swapped and, for every convolution it left alone, why."""

    swapped: list[SwappedConv] = dataclasses.field(default_factory=list)
    skipped: list[SkippedConv] = dataclasses.field(default_factory=list)

    @property
    def swapped_names(self) -> list[str]:
        return [s.name for s in self.swapped]

    @property
    def skipped_names(self) -> list[str]:
        return [s.name for s in self.skipped]

    def __str__(self) -> str:
        lines = [f"gemmconv.convert: {len(self.swapped)} swapped, {len(self.skipped)} left alone"]
        for s in self.swapped:
            lines.append(
                f"  swapped  {_display(s.name)}: {s.torch_class}({s.in_channels}, "
                f"{s.out_channels}, kernel_size={s.kernel_size}, stride={s.stride}) "
                f"-> {s.problem_class}" + (f", weight {s.weight_format}" if s.weight_format else "")
            )
            runs = _runs_text(s)
            if runs:
                lines.append(f"           {runs}")
            if s.fp8:
                fp8 = (
                    f"{s.fp8}; will not apply: {s.fp8_not_applicable}"
                    if s.fp8_not_applicable
                    else f"{s.fp8} (on CUDA, compute capability 8.9 and up)"
                )
                lines.append(f"           {fp8}")
        for s in self.skipped:
            lines.append(f"  left     {_display(s.name)}: {s.module_class}: {s.reason}")
        if any(s.solvers or s.solvers_on_cuda for s in self.swapped):
            lines.append(
                "  (per direction, the cost model's pick for batch 1-64 at 7-56 outputs a "
                "side: GEMM = a gemmconv solver, torch = torch's own convolution, 'or' = by "
                "input size; module.solvers(x) names the solver for an input)"
            )
        return "\n".join(lines)


# The input sizes convert()'s report estimates what runs over (it has no input), as
# (batch, outputs per spatial side): the corners and middle of a single image to a
# training batch and a 7x7 map to a ResNet's 56x56 (a ViT-B/16 makes 14x14 patches).
_REPORT_SIZES = ((1, 7), (1, 56), (8, 14), (64, 7), (64, 56))
_DIRECTION_NAMES = {"forward": "forward", "backward_data": "dX", "backward_weights": "dW"}


def _label(solver_ids: tuple[str, ...]) -> str:
    """A direction's solvers over the report's sizes as GEMM, torch, or both by size."""
    kinds = {"torch" if sid == "vendor" else "GEMM" for sid in solver_ids}
    return " or ".join(sorted(kinds))


def _runs_text(s: SwappedConv) -> str:
    def directions(solvers: dict[str, tuple[str, ...]]) -> str:
        return ", ".join(f"{_DIRECTION_NAMES[d]} {_label(ids)}" for d, ids in solvers.items())

    parts = []
    if s.solvers:
        parts.append(f"runs on {s.device} ({s.dtype}): {directions(s.solvers)}")
    if s.solvers_on_cuda:
        parts.append(f"on CUDA: {directions(s.solvers_on_cuda)}")
    return "; ".join(parts)


def convert(
    model: torch.nn.Module,
    *,
    include: ModuleFilter = None,
    exclude: ModuleFilter = None,
    memory_format: torch.memory_format | None = None,
    fp8: Float8Config | bool | None = None,
) -> ConversionReport:
    """Swap, in place, every GEMM-reducible torch Conv1d/2d/3d in ``model`` for gemmconv's.

    ``include`` keeps only the convolutions it matches, ``exclude`` drops those it
    matches; each is a glob pattern on the qualified module name (``"blocks.*.proj"``),
    a list of them, or a predicate ``(name, module) -> bool``.

    ``memory_format`` (default None: weights stay as they are) re-lays each swapped
    convolution's weight out in place, the Parameter object kept: torch.channels_last
    or torch.channels_last_3d put a Conv2d's weight in channels_last and a Conv3d's in
    channels_last_3d (outputs then come back channels-last, as F.conv* returns them);
    torch.contiguous_format makes weights contiguous. A Conv1d's weight is left as it
    is (torch has no channels-last format for it), and so is a parametrized weight
    (the parametrization computes it); the report says so. Change the format before
    the first optimizer step: optimizer state made earlier keeps the old layout, and
    torch's fused optimizers pair the wrong elements of mismatched layouts (as after
    ``model.to(memory_format=...)``).

    Returns a report of what was swapped and why each other convolution was not, and
    for each swapped one what runs per direction on the device its weight is on, at
    its dtype, and what would run on CUDA: the cost model's picks (``"vendor"`` is
    torch's own convolution) over a range of input sizes, since convert() sees no
    input; ``module.solvers(x)`` or ``gemmconv.explain`` name the solver for an input.
    ``fp8`` (a ``gemmconv.Float8Config``, or True for the default one) runs each
    swapped convolution's three directions as fp8 GEMMs where fp8 applies: on CUDA
    devices of compute capability 8.9 and up, for patch, point-output and stride-1
    1x1 convolutions with out_channels a multiple of 16; elsewhere the module runs
    as without it, and ``module.solvers(x)`` says why. The report names the swapped
    convolutions fp8 can never apply to.

    Warns (UserWarning) where ``include`` matches no convolution.
    """
    memory_format = check_weight_format("convert", memory_format)
    fp8_config = as_config(fp8, "convert(fp8)")
    matches_include = _matcher(include, "include")
    matches_exclude = _matcher(exclude, "exclude")
    include_patterns = _patterns(include, "include")
    unmatched = list(include_patterns)
    included_any = False
    report = ConversionReport()
    runs: dict[tuple, tuple[dict, dict]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, _ConvNd):
            continue
        unmatched = [p for p in unmatched if not fnmatch.fnmatchcase(name, p)]
        included = include is None or matches_include(name, module)
        included_any = included_any or included
        kind = _unparametrized_class(module).__name__
        reason = _reason_not_to_swap(module)
        if reason is None and not included:
            reason = "not matched by include"
        if reason is None and exclude is not None and matches_exclude(name, module):
            reason = "matched by exclude"
        if reason is not None:
            report.skipped.append(SkippedConv(name, kind, reason))
            continue
        base = _unparametrized_class(module)
        _set_base_class(module, GEMMCONV_CLASS[base])
        weight_format = (
            "" if memory_format is None else _lay_out_weight(name, module, memory_format)
        )
        weight = module.weight
        key = _runs_key(module, weight)
        if key not in runs:
            runs[key] = _what_runs(module, weight)
        solvers, solvers_on_cuda = runs[key]
        fp8_text = fp8_not_applicable = ""
        if fp8_config is not None:
            module._gemmconv_fp8 = fp8_config
            fp8_text = fp8_config.describe()
            fp8_not_applicable = "; ".join(_fp8_reasons(module))
        report.swapped.append(
            SwappedConv(
                name=name,
                torch_class=base.__name__,
                problem_class=problem_class(module),
                in_channels=module.in_channels,
                out_channels=module.out_channels,
                kernel_size=tuple(module.kernel_size),
                stride=tuple(module.stride),
                weight_format=weight_format,
                device=weight.device.type,
                dtype=str(weight.dtype).removeprefix("torch."),
                solvers=solvers,
                solvers_on_cuda=solvers_on_cuda,
                fp8=fp8_text,
                fp8_not_applicable=fp8_not_applicable,
            )
        )
    _warn_unmatched_include(include, unmatched, included_any)
    return report


def _warn_unmatched_include(include: ModuleFilter, unmatched: list[str], included_any: bool):
    """A UserWarning where ``include`` matched no convolution: a misspelt name would
    otherwise convert nothing in silence. Per glob pattern that matched none; for a
    predicate, when it accepted none. ``exclude`` matching nothing changes nothing
    the caller wanted, so it is not warned about."""
    if unmatched:
        listed = ", ".join(repr(p) for p in unmatched)
        warnings.warn(
            f"convert(include={include!r}): pattern(s) {listed} matched no convolution's "
            "qualified name (glob patterns on names from model.named_modules(), e.g. "
            "'blocks.*.proj')",
            UserWarning,
            stacklevel=3,
        )
    elif callable(include) and not included_any:
        warnings.warn(
            f"convert(include={include!r}): the predicate accepted no convolution",
            UserWarning,
            stacklevel=3,
        )


def _runs_key(module: _ConvNd, weight: torch.Tensor) -> tuple:
    """What _what_runs depends on: modules alike share one estimate."""
    return (
        module.in_channels,
        module.out_channels,
        tuple(module.kernel_size),
        tuple(module.stride),
        module.bias is not None,
        weight.dtype,
        weight.device.type,
        weight.stride(),
    )


def _what_runs(
    module: _ConvNd, weight: torch.Tensor
) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]]:
    """Per direction, the solver ids the cost model picks for the module over the
    report's input sizes, on the weight's device at its dtype and on CUDA. Pure: no
    find database, no measurement (convert runs nothing)."""
    here: dict[str, list[str]] = {d.value: [] for d in DIRECTIONS}
    on_cuda: dict[str, list[str]] = {d.value: [] for d in DIRECTIONS}
    estimate_here = weight.device.type in ("cpu", "cuda")
    meta_weight = weight.detach().to("meta")
    for n, side in _REPORT_SIZES:
        spatial = tuple(side * s for s in module.stride)
        # A channels-first stand-in input: the layout is the weight's, as F.conv* rules.
        stand_in = torch.empty((n, module.in_channels, *spatial), device="meta")
        problem = ConvProblem.from_sizes(
            n, module.in_channels, module.out_channels, spatial, tuple(module.kernel_size),
            tuple(module.stride), has_bias=module.bias is not None,
            layout=layout_of(stand_in, meta_weight), dtype=weight.dtype,
            device_type=weight.device.type,
        )  # fmt: skip
        if estimate_here:
            try:
                for d in DIRECTIONS:
                    here[d.value].append(estimate(problem.with_direction(d)).solver)
            except (RuntimeError, ValueError):
                # A forced solver that does not apply here: the convolution itself
                # will say so; the report says nothing of this device.
                estimate_here = False
        if weight.device.type != "cuda":
            for d, choice in estimate_on_cuda(problem).items():
                on_cuda[d].append(choice.solver)

    def distinct(ids: dict[str, list[str]]) -> dict[str, tuple[str, ...]]:
        return {d: tuple(dict.fromkeys(v)) for d, v in ids.items() if v}

    return (distinct(here) if estimate_here else {}), distinct(on_cuda)


def _fp8_reasons(module: _ConvNd) -> list[str]:
    """Why fp8 can apply to no input of ``module`` (a representative bf16 CUDA input
    of 7 outputs a side stands in for all: the reasons depend on the module alone)."""
    spatial = tuple(7 * s for s in module.stride)
    problem = ConvProblem.from_sizes(
        1, module.in_channels, module.out_channels, spatial, tuple(module.kernel_size),
        tuple(module.stride), dtype=torch.bfloat16, device_type="cuda",
    )  # fmt: skip
    return float8_run.problem_reasons(problem)


def revert(model: torch.nn.Module) -> list[str]:
    """Turn every gemmconv convolution in ``model`` back into its torch class, in place.

    Returns the qualified names of the modules reverted."""
    reverted = []
    for name, module in model.named_modules():
        base = _unparametrized_class(module)
        if base in TORCH_CLASS:
            _set_base_class(module, TORCH_CLASS[base])
            # Runtime state the gemmconv class kept on the instance (the last input's
            # metadata, of a gemmconv type): a reverted model must pickle without gemmconv.
            for key in [k for k in vars(module) if k.startswith("_gemmconv_")]:
                del module.__dict__[key]
            reverted.append(name)
    return reverted


def problem_class(module: _ConvNd) -> str:
    """The GEMM problem class of a convolution module that convert() would swap."""
    if all(r == 1 for r in module.kernel_size):
        return "pointwise" if all(u == 1 for u in module.stride) else "strided pointwise"
    return "patch"


# ---- classification ---------------------------------------------------------


def _reason_not_to_swap(module: _ConvNd) -> str | None:
    base = _unparametrized_class(module)
    if base in TORCH_CLASS:
        return "already a gemmconv module"
    if base not in GEMMCONV_CLASS:
        if module.transposed:
            return "transposed convolution (not a forward GEMM problem gemmconv handles)"
        return (
            f"{base.__module__}.{base.__qualname__} is not torch.nn.Conv1d/2d/3d itself "
            "(a subclass may compute something else in its forward)"
        )
    if (
        isinstance(module, torch.nn.modules.lazy.LazyModuleMixin)
        and module.has_uninitialized_params()
    ):
        return "lazy module with uninitialised parameters"
    reasons = []
    if module.groups != 1:
        reasons.append(f"groups={module.groups} (only groups=1 is one GEMM)")
    padding = _padding_amounts(module)
    if any(padding):
        reasons.append(f"padding={module.padding!r}")
    kernel, stride, dilation = module.kernel_size, module.stride, module.dilation
    pointwise = all(r == 1 for r in kernel)
    if not pointwise:
        if tuple(stride) != tuple(kernel):
            reasons.append(
                f"kernel_size={tuple(kernel)} with stride={tuple(stride)}: neither a patch "
                "(stride == kernel) nor a 1x1"
            )
        if any(d != 1 for d in dilation):
            reasons.append(f"dilation={tuple(dilation)}")
    return "; ".join(reasons) if reasons else None


def _padding_amounts(module: _ConvNd) -> tuple[int, ...]:
    """Total padding per spatial dimension, string paddings resolved as torch does."""
    if module.padding == "valid":
        return (0,) * len(module.kernel_size)
    if module.padding == "same":
        return tuple(d * (r - 1) for d, r in zip(module.dilation, module.kernel_size, strict=True))
    return tuple(module.padding)


def _patterns(spec: ModuleFilter, argument: str) -> list[str]:
    """The glob patterns of ``include=`` / ``exclude=`` (none for None or a predicate)."""
    if spec is None or callable(spec):
        return []
    return _checked_patterns(spec, argument)


def _matcher(spec: ModuleFilter, argument: str) -> Callable[[str, torch.nn.Module], bool]:
    if spec is None:
        return lambda name, module: True
    if callable(spec):
        return spec
    patterns = _checked_patterns(spec, argument)
    return lambda name, module: any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _checked_patterns(spec: ModuleFilter, argument: str) -> list[str]:
    expected = "expected a glob pattern (str), a list of them, or a callable (name, module) -> bool"
    if isinstance(spec, str):
        patterns = [spec]
    elif isinstance(spec, Iterable) and not isinstance(spec, bytes):
        patterns = list(spec)
    else:
        raise TypeError(f"{argument}={spec!r}: {expected}; got {type(spec).__name__}")
    not_str = [p for p in patterns if not isinstance(p, str)]
    if not_str:
        raise TypeError(
            f"{argument}={spec!r}: {expected}; got {not_str[0]!r} "
            f"({type(not_str[0]).__name__}) among the patterns"
        )
    return patterns


# ---- weight layout ----------------------------------------------------------


def _lay_out_weight(name: str, module: _ConvNd, memory_format: torch.memory_format) -> str:
    """Apply convert()'s ``memory_format`` to a swapped module's weight; says what it did."""
    if parametrize.is_parametrized(module, "weight"):
        return "left as it is (parametrized: its parametrization computes it)"
    if is_channels_last_format(memory_format):
        memory_format = CHANNELS_LAST_FORMATS.get(len(module.kernel_size))
        if memory_format is None:
            return "left as it is (torch has no channels-last format for a 1-D convolution)"
    weight = module.weight
    had_grad = weight.grad is not None
    if set_weight_format(weight, memory_format) and had_grad:
        warnings.warn(
            f"convert(memory_format={memory_format}): {_display(name)}.weight already has a "
            "gradient, so training may have begun; an optimizer's state made before keeps "
            "the old layout, which torch's fused optimizers misread",
            stacklevel=3,
        )
    return str(memory_format).removeprefix("torch.")


# ---- class swapping ---------------------------------------------------------


def _unparametrized_class(module: torch.nn.Module) -> type:
    """The module's class, seen through the subclass torch.nn.utils.parametrize injects."""
    cls = type(module)
    if parametrize.is_parametrized(module):
        return cls.__bases__[0]
    return cls


def _set_base_class(module: torch.nn.Module, new_base: type) -> None:
    """Give ``module`` the class ``new_base``, keeping a parametrized module's injected
    properties by regenerating its parametrized subclass over ``new_base``."""
    if not parametrize.is_parametrized(module):
        module.__class__ = new_base
        return
    injected = {
        key: value
        for key, value in vars(type(module)).items()
        if key not in ("__dict__", "__weakref__")
    }
    module.__class__ = type(type(module).__name__, (new_base,), injected)


def _display(name: str) -> str:
    return name or "<root>"


__all__ = ["ConversionReport", "SkippedConv", "SwappedConv", "convert", "problem_class", "revert"]
