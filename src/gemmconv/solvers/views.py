"""Views that let a GEMM read or write a convolution tensor in place.

Every helper here returns a view when the memory already has the order the GEMM
needs, and None (or a copy, where the name says so) when it has not; solvers try
the view first so zero-copy paths are taken whenever the layout allows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from operator import methodcaller

import torch

from gemmconv.core.memory_format import Layout, empty_in, output_layout
from gemmconv.core.problem import ConvProblem, Direction


def try_view(t: torch.Tensor, *shape: int) -> torch.Tensor | None:
    # A failed view costs tens of microseconds (a C++ exception); most refusals are
    # decided first, in Python, from the sizes and strides.
    if view_is_possible(tuple(t.shape), t.stride(), shape) is False:
        return None
    try:
        return t.view(*shape)
    except RuntimeError:
        return None


def view_is_possible(
    shape: tuple[int, ...], strides: tuple[int, ...], new_shape: tuple[int, ...]
) -> bool | None:
    """Whether ``view(new_shape)`` of a tensor with these sizes and strides succeeds;
    None where this does not decide (empty tensors, 0-D, sizes that do not match).

    The rule is torch's own: the old dimensions split into runs that are contiguous
    among themselves, and each run must be covered exactly by consecutive new ones."""
    numel = math.prod(shape)
    if numel == 0 or not shape:
        return None
    new = list(new_shape)
    if -1 in new:
        known = -math.prod(new)  # the product of the other sizes
        if new.count(-1) != 1 or known <= 0 or numel % known:
            return None
        new[new.index(-1)] = numel // known
    if not new or math.prod(new) != numel:
        return None
    view_d = len(new) - 1
    chunk_base_stride = strides[-1]
    tensor_numel = view_numel = 1
    for tensor_d in range(len(shape) - 1, -1, -1):
        tensor_numel *= shape[tensor_d]
        run_ends = tensor_d == 0 or (
            shape[tensor_d - 1] != 1 and strides[tensor_d - 1] != tensor_numel * chunk_base_stride
        )
        if run_ends:
            while view_d >= 0 and (view_numel < tensor_numel or new[view_d] == 1):
                view_numel *= new[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return False
            if tensor_d > 0:
                chunk_base_stride = strides[tensor_d - 1]
                tensor_numel = view_numel = 1
    return view_d == -1


def meta_like(t: torch.Tensor) -> torch.Tensor:
    """A tensor on the meta device with ``t``'s sizes, strides and dtype: the views a
    solver takes of it are the ones it would take of ``t``, at no cost."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


class ViewRecipe:
    """One fixed view of a tensor, found once (on a meta tensor of the same sizes and
    strides) and replayed as a single as_strided call: the chain of movedim, view and
    permute calls that found it would cost a torch call each, every call.

    ``apply`` is the view as a callable without a Python frame of its own; prepared
    runs call it on their hot path (0.1 us a view less on the CPU machine)."""

    __slots__ = ("size", "stride", "offset", "apply")

    def __init__(self, view: torch.Tensor, base: torch.Tensor) -> None:
        self.size = tuple(view.shape)
        self.stride = view.stride()
        self.offset = view.storage_offset() - base.storage_offset()
        # as_strided keeps t's own offset when given none: a third of the call's cost
        # on a CPU host, and the usual case (a view from t's first element).
        self.apply: Callable[[torch.Tensor], torch.Tensor] = (
            partial(_view_at_offset, self.size, self.stride, self.offset)
            if self.offset
            else methodcaller("as_strided", self.size, self.stride)
        )

    @classmethod
    def of(cls, view: torch.Tensor | None, base: torch.Tensor) -> ViewRecipe | None:
        return None if view is None else cls(view, base)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return self.apply(t)


def _view_at_offset(
    size: tuple[int, ...], stride: tuple[int, ...], offset: int, t: torch.Tensor
) -> torch.Tensor:
    return t.as_strided(size, stride, t.storage_offset() + offset)


def rows_view(t: torch.Tensor) -> torch.Tensor | None:
    """[N, K, S..] -> [N*prod(S), K] without a copy, when ``t`` is channels-last dense."""
    return try_view(t.movedim(1, -1), -1, t.shape[1])


def batched_view(t: torch.Tensor) -> torch.Tensor | None:
    """[N, K, S..] -> [N, K, prod(S)] without a copy, when ``t`` is channels-first dense."""
    return try_view(t, t.shape[0], t.shape[1], -1)


def rows(t: torch.Tensor) -> torch.Tensor:
    """[N, K, S..] as [N*prod(S), K]: a view where possible, else one copy."""
    return t.movedim(1, -1).reshape(-1, t.shape[1])


