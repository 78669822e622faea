"""Column sources: where a patch solver's column matrix comes from, and how the column
gradient goes back into dx.

A source makes the [rows, ld] column matrix of x (ld >= Kred, the columns beyond Kred
zeros), writes the first Kred columns of a column gradient back into dx's patch
positions, and says what that costs:

- ViewColumns: x's own memory where it already is the column matrix (point-output,
  nothing cropped), else torch's copy through the permuted patch view; never padded.
  Backward-data writes the GEMM's result straight into dx where dx's memory allows.
- TorchCopyColumns: always an explicit buffer (padded where the solver pads), filled
  by torch's copy through the permuted view.
- TritonCopyColumns: the same buffer filled by one Triton pass
  (kernels/patch_permute.py), the padding written in the same pass; point-output rows
  are copied as whole rows in 8-byte words.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from gemmconv.core.memory_format import Layout
from gemmconv.core.problem import ConvProblem, Direction
from gemmconv.solvers.patch.cost import gathered_run_bytes, torch_permute_slowdown
from gemmconv.solvers.patch.mapping import (
    VECTOR_BYTES,
    channels_last_columns,
    column_layout,
    patches,
    patches_are_views,
)
from gemmconv.solvers.views import ViewRecipe, try_view
from gemmconv.solvers.word_copy import contiguous_in_words, copy_in_words

# The Triton permutation pass (kernels/patch_permute.py) against a plain copy: the
# strided side is read in short runs (R elements), so allow a quarter more time.
TRITON_PERMUTE_SLOWDOWN = 1.25
# Its scatter (backward-data), when the contiguous run of a patch row is not a whole
# number of 16-byte vectors, stores element by element. On an H200 (the suite in
# tests/data/h200_suite.json) it moved about 280 GB/s in the channels-first
# column order, 15x behind a plain copy (point 2D/3D and ConvNeXt downsample
# backward-data rows), and about 1 TB/s in the channels-last one, 4x (point 2D,
# 84-byte runs); fitted to those rows.
TRITON_UNALIGNED_SCATTER_SLOWDOWN = {Layout.CHANNELS_FIRST: 15.0, Layout.CHANNELS_LAST: 4.0}
# Point-output rows copied as 8-byte words (pad_rows): 22.4 MB in 11 us on an H200,
# about 2 TB/s against 4.2 for a plain copy (bench/results/h200_levers_layouts_run1.json).
WORD_COPY_SLOWDOWN = 2.0


class ColumnSource:
    # Kernel launches of the gather or the scatter, beyond the GEMM's.
    launches = 1
    # Whether those launches are Triton kernels (which cost the host more per launch).
    triton = False

    def buffer_bytes(self, p: ConvProblem, ld: int) -> int:
        """Bytes of the column buffer it allocates for the whole problem."""
        return p.gemm_m * ld * p.element_size

    def slowdown(self, p: ConvProblem) -> float:
        """Time per byte of its gather or scatter, relative to a plain device copy."""
        raise NotImplementedError

    def gather(
        self, x: torch.Tensor, p: ConvProblem, ld: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The column matrix [rows, ld] of ``x`` (all samples or a slice of them), in
        ``out`` when given."""
        raise NotImplementedError

    def scatter(self, dcol: torch.Tensor, p: ConvProblem, dx: torch.Tensor) -> None:
        """Write the first Kred columns of ``dcol`` [rows, ld] into dx's patch positions."""
        raise NotImplementedError

    def in_place_target(self, dx: torch.Tensor, p: ConvProblem, ld: int) -> torch.Tensor | None:
        """dx's patch positions as [M, ld] when a GEMM can write them directly."""
        return None

    def prepared_gather(
        self, x: torch.Tensor, p: ConvProblem, ld: int
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """``gather`` (no ``out``) for tensors with the sizes and strides of ``x`` (a meta
        tensor will do), with what it decides from them decided once."""
        return lambda t: self.gather(t, p, ld)

    def prepared_scatter(
        self, dx: torch.Tensor, p: ConvProblem, ld: int
    ) -> Callable[[torch.Tensor, torch.Tensor], None]:
        """``scatter`` (dcol, dx) for dx with the sizes and strides of ``dx`` (a meta
        tensor will do), with what it decides from them decided once."""
        return lambda dcol, dx: self.scatter(dcol, p, dx)


class TorchCopyColumns(ColumnSource):
    def slowdown(self, p: ConvProblem) -> float:
        return torch_permute_slowdown(p.device_type)

    def gather(
        self, x: torch.Tensor, p: ConvProblem, ld: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return _fill_columns(_buffer(x, p, ld, out), patches(x, p), p.gemm_k)

    def scatter(self, dcol: torch.Tensor, p: ConvProblem, dx: torch.Tensor) -> None:
        _store_columns(patches(dx, p), dcol, p.gemm_k)

    # The prepared gather and scatter replay the patch view as one as_strided call:
    # the movedim, crop, view and permute that find it cost a torch call each.
    def prepared_gather(
        self, x: torch.Tensor, p: ConvProblem, ld: int
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        source = ViewRecipe(patches(x, p), x)
        m, k = p.gemm_m, p.gemm_k
        return lambda t: _fill_columns(t.new_empty(m, ld), source(t), k)

    def prepared_scatter(
        self, dx: torch.Tensor, p: ConvProblem, ld: int
    ) -> Callable[[torch.Tensor, torch.Tensor], None]:
        target = ViewRecipe(patches(dx, p), dx)
        k = p.gemm_k
        return lambda dcol, dx: _store_columns(target(dx), dcol, k)


class ViewColumns(TorchCopyColumns):
    # Costed as the GEMM's launch alone: where the view needs a copy, its bytes are
    # counted (copied_bytes) but not its launch, as the immediate picks were tuned.
    launches = 0

    def buffer_bytes(self, p: ConvProblem, ld: int) -> int:
        return 0 if patches_are_views(p) else super().buffer_bytes(p, ld)

    def gather(
        self, x: torch.Tensor, p: ConvProblem, ld: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        if out is not None or ld != p.gemm_k:
            return super().gather(x, p, ld, out)
        source = patches(x, p)
        rows = x.shape[0] * math.prod(p.output_spatial)  # x may be a slice of the batch
        view = try_view(source, rows, p.gemm_k)
        return view if view is not None else contiguous_in_words(source).view(rows, p.gemm_k)

    def in_place_target(self, dx: torch.Tensor, p: ConvProblem, ld: int) -> torch.Tensor | None:
        if ld != p.gemm_k:
            return None
        return try_view(patches(dx, p), p.gemm_m, p.gemm_k)

    def prepared_gather(
        self, x: torch.Tensor, p: ConvProblem, ld: int
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        if ld != p.gemm_k:
            return super().prepared_gather(x, p, ld)
        source = patches(x, p)
        view = ViewRecipe.of(try_view(source, p.gemm_m, p.gemm_k), x)
        if view is not None:
            return view.apply
        permuted = ViewRecipe(source, x).apply
        m, k = p.gemm_m, p.gemm_k
        return lambda t: contiguous_in_words(permuted(t)).view(m, k)


class TritonCopyColumns(ColumnSource):
    triton = True

    def slowdown(self, p: ConvProblem) -> float:
        if patches_are_views(p):
            return WORD_COPY_SLOWDOWN
        if p.direction is Direction.BACKWARD_DATA and gathered_run_bytes(p) % VECTOR_BYTES:
            return TRITON_UNALIGNED_SCATTER_SLOWDOWN[column_layout(p)]
        return TRITON_PERMUTE_SLOWDOWN

    def gather(
        self, x: torch.Tensor, p: ConvProblem, ld: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        from gemmconv.kernels.patch_permute import gather_patches
        from gemmconv.kernels.strided_copy import pad_rows

        col = _buffer(x, p, ld, out)
        x_rows = whole_sample_rows(x, p)
        if x_rows is not None:
            # Point-output: every row of col is a whole row of x. Copied in 8-byte words
            # (a 588-element bf16 row is 147 of them) instead of 2-byte patch runs.
            return pad_rows(col, x_rows)
        return gather_patches(x, p.output_spatial, p.kernel, channels_last_columns(p), out=col)

    def prepared_gather(
        self, x: torch.Tensor, p: ConvProblem, ld: int
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        x_rows = ViewRecipe.of(whole_sample_rows(x, p), x)
        m = p.gemm_m
        if x_rows is None:
            # The kernel's arguments found once: gather() finds them on every call
            # (2.7 us of 5.3 on the CPU machine, its launch aside).
            from gemmconv.kernels.patch_permute import gather_patches

            outs, kernel, order = p.output_spatial, p.kernel, channels_last_columns(p)
            return lambda t: gather_patches(t, outs, kernel, order, out=t.new_empty(m, ld))
        from gemmconv.kernels.strided_copy import pad_rows

        return lambda t: pad_rows(t.new_empty(m, ld), x_rows(t))

    def prepared_scatter(
        self, dx: torch.Tensor, p: ConvProblem, ld: int
    ) -> Callable[[torch.Tensor, torch.Tensor], None]:
        # Point-output: dx's rows are found once, as the prepared gather finds x's; the
        # views that find them cost several torch calls, more than the copy's launch.
        dx_rows = ViewRecipe.of(whole_sample_rows(dx, p), dx)
        if dx_rows is None:
            from gemmconv.kernels.patch_permute import scatter_patches

            outs, kernel, order = p.output_spatial, p.kernel, channels_last_columns(p)
            return lambda dcol, dx: scatter_patches(dcol, outs, kernel, order, dx)
        from gemmconv.kernels.strided_copy import pad_rows

        k = p.gemm_k
        return lambda dcol, dx: pad_rows(dx_rows(dx), dcol[:, :k])

    def scatter(self, dcol: torch.Tensor, p: ConvProblem, dx: torch.Tensor) -> None:
        from gemmconv.kernels.patch_permute import scatter_patches
        from gemmconv.kernels.strided_copy import pad_rows

        dx_rows = whole_sample_rows(dx, p)
        if dx_rows is not None:
            pad_rows(dx_rows, dcol[:, : p.gemm_k])
            return
        scatter_patches(dcol, p.output_spatial, p.kernel, channels_last_columns(p), dx)


def _fill_columns(col: torch.Tensor, source: torch.Tensor, k: int) -> torch.Tensor:
    """``col`` [rows, ld] holding ``source`` (the patches) in its first ``k`` columns,
    zeros after them."""
    if col.shape[1] > k:
        col[:, k:].zero_()
    copy_in_words(col[:, :k].view(source.shape), source)
    return col


def _store_columns(target: torch.Tensor, dcol: torch.Tensor, k: int) -> None:
    """The first ``k`` columns of ``dcol`` [rows, ld] written into ``target`` (dx's
    patch positions, a view of the patches' shape): _fill_columns run backwards."""
    copy_in_words(target, dcol[:, :k].view(target.shape))


def _buffer(x: torch.Tensor, p: ConvProblem, ld: int, out: torch.Tensor | None) -> torch.Tensor:
    if out is not None:
        return out
    return x.new_empty(x.shape[0] * math.prod(p.output_spatial), ld)


def whole_sample_rows(t: torch.Tensor, p: ConvProblem) -> torch.Tensor | None:
    """``t`` as its column matrix [N, Kred] without a copy, where patches are whole
    samples (point-output, nothing cropped)."""
    if not patches_are_views(p):
        return None
    return try_view(patches(t, p), t.shape[0], p.gemm_k)


VIEW_COLUMNS = ViewColumns()
TORCH_COPY_COLUMNS = TorchCopyColumns()
TRITON_COPY_COLUMNS = TritonCopyColumns()
