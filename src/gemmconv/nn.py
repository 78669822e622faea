"""Drop-in Conv1d / Conv2d / Conv3d that run through gemmconv.

Each is a subclass of its torch.nn counterpart and changes only how the convolution is
computed: constructor, parameters, initialisation, state_dict keys and repr are
torch's own, so a torch state_dict loads into it and back unchanged. Non-'zeros'
padding modes pad first, exactly as torch does, then convolve with padding 0.

``solvers()`` says which solver each direction runs (or would run) for the last
input seen in eager mode, or for an example input; that is runtime state, never
part of the state_dict.

``set_fp8(gemmconv.Float8Config())`` (or ``gemmconv.convert(model, fp8=...)``) runs
the convolution's three directions as fp8 GEMMs where fp8 applies (CUDA, compute
capability 8.9 and up, a patch, point-output or 1x1 problem); elsewhere it runs as
before and ``solvers()`` says why. The configuration is runtime state, never part
of the state_dict.

One keyword torch's constructors lack: ``memory_format=torch.channels_last``
(``torch.channels_last_3d`` for Conv3d) lays the weight out channels-last. F.conv*
returns a channels-last output for a channels-last weight, so a patch embed then
writes its tokens as rows [N*L, D] and the ``flatten(2).transpose(1, 2)`` after it is
a view. Conv1d refuses it: torch has no channels-last format for its 3-D weight.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from gemmconv import functional
from gemmconv.core.float8 import Float8Config, as_config
from gemmconv.core.memory_format import (
    CHANNELS_LAST_FORMATS,
    check_weight_format,
    set_weight_format,
)
from gemmconv.roads import eager
from gemmconv.selection.dispatch import Choice, explain_problem


class _GemmConvMixin:
    """What the three modules share: the gemmconv forward, ``solvers()`` and the
    constructor's ``memory_format`` keyword."""

    # Class defaults, so modules converted in place (class swapped, no __init__ run)
    # have them too.
    _gemmconv_last_input: eager.SeenInput | None = None
    _gemmconv_dims = 0  # 1, 2 or 3, set per subclass
    _gemmconv_zero_padding: tuple[int, ...] = ()
    # The fp8 configuration (set_fp8); None runs the ordinary path.
    _gemmconv_fp8: Float8Config | None = None

    def __init__(self, *args, memory_format: torch.memory_format | None = None, **kwargs):
        """torch's constructor arguments, and ``memory_format``: torch.channels_last
        (torch.channels_last_3d for Conv3d) lays the weight out channels-last;
        torch.contiguous_format or None (the default) leave it as torch makes it."""
        dims = len(self._gemmconv_zero_padding)
        memory_format = _weight_format_of(type(self).__name__, memory_format, dims)
        super().__init__(*args, **kwargs)
        if memory_format is not None:
            set_weight_format(self.weight, memory_format)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """torch's forward (padding modes, bias), its convolution computed by gemmconv."""
        # torch's forward reads self.weight and self.bias through nn.Module.__getattr__,
        # a Python call each (0.7 us of a 34 us module call on the CPU machine,
        # bench/NOTES.md). A registered Parameter is read from _parameters directly;
        # anything else (a parametrization's property, weight_norm's plain attribute)
        # takes the attribute lookup, as torch's forward does.
        parameters = self._parameters
        weight = parameters["weight"] if "weight" in parameters else self.weight
        bias = parameters["bias"] if "bias" in parameters else self.bias
        if self._gemmconv_fp8 is not None:
            return self._fp8_forward(input, weight, bias)
        return self._conv_forward(input, weight, bias)

    def _fp8_forward(
        self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        input, padding = self._padded(input)
        return functional._conv_fp8(
            self._gemmconv_dims, input, weight, bias, self.stride, padding, self.dilation,
            self.groups, self, self._gemmconv_fp8,
        )  # fmt: skip

    def set_fp8(self, config: Float8Config | bool | None = True) -> torch.nn.Module:
        """Run this convolution in fp8 with ``config`` (a ``gemmconv.Float8Config``;
        True: the default one), or as before with None or False. Where fp8 does not
        apply to a call (off CUDA, compute capability below 8.9, a convolution that is
        not a GEMM), the call runs the ordinary path; ``solvers(x)`` says why.
        Returns the module."""
        self._gemmconv_fp8 = as_config(config, f"{type(self).__name__}.set_fp8(config)")
        return self

    @property
    def fp8_config(self) -> Float8Config | None:
        """The fp8 configuration set by ``set_fp8`` or ``gemmconv.convert(fp8=...)``."""
        return self._gemmconv_fp8

    def _padded(self, input: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...] | str]:
        """Non-'zeros' padding modes pad first and convolve unpadded, as torch does."""
        if self.padding_mode == "zeros":
            return input, self.padding
        padded = F.pad(input, self._reversed_padding_repeated_twice, mode=self.padding_mode)
        return padded, self._gemmconv_zero_padding

    def _conv_forward(
        self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if self.padding_mode == "zeros":
            padding = self.padding
        else:
            input, padding = self._padded(input)
        return functional._conv(
            self._gemmconv_dims, input, weight, bias, self.stride, padding, self.dilation,
            self.groups, self,
        )  # fmt: skip

    def __prepare_scriptable__(self) -> torch.nn.Module:
        # torch.jit.script calls this on every submodule before compiling any; a clear
        # error here beats TorchScript's complaint about the first annotation it meets.
        raise RuntimeError(
            f"torch.jit.script cannot compile gemmconv.nn.{type(self).__name__} ({self!r}): "
            "its convolution runs gemmconv's Python solvers, which TorchScript cannot "
            "compile. Call gemmconv.revert(model) first to script torch's own "
            "convolution, or use torch.jit.trace, torch.compile or torch.export, which "
            "record gemmconv's ops."
        )

    def solvers(self, input: torch.Tensor | None = None) -> dict[str, Choice]:
        """The solver choice per direction ("forward", "backward_data",
        "backward_weights") for ``input``, or for the last input of an eager forward:
        a dict of ``gemmconv.Choice`` whose repr is a table, as ``gemmconv.explain``
        returns (``module.solvers(x)["forward"].solver`` is the forward's solver id).

        Runs nothing; raises when there is neither an input nor a past forward. Its
        ``notes`` name the calls needing gradients that run torch's convolution in
        eager mode (as gemmconv.explain's do): for ``input``, those it would need; for
        the last input, whose need is not kept, with and without dx. For an input off
        CUDA, ``.on_cuda`` holds what the cost model would pick per direction for the
        same call on CUDA, and the table ends with it: a module on the CPU may run
        torch's convolution in a direction where a GPU runs a GEMM."""
        if input is not None:
            input, padding = self._padded(input)
            problem = functional.problem_of(
                input, self.weight, self.bias, self.stride, padding, self.dilation, self.groups
            )
            return self._with_fp8_note(
                self._explained(problem, [input.requires_grad]), input, padding, "this input"
            )
        seen = self._gemmconv_last_input
        if seen is None:
            raise RuntimeError(
                f"{type(self).__name__}.solvers(): no eager forward has run yet (compiled "
                "forwards are not recorded); pass an example input, e.g. "
                "module.solvers(torch.empty(1, C, H, W))"
            )
        padding = self.padding if self.padding_mode == "zeros" else self._gemmconv_zero_padding
        shape, strides, dtype, device = seen
        # An uninitialised stand-in: problem_of reads only metadata.
        stand_in = torch.empty_strided(shape, strides, dtype=dtype, device=device)
        weight = self.weight.detach().to(dtype)
        bias = None if self.bias is None else self.bias.detach().to(dtype)
        problem = functional.problem_of(
            stand_in, weight, bias, self.stride, padding, self.dilation, self.groups
        )
        return self._with_fp8_note(
            self._explained(problem, [False, True]), stand_in, padding, "the last input"
        )

    def _with_fp8_note(self, explanation, input, padding, where: str):
        """The explanation with a note on fp8, where the module is configured for it."""
        config = self._gemmconv_fp8
        if config is not None:
            weight = self.weight.detach().to(input.dtype)
            bias = None if self.bias is None else self.bias.detach().to(input.dtype)
            explanation.notes.append(functional.fp8_note(
                input, weight, bias, self.stride, padding, self.dilation, self.groups, config,
                where,
            ))  # fmt: skip
        return explanation

    def _explained(self, problem, input_needs: list[bool]) -> dict[str, Choice]:
        """The problem's choices, with notes on the training calls of these needs of
        dx (the weight's own need of dW is known)."""
        explanation = explain_problem(problem)
        need_dw = self.weight.requires_grad
        bias_needs = self.bias is not None and self.bias.requires_grad
        needs = [(dx, need_dw) for dx in input_needs if dx or need_dw or bias_needs]
        explanation.notes += eager.training_notes(problem, needs)
        return explanation


def _weight_format_of(cls: str, memory_format: object, dims: int) -> torch.memory_format | None:
    """The constructor's ``memory_format``, checked against the weight's rank."""
    memory_format = check_weight_format(cls, memory_format)
    if memory_format in (None, torch.contiguous_format):
        return memory_format
    expected = CHANNELS_LAST_FORMATS.get(dims)
    if memory_format != expected:
        hint = (
            f"expected {expected}, torch.contiguous_format or None"
            if expected is not None
            else "torch has no channels-last format for a 1-D convolution's 3-D weight; "
            "expected torch.contiguous_format or None"
        )
        raise ValueError(f"{cls}: memory_format={memory_format} does not fit its weight: {hint}")
    return memory_format


def _class_doc(torch_class: type[torch.nn.Module]) -> str:
    """The docstring of gemmconv's drop-in for ``torch_class``: what it changes, then
    torch's own documentation of the class."""
    return (
        f"torch.nn.{torch_class.__name__} computed by gemmconv: a drop-in subclass with "
        "torch's constructor, parameters, initialisation, state_dict keys and repr, whose "
        "convolution runs as one GEMM per direction when it is a matrix product (patch, "
        "1x1, strided 1x1) and through torch otherwise. ``module.solvers(x)`` says which "
        "solver runs each direction; ``gemmconv.convert(model)`` swaps torch's modules for "
        "these in place and ``gemmconv.revert(model)`` swaps them back. ``set_fp8()`` runs "
        "it in fp8 where fp8 applies.\n\ntorch's "
        # cleandoc: torch's docstring keeps its source indentation after the first line,
        # which under these unindented lines would read as a code block.
        "documentation:\n\n" + inspect.cleandoc(torch_class.__doc__ or "")
    )


class Conv1d(_GemmConvMixin, torch.nn.Conv1d):
    __doc__ = _class_doc(torch.nn.Conv1d)
    _gemmconv_dims = 1
    _gemmconv_zero_padding = (0,)


class Conv2d(_GemmConvMixin, torch.nn.Conv2d):
    __doc__ = _class_doc(torch.nn.Conv2d)
    _gemmconv_dims = 2
    _gemmconv_zero_padding = (0, 0)


class Conv3d(_GemmConvMixin, torch.nn.Conv3d):
    __doc__ = _class_doc(torch.nn.Conv3d)
    _gemmconv_dims = 3
    _gemmconv_zero_padding = (0, 0, 0)


# torch class -> gemmconv class, and back, for convert() and revert().
GEMMCONV_CLASS: dict[type[torch.nn.Module], type[torch.nn.Module]] = {
    torch.nn.Conv1d: Conv1d,
    torch.nn.Conv2d: Conv2d,
    torch.nn.Conv3d: Conv3d,
}
TORCH_CLASS: dict[type[torch.nn.Module], type[torch.nn.Module]] = {
    v: k for k, v in GEMMCONV_CLASS.items()
}

__all__ = ["Conv1d", "Conv2d", "Conv3d"]
