"""What every prepared run (Solver.prepare) is made of, whatever its solver.

A prepared run is built once from operands' metadata, on meta tensors that have their
sizes and strides (so building it costs no device work), and then called with real
operands of that metadata: it allocates its result as the solver's own run does and
runs its GEMMs under the same accumulation rules.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import methodcaller
from typing import TypeVar

import torch

from gemmconv.core.precision import with_conv_precision
from gemmconv.core.problem import ConvProblem
from gemmconv.solvers.base import ConvTensors
from gemmconv.solvers.views import meta_like, result_buffer

Runner = Callable[[ConvTensors], torch.Tensor]
R = TypeVar("R")


def meta_operands(t: ConvTensors) -> ConvTensors:
    """``t`` with each tensor replaced by a meta tensor of its sizes, strides and dtype."""
    return ConvTensors(**{name: None if v is None else meta_like(v) for name, v in vars(t).items()})


class ResultBuffer:
    """The direction's result as the solvers allocate it (views.result_buffer), its
    sizes and strides found once; ``meta`` is it on the meta device, for finding views."""

    __slots__ = ("meta", "size", "stride", "over")

    def __init__(self, p: ConvProblem, like: torch.Tensor) -> None:
        self.meta = result_buffer(p, like, None)
        self.size, self.stride = tuple(self.meta.shape), self.meta.stride()
        # The result as a view of ``memory``, a dense tensor holding its elements in the
        # result's own memory order (from memory's own offset); a callable without a
        # Python frame, as ViewRecipe.apply.
        self.over: Callable[[torch.Tensor], torch.Tensor] = methodcaller(
            "as_strided", self.size, self.stride
        )

    def __call__(self, like: torch.Tensor) -> torch.Tensor:
        """A new uninitialised result, of ``like``'s dtype and device."""
        return torch.empty_strided(self.size, self.stride, dtype=like.dtype, device=like.device)


def with_precision(p: ConvProblem, run: Callable[..., R]) -> Callable[..., R]:
    """``run`` under the problem's GEMM accumulation rules, as Solver.run applies them
    (precision.with_conv_precision: ``run`` itself off CUDA, so a CPU call pays
    nothing)."""
    return with_conv_precision(p.dtype, p.device_type, run)


def with_precision_returning(p: ConvProblem, run: Runner, result: ResultBuffer) -> Runner:
    """with_precision(p, run) for a ``run`` whose every result is a ``result`` buffer
    (or its view of the same strides), marked so (``result_strides``): the caller then
    need not check a result's strides against those it promised."""
    runner = with_precision(p, run)
    runner.result_strides = result.stride  # type: ignore[attr-defined]
    return runner


__all__ = ["ResultBuffer", "Runner", "meta_operands", "with_precision", "with_precision_returning"]