def result_shape_and_layout(problem: ConvProblem) -> tuple[tuple[int, ...], Layout]:
    """The direction's result: its shape, and the layout F.conv* would give it (forward,
    backward-data) or the weight's own (backward-weights)."""
    if problem.direction is Direction.BACKWARD_WEIGHTS:
        return problem.weight_shape, problem.layout
    shape = problem.output_shape if problem.direction is Direction.FORWARD else problem.input_shape
    return shape, output_layout(problem.layout, problem.dims, problem.dtype, problem.device_type)


def result_buffer(
    problem: ConvProblem, like: torch.Tensor, out: torch.Tensor | None
) -> torch.Tensor:
    """``out`` when the caller gave one, else a new uninitialised result
    (result_shape_and_layout) on ``like``'s device."""
    if out is not None:
        return out
    shape, layout = result_shape_and_layout(problem)
    return empty_in(shape, layout, problem.dtype, like.device)


def weight_rows(weight: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The weight flattened to [K, Kred] in the column order of ``layout``:
    (c, r1..rd) for channels-first, (r1..rd, c) for channels-last. The weight is
    small, so a permuted copy here is cheap."""
    if layout is Layout.CHANNELS_FIRST:
        return weight.reshape(weight.shape[0], -1)
    return weight.movedim(1, -1).reshape(weight.shape[0], -1)


def weight_rows_target(dw: torch.Tensor, layout: Layout) -> torch.Tensor | None:
    """``dw`` seen as [K, Kred] in the column order of ``layout``, when that is a view."""
    if layout is Layout.CHANNELS_FIRST:
        return try_view(dw, dw.shape[0], -1)
    return try_view(dw.movedim(1, -1), dw.shape[0], -1)


def store_weight_rows(dw: torch.Tensor, dw_rows: torch.Tensor, layout: Layout) -> None:
    """Copy a [K, Kred] result in ``layout``'s column order into ``dw``."""
    if layout is Layout.CHANNELS_FIRST:
        dw.copy_(dw_rows.view(dw.shape))
    else:
        k, c, *kernel = dw.shape
        dw.copy_(dw_rows.view(k, *kernel, c).movedim(-1, 1))


def zero_outside(t: torch.Tensor, covered: tuple[int, ...]) -> None:
    """Zero every element of ``t`` [N, C, S..] whose spatial index lies beyond ``covered``
    in some dimension: the part of dx no output pixel reads from."""
    for dim, (size, keep) in enumerate(zip(t.shape[2:], covered), start=2):
        if keep < size:
            t.narrow(dim, keep, size - keep).zero_()


def bias_grad(grad_output: torch.Tensor, out_channels: int | None = None) -> torch.Tensor:
    """Sum of dy over batch and space, accumulated in fp32 (or fp64 for fp64).

    torch gives a convolution of a zero-channel input a zero-channel output, so dy
    then has no channels although the bias has ``out_channels``: its gradient is
    zeros of the bias's size, as torch's."""
    if out_channels is not None and grad_output.shape[1] != out_channels:
        return grad_output.new_zeros(out_channels)
    # torch's sum accumulates fp16/bf16 in fp32 itself (its accumulate type, on the CPU
    # and in CUDA's reduction kernel) and rounds once: one kernel, where summing in
    # fp32 and casting back took two.
    return grad_output.sum(BATCH_AND_SPACE[grad_output.dim()])


# The dimensions bias_grad sums, per rank of dY: built once, since building them per
# call cost more than the sum of a small dY (bench/NOTES.md).
BATCH_AND_SPACE = {rank: (0, *range(2, rank)) for rank in range(2, 6)}


def gemm_into(
    dest: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """dest[M, K] = a @ b (+ bias), written in place when ``dest`` is a GEMM-able view."""
    if bias is None:
        return torch.mm(a, b, out=dest)
    return torch.addmm(bias, a, b, out=dest)


def store_rows(dest: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias=None) -> None:
    """dest [N, K, S..] = (a @ b + bias) where the product's rows are dest's pixels in
    channels-last order; straight into dest when it is channels-last dense."""
    dest_rows = rows_view(dest)
    if dest_rows is not None:
        gemm_into(dest_rows, a, b, bias)
        return
    result = torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)
    n, k, *spatial = dest.shape
    dest.copy_(result.view(n, *spatial, k).movedim(-1, 1))


def store_batched(dest: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias=None) -> None:
    """dest [N, K, S..] = a[n] @ b[n] (+ bias) per sample, as [N, K, prod(S)] products;
    straight into dest when it is channels-first dense. ``a`` may be an expanded
    (stride-0) weight: one batched GEMM, no copy of it."""
    dest3 = batched_view(dest)
    if dest3 is not None:
        torch.bmm(a, b, out=dest3)
    else:
        dest.copy_(torch.bmm(a, b).view(dest.shape))
    if bias is not None:
        dest.add_(bias.view(1, -1, *([1] * (dest.dim() - 2))))
