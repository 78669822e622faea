"""The fp8 run of a GEMM-reducible convolution: its three GEMMs through torch._scaled_mm.

With the patch mapping (patch/mapping.py: patch, point-output and 1x1 problems,
whose column matrix is a reordering of x):

- forward:          y    = cols @ W^T     (cols [M, ld], W [K, ld])
- backward-data:    dcol = dY @ W,         scattered back into dx by the mapping
- backward-weights: dW   = dY^T @ cols

Each operand is quantized straight from the tensor the model holds into an fp8
buffer laid out as cuBLASLt wants it (``a`` row-major, ``b`` column-major, the
reduction padded with zeros to a multiple of 16: 588 -> 592): the cast itself is
the gather, the transpose and the padding, so no bf16 copy of an operand is made.
The scale is taken from the current absolute maximum (torchao's recipe): one per
operand ("tensorwise") or one per row along the reduction ("rowwise"); the GEMM
gets their inverses and accumulates in fp32, writing the input's dtype.

In eager mode on CUDA with tensorwise scales (``kernel_casts`` says when) the
moves of x, dY, y and dx are Triton copies: the casts of x (kernels/patch_permute.py's
gather) and of dY (kernels/strided_copy.py), the transpose of the forward's rows
into a channels-first y with several pixels a sample (strided_copy), and the
scatter of backward-data's columns into dx's patch positions (patch_permute's
scatter; where dx's memory is the column matrix, one dense copy of its rows
instead). Backward-data's W^T is then the forward's fp8 W transposed (the same
scale, so the same bytes), and the patch views the kernels do not read are not
built. The weight's cast, rowwise scales and torch.compile keep torch's multiply
and copies.

Not a registered solver: fp8 changes the numbers a convolution computes, so it runs
only where a module asks for it (gemmconv.roads.float8), never by the cost model.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from gemmconv.core.float8 import AMAX_EPS, FP8_ALIGNMENT, Float8Config
from gemmconv.core.memory_format import Layout, empty_in
from gemmconv.core.problem import ConvProblem, Direction, dtype_name
from gemmconv.core.sizes import round_up
from gemmconv.kernels import triton_available
from gemmconv.solvers.patch.mapping import (
    column_layout,
    covered_extent,
    patch_class_reasons,
    patch_view,
    result_layout,
)
from gemmconv.solvers.views import (
    ViewRecipe,
    batched_view,
    bias_grad,
    meta_like,
    rows_view,
    store_weight_rows,
    try_view,
    weight_rows,
    zero_outside,
)

INF = float("inf")
_FP8_MAX = {
    torch.float8_e4m3fn: torch.finfo(torch.float8_e4m3fn).max,
    torch.float8_e5m2: torch.finfo(torch.float8_e5m2).max,
}
# The dtypes a convolution runs fp8 from: its results come back in the same dtype.
# fp64 stays exact: a model in fp64 asked for it.
_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})


def problem_reasons(p: ConvProblem) -> list[str]:
    """Why the fp8 run cannot compute ``p`` (empty when it can)."""
    reasons = []
    mapping = patch_class_reasons(p)
    if mapping:
        reasons.append(
            "not a patch, point-output or stride-1 1x1 convolution (" + "; ".join(mapping) + ")"
        )
    if p.dtype not in _DTYPES:
        reasons.append(f"dtype {dtype_name(p.dtype)}: fp8 runs from fp16, bf16 or fp32")
    if p.k % FP8_ALIGNMENT:
        reasons.append(
            f"out_channels {p.k} is not a multiple of {FP8_ALIGNMENT} (cuBLASLt's fp8 GEMMs "
            "need the result's columns and dY's reduction in multiples of 16)"
        )
    if 0 in (p.n, p.c, p.k):
        reasons.append(f"empty problem (N={p.n}, C={p.c}, K={p.k})")
    return reasons


def kernel_casts(device_type: str, tensorwise: bool, compiling: bool) -> bool:
    """Whether x's and dY's fp8 operands are cast by gemmconv's Triton copies rather
    than by ``torch.mul(source, scale, out=<strided view of the fp8 buffer>)``, and
    the GEMMs' rows moved into a channels-first y and into dx's patches by them
    rather than by torch's strided copy.

    torch's strided elementwise kernel runs those casts at a fraction of the
    bandwidth: on an H100 (torch 2.11) the casts of one training step took 296 us of
    Qwen2-VL's embed and 1375 us of ViT-B/16 b256's, against 72.5 and 201 us for
    their fp8 GEMMs. The copies apply where all of these hold:

    - CUDA: on the CPU Triton only interprets (the tests);
    - a tensorwise scale, one scalar the kernels read by pointer: rowwise scales keep
      torch's broadcast multiply;
    - eager mode: under torch.compile inductor fuses the functional form itself.

    Both paths give the same bytes (fp32 product, one round-to-nearest-even to fp8).
    The weight is small and always takes torch's; a dY that no view makes rows of
    (``Float8Run._gradient_by_kernel``) does too."""
    return device_type == "cuda" and tensorwise and not compiling and _have_triton()


@functools.cache
def _have_triton() -> bool:
    return triton_available()


def _zero_fp8(region: torch.Tensor) -> None:
    """Zero part of an fp8 buffer through its bytes: fp8 zero is the byte 0."""
    region.view(torch.uint8).zero_()


_EPS: dict[torch.device, torch.Tensor] = {}


def _eps_on(device: torch.device) -> torch.Tensor | None:
    """AMAX_EPS as a [1] fp32 tensor on ``device``, made once and only read; None while
    a CUDA graph is being captured and none is made yet (a fill recorded in a capture
    runs only when the graph is replayed). Made outside inference mode, so that a first
    call under it leaves no inference tensor behind."""
    eps = _EPS.get(device)
    if eps is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        with torch.inference_mode(False):
            eps = torch.full((1,), AMAX_EPS, dtype=torch.float32, device=device)
        _EPS[device] = eps
    return eps


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """What the run reads of its problem, as plain values found once: torch.compile
    traces the run, and the problem's cached properties and layout rules take locks
    and caches that dynamo cannot trace."""

    n: int
    c: int
    k: int
    outputs: tuple[int, ...]
    kernel: tuple[int, ...]
    covered: tuple[int, ...]
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    m: int
    kred: int
    ld: int
    result_layout: Layout
    # The column order (channels-last: (r.., c)) of the forward and weight gradient,
    # which gather x, and of backward-data, which scatters into dx.
    x_order_last: bool
    dx_order_last: bool
    # Whether the patches cover all of x (no remainder beyond O*R in any dimension).
    covers_all: bool

    @classmethod
    def of(cls, p: ConvProblem) -> _Geometry:
        pd = p.with_direction(Direction.BACKWARD_DATA)
        return cls(
            n=p.n, c=p.c, k=p.k, outputs=p.output_spatial, kernel=p.kernel,
            covered=covered_extent(p), input_shape=p.input_shape, output_shape=p.output_shape,
            m=p.gemm_m, kred=p.gemm_k, ld=round_up(p.gemm_k, FP8_ALIGNMENT),
            result_layout=result_layout(p),
            x_order_last=column_layout(p) is Layout.CHANNELS_LAST,
            dx_order_last=column_layout(pd) is Layout.CHANNELS_LAST,
            covers_all=covered_extent(p) == tuple(p.input_shape[2:]),
        )  # fmt: skip


# The column-matrix views a run keeps (x's and dx's, per sizes and strides): a run is
# decided per operand metadata, so this is a bound no ordinary model reaches.
_ROW_VIEWS = 16
_UNSEEN = object()


@dataclasses.dataclass(frozen=True)
class Float8Run:
    """The fp8 run of one forward problem ``problem`` (and its two backward
    directions) with ``config``. Stateless: every call quantizes its operands anew."""

    problem: ConvProblem
    config: Float8Config
    geometry: _Geometry = dataclasses.field(init=False, repr=False, compare=False)
    # (sizes, strides, column order) -> the ViewRecipe of _rows_of, or None.
    _row_views: dict = dataclasses.field(
        init=False, repr=False, compare=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "geometry", _Geometry.of(self.problem))

    # ---- geometry -------------------------------------------------------------

    @property
    def rowwise(self) -> bool:
        return self.config.scaling == "rowwise"

    def _patches(self, t: torch.Tensor, last: bool) -> torch.Tensor:
        g = self.geometry
        return patch_view(t, g.outputs, g.kernel, last)

    def _covered(self, t: torch.Tensor) -> torch.Tensor:
        """The part of ``t`` [N, C, S..] the patches read: the same elements as the patch
        view, in one slice (or none), for a tensorwise amax, which no order changes."""
        g = self.geometry
        if g.covers_all:
            return t
        return t[(slice(None), slice(None), *(slice(0, c) for c in g.covered))]

    def _rows_of(self, t: torch.Tensor, last: bool) -> torch.Tensor | None:
        """``t``'s patches (x's or dx's) as the column matrix [M, Kred] without a copy,
        or None where ``t``'s memory is not that matrix. Found once per sizes and
        strides on a meta tensor and replayed as one as_strided: the patch view and its
        reshape took five torch calls every step. Eager mode only."""
        g = self.geometry
        key = (tuple(t.shape), t.stride(), last)
        recipe = self._row_views.get(key, _UNSEEN)
        if recipe is _UNSEEN:
            meta = meta_like(t)
            recipe = ViewRecipe.of(try_view(self._patches(meta, last), g.m, g.kred), meta)
            if len(self._row_views) >= _ROW_VIEWS:
                self._row_views.clear()
            self._row_views[key] = recipe
        return None if recipe is None else recipe(t)

    def _patch_dims(self) -> tuple[int, ...]:
        """The dimensions of a patch in the view ``patch_view`` gives ([N, O.., patch..])."""
        d = len(self.geometry.kernel)
        return tuple(range(1 + d, 2 + 2 * d))

    def _pixel_dims(self) -> tuple[int, ...]:
        return tuple(range(0, 1 + len(self.geometry.kernel)))

    def _weight_in_order(self, dest: torch.Tensor, last: bool) -> torch.Tensor:
        """``dest`` [K, Kred] (any strides) seen with the weight's logical shape
        [K, C, R..], the reduction in the column order (channels-last: ``last``)."""
        g = self.geometry
        if not last:
            return dest.view(g.k, g.c, *g.kernel)
        return dest.view(g.k, *g.kernel, g.c).movedim(-1, 1)

    def _dy_as_rows(self, dest: torch.Tensor) -> torch.Tensor:
        """``dest`` [M, K] seen with dY's logical shape [N, K, O..]."""
        g = self.geometry
        return dest.view(g.n, *g.outputs, g.k).movedim(-1, 1)

    def _columns_of(self, per_weight: torch.Tensor, last: bool) -> torch.Tensor:
        """A [1, C, R..] per-reduction-element tensor as [1, Kred] in the column order."""
        if not last:
            return per_weight.reshape(1, -1)
        return per_weight.movedim(1, -1).reshape(1, -1)

    # ---- scales ---------------------------------------------------------------

    def _scale(self, t: torch.Tensor, fp8: torch.dtype, dims: tuple[int, ...] | None):
        """(fp8_max / amax, its inverse) in fp32: of all of ``t`` (dims None), as [1]
        tensors, or over ``dims`` with them kept. A dimensioned fp32 scale makes the
        multiply in _quantized run in fp32 whatever t's dtype, as torchao's cast does.

        Tensorwise in eager mode on CUDA over a tensor whose memory is dense, one
        Triton launch computes both, to the bit (kernels/amax_scale.py; ``kernel_casts``
        says where Triton runs). Elsewhere four small kernels, where the first form
        took six: in eager mode each is a launch, and the run is host-bound
        (bench/NOTES.md). The norm runs in t's dtype (exact for a maximum; its
        ``dtype=`` argument would copy all of t to fp32 first) and only the amax is
        cast. The scale is the inverse's reciprocal, at most an ulp or two from
        fp8_max / amax, so |t * scale| still rounds to fp8_max at most."""
        compiling = torch.compiler.is_compiling()
        if (
            dims is None
            and not self.config.round_scales_to_power_of_2
            and kernel_casts(t.device.type, True, compiling)
        ):
            from gemmconv.kernels.amax_scale import amax_scale, dense_flat

            flat = dense_flat(t) if t.numel() else None
            if flat is not None:
                # One launch for the four calls below (kernels/amax_scale.py).
                return amax_scale(flat, _FP8_MAX[fp8], AMAX_EPS)
        eps = None
        if dims is None and not compiling:
            eps = _eps_on(t.device)
        if eps is not None:
            # One maximum against a [1] fp32 eps widens, clamps and shapes the amax where
            # reshape, float and clamp_ took three calls (the same values: the widening
            # is exact and both propagate a NaN).
            amax = torch.linalg.vector_norm(t, INF)
            inverse = torch.maximum(amax, eps).div_(_FP8_MAX[fp8])
        else:
            if dims is None:
                amax = torch.linalg.vector_norm(t, INF).reshape(1)
            else:
                amax = torch.linalg.vector_norm(t, INF, dim=dims, keepdim=True)
            inverse = amax.float().clamp_(min=AMAX_EPS).div_(_FP8_MAX[fp8])
        if self.config.round_scales_to_power_of_2:
            # A power of two's reciprocal is exact: round the inverse up, the scale down.
            inverse = torch.exp2(torch.ceil(torch.log2(inverse)))
        return inverse.reciprocal(), inverse

    @staticmethod
    def _quantized(
        source: torch.Tensor,
        scale: torch.Tensor,
        fp8: torch.dtype,
        used: tuple[int, int],
        padded: tuple[int, int],
        arrange: Callable[[torch.Tensor], torch.Tensor],
        unarrange: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """The fp8 GEMM operand of ``source * scale``: ``arrange`` lays a tensor shaped
        like ``source`` out as the ``used`` [R, C] matrix, and ``unarrange`` is its
        inverse (a view of such a matrix shaped like ``source``); the matrix sits at
        the top left of a ``padded`` buffer whose other entries are zeros.

        The product is computed in fp32 and rounded once to fp8; |source * scale| <=
        fp8_max (1 + 2^-23) by the scale's construction, which rounds to fp8_max, so no
        clamp is needed. In eager mode one kernel writes it straight into the buffer
        (no fp32 temporary, the gather and transpose done by the cast); under
        torch.compile the same is written functionally, for inductor to fuse (it
        cannot lower a write into a slice of an fp8 buffer)."""
        (r, c), (rows, cols) = used, padded
        if torch.compiler.is_compiling():
            matrix = arrange(source * scale)
            # contiguous(): with nothing to pad, F.pad and the cast keep a transposed
            # arrangement's strides, and inductor's _scaled_mm refuses such an operand
            # ("mat_b must be col_major"), where eager's buffer is always dense.
            return F.pad(matrix, (0, cols - c, 0, rows - r)).to(fp8).contiguous()
        buffer = torch.empty(rows, cols, dtype=fp8, device=source.device)
        if c < cols:
            _zero_fp8(buffer[:, c:])
        if r < rows:
            _zero_fp8(buffer[r:, :c])
        torch.mul(source, scale, out=unarrange(buffer[:r, :c]))
        return buffer

    def _padded_scale(self, inverse: torch.Tensor) -> torch.Tensor:
        """A [1, Kred] per-column inverse scale padded to [1, ld] (the padding's columns
        are zeros; any finite scale will do)."""
        g = self.geometry
        if g.kred == g.ld:
            return inverse
        return torch.cat([inverse, inverse.new_ones(1, g.ld - g.kred)], dim=1)

    # ---- the GEMM -------------------------------------------------------------

    def _mm(self, a, b, inv_a, inv_b, dtype, bias=None, out=None) -> torch.Tensor:
        """a @ b dequantized, in ``dtype`` (+ bias), in ``out`` where given. Rowwise
        scaling has bf16 results only (cuBLASLt's kernels): cast after for others."""
        mm_dtype = torch.bfloat16 if self.rowwise else dtype
        fused_bias = (
            bias
            if bias is not None and not self.rowwise and bias.dtype == dtype
            and dtype in (torch.float16, torch.bfloat16)
            else None
        )  # fmt: skip
        direct = (
            out is not None
            and mm_dtype == dtype
            and out.is_contiguous()
            and (bias is None or fused_bias is not None)
        )
        kwargs = {"out": out} if direct else {}
        result = torch._scaled_mm(
            a, b, scale_a=inv_a, scale_b=inv_b, bias=fused_bias, out_dtype=mm_dtype,
            use_fast_accum=False, **kwargs,
        )  # fmt: skip
        if direct:
            return out
        if result.dtype != dtype:
            result = result.to(dtype)
        if bias is not None and fused_bias is None:
            result = result.add_(bias)
        if out is not None:
            out.copy_(result)
            return out
        return result

    # ---- the operands -------------------------------------------------------

    def _by_kernel(self, source: torch.Tensor) -> bool:
        return kernel_casts(source.device.type, not self.rowwise, torch.compiler.is_compiling())

    def _columns(self, x, source, scale, fp8, transposed: bool) -> torch.Tensor:
        """x's patches ``source`` (a view of ``x``) as cols [M, ld], or as cols^T
        [ld, M'] for the weight gradient, whose reduction M is padded too. The kernel
        path reads x itself: its ``source`` may be None."""
        g = self.geometry
        m_padded = round_up(g.m, FP8_ALIGNMENT)
        if self._by_kernel(x):
            from gemmconv.kernels.patch_permute import gather_patches

            rows = self._rows_of(x, g.x_order_last) if transposed else None
            if rows is not None:
                return self._transposed_rows(rows, scale, fp8, g.ld)
            size = (g.ld, m_padded) if transposed else (g.m, g.ld)
            buffer = torch.empty(size, dtype=fp8, device=x.device)
            return gather_patches(x, g.outputs, g.kernel, g.x_order_last, buffer, scale,
                                  transposed)  # fmt: skip
        shape = source.shape
        if not transposed:
            return self._quantized(
                source, scale, fp8, (g.m, g.kred), (g.m, g.ld),
                lambda t: t.reshape(g.m, g.kred), lambda d: d.view(shape),
            )  # fmt: skip
        return self._quantized(
            source, scale, fp8, (g.kred, g.m), (g.ld, m_padded),
            lambda t: t.reshape(g.m, g.kred).t(), lambda d: d.t().view(shape),
        )  # fmt: skip

    def _weight(self, w, scale, fp8, last: bool, transposed: bool) -> torch.Tensor:
        """The weight as W [K, ld] (forward) or W^T [ld, K] (backward-data), its
        reduction in the column order (channels-last: ``last``)."""
        g = self.geometry
        order = Layout.CHANNELS_LAST if last else Layout.CHANNELS_FIRST
        if not transposed:
            return self._quantized(
                w, scale, fp8, (g.k, g.kred), (g.k, g.ld),
                lambda t: weight_rows(t, order), lambda d: self._weight_in_order(d, last),
            )  # fmt: skip
        return self._quantized(
            w, scale, fp8, (g.kred, g.k), (g.ld, g.k),
            lambda t: weight_rows(t, order).t(), lambda d: self._weight_in_order(d.t(), last),
        )  # fmt: skip

    @staticmethod
    def _transposed_rows(rows, scale, fp8, height: int) -> torch.Tensor:
        """``rows`` [M, W] times ``scale`` as the fp8 [height >= W, M'] matrix rows^T,
        zeros in columns M..M'-1 and rows W..height-1, by the tiled transpose: dY^T, and
        cols^T where a patch is a whole sample (x's memory is the column matrix). The
        patch gather's transposed store read Qwen2-VL's 14-pixel runs at 160 us on an
        H100, against 112 for torch's multiply and 55 for this transpose of dY."""
        from gemmconv.kernels.strided_copy import pad_rows

        m, width = rows.shape
        buffer = torch.empty(height, round_up(m, FP8_ALIGNMENT), dtype=fp8, device=rows.device)
        pad_rows(buffer[:width], rows.t(), scale)  # zeros in columns M..M'-1
        if height > width:
            _zero_fp8(buffer[width:])
        return buffer

    def _gradient(self, dy, scale, transposed: bool) -> torch.Tensor:
        """dY as rows [M, K] (backward-data) or as dY^T [K, M'] (backward-weights)."""
        g, fp8 = self.geometry, self.config.grad_dtype
        if self._by_kernel(dy):
            quantized = self._gradient_by_kernel(dy, scale, fp8, transposed)
            if quantized is not None:
                return quantized
        if not transposed:
            return self._quantized(
                dy, scale, fp8, (g.m, g.k), (g.m, g.k),
                lambda t: t.movedim(1, -1).reshape(g.m, g.k), self._dy_as_rows,
            )  # fmt: skip
        return self._quantized(
            dy, scale, fp8, (g.k, g.m), (g.k, round_up(g.m, FP8_ALIGNMENT)),
            lambda t: t.movedim(1, -1).reshape(g.m, g.k).t(), lambda d: self._dy_as_rows(d.t()),
        )  # fmt: skip

    def _gradient_by_kernel(self, dy, scale, fp8, transposed: bool) -> torch.Tensor | None:
        """``_gradient`` through kernels/strided_copy.py, from dY seen as rows [M, K]
        (channels-last, or one pixel a sample) or as [N, K, P] (channels-first); None
        where dY is neither view or has more samples than a launch's grid takes."""
        from gemmconv.kernels.strided_copy import MAX_BATCH, strided_copy

        g = self.geometry
        rows = rows_view(dy)
        blocks = batched_view(dy) if rows is None else None
        if rows is None and (blocks is None or max(g.n, g.k) > MAX_BATCH):
            return None
        if not transposed:
            buffer = torch.empty(g.m, g.k, dtype=fp8, device=dy.device)
            if rows is not None:
                return strided_copy(buffer, rows, scale)
            # [N, K, P] -> [N, P, K]: a transpose per sample.
            strided_copy(buffer.view(g.n, -1, g.k), blocks.transpose(1, 2), scale)
            return buffer
        if rows is not None:
            return self._transposed_rows(rows, scale, fp8, g.k)
        m_padded = round_up(g.m, FP8_ALIGNMENT)
        buffer = torch.empty(g.k, m_padded, dtype=fp8, device=dy.device)
        # dY^T[k, n*P + p] = dY[n, k, p]: per output channel, the samples' pixel rows.
        strided_copy(buffer[:, : g.m].view(g.k, g.n, -1), blocks.transpose(0, 1), scale)
        if m_padded > g.m:
            _zero_fp8(buffer[:, g.m :])
        return buffer

    # ---- forward --------------------------------------------------------------

    def forward(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None):
        """y, the (scale, inverse) pairs of x and w the backward reuses (tensorwise),
        and the fp8 weight W [K, ld] (see ``weight_for_backward``)."""
        g, fp8 = self.geometry, self.config.forward_dtype
        by_kernel = self._by_kernel(x)
        if by_kernel:
            # The gather reads x itself; the tensorwise amax needs only the covered part.
            source = None
            sx, inv_x = self._scale(self._covered(x), fp8, None)
        else:
            source = self._patches(x, g.x_order_last)  # [N, O.., patch..], the column order
            sx, inv_x = self._scale(source, fp8, self._patch_dims() if self.rowwise else None)
        cols = self._columns(x, source, sx, fp8, transposed=False)
        sw, inv_w = self._scale(w, fp8, tuple(range(1, w.dim())) if self.rowwise else None)
        wq = self._weight(w, sw, fp8, g.x_order_last, transposed=False)
        scales = ((sx, inv_x), (sw, inv_w))
        if self.rowwise:
            inv_x, inv_w = inv_x.reshape(-1, 1), inv_w.reshape(1, -1)
        y = empty_in(g.output_shape, g.result_layout, x.dtype, x.device)
        target = None if torch.compiler.is_compiling() else rows_view(y)
        if target is not None:
            self._mm(cols, wq.t(), inv_x, inv_w, x.dtype, bias, out=target)
            return y, scales, wq
        # Channels-first y with several pixels per sample: the rows are transposed into
        # it (no batched fp8 GEMM writes each sample's [K, P] block), by the tiled
        # transpose where its grid takes the samples: torch's strided copy of ViT-B/16
        # b256's y took about half of the step's elementwise time on an H100.
        y_rows = self._mm(cols, wq.t(), inv_x, inv_w, x.dtype, bias)
        if by_kernel:
            from gemmconv.kernels.strided_copy import MAX_BATCH, strided_copy

            blocks = batched_view(y) if g.n <= MAX_BATCH else None
            if blocks is not None:
                strided_copy(blocks.transpose(1, 2), y_rows.view(g.n, -1, g.k))
                return y, scales, wq
        y.copy_(self._dy_as_rows(y_rows))
        return y, scales, wq

    def weight_for_backward(self, wq: torch.Tensor) -> torch.Tensor | None:
        """The forward's fp8 weight ``wq`` where backward_data builds its W^T from it
        (worth keeping for the backward: K x ld bytes), else None. It does on the kernel
        path (eager, CUDA, tensorwise: backward-data's scale is the forward's) where
        both directions order the reduction alike."""
        g = self.geometry
        reusable = g.x_order_last == g.dx_order_last and self._by_kernel(wq)
        return wq if reusable else None

    # ---- backward -------------------------------------------------------------

    def gradient_scales(self, dy: torch.Tensor):
        """dY's tensorwise (scale, inverse), for both backward GEMMs to share; None
        where each takes its own (rowwise: per row of its own GEMM)."""
        if self.rowwise:
            return None
        return self._scale(dy, self.config.grad_dtype, None)

    def backward_data(
        self, dy: torch.Tensor, w: torch.Tensor, w_scales, dy_scales=None, w_fp8=None
    ) -> torch.Tensor:
        """dx: dcol = dY @ W scattered into dx's patch positions, the rest zeros.
        ``w_scales``: the forward's (scale, inverse) of w; ``dy_scales``: dY's, from
        gradient_scales, or None to take them here; ``w_fp8``: the forward's fp8
        weight from ``weight_for_backward``, or None to cast w here."""
        g, cfg = self.geometry, self.config
        sdy, inv_dy = dy_scales or self._scale(dy, cfg.grad_dtype, (1,) if self.rowwise else None)
        gq = self._gradient(dy, sdy, transposed=False)
        sw, inv_w = w_scales
        if self.rowwise:
            sw, inv_w = self._scale(w, cfg.forward_dtype, (0,))  # per reduction element, over K
        # b = W [K, ld] column-major: stored as W^T [ld, K]. The forward's W has the
        # same scale, values and zero padding: one transposing copy where empty, zero_
        # and the multiply took three calls.
        if w_fp8 is not None and self.weight_for_backward(w_fp8) is not None:
            wt = w_fp8.t().contiguous()
        else:
            wt = self._weight(w, sw, cfg.forward_dtype, g.dx_order_last, transposed=True)
        if self.rowwise:
            inv_dy = inv_dy.reshape(-1, 1)
            inv_w = self._padded_scale(self._columns_of(inv_w, g.dx_order_last))
        dx = empty_in(g.input_shape, g.result_layout, dy.dtype, dy.device)
        zero_outside(dx, g.covered)
        # Where dx's memory is the column matrix (point-output, or a 1x1 in its own
        # order) the GEMM writes it, or its padded rows are copied into it row by row.
        target = None if torch.compiler.is_compiling() else self._rows_of(dx, g.dx_order_last)
        if target is not None and g.ld == g.kred and target.is_contiguous():
            self._mm(gq, wt.t(), inv_dy, inv_w, dy.dtype, out=target)
            return dx
        dcol = self._mm(gq, wt.t(), inv_dy, inv_w, dy.dtype)
        if target is not None:
            # One dense pass: the patch scatter took about 160 us of Qwen2-VL's step on
            # an H100 to write its 1184-wide rows into dx's 1176-wide ones.
            target.copy_(dcol[:, : g.kred])
            return dx
        if self._by_kernel(dy):
            # dcol [M, ld] is dense (tensorwise: _scaled_mm's own result), as the
            # scatter wants; torch's strided copy into dx's patches crawled.
            from gemmconv.kernels.patch_permute import scatter_patches

            scatter_patches(dcol, g.outputs, g.kernel, g.dx_order_last, dx)
            return dx
        view = self._patches(dx, g.dx_order_last)
        view.copy_(dcol[:, : g.kred].view(view.shape))
        return dx

    def backward_weights(
        self, dy: torch.Tensor, x: torch.Tensor, x_scales, weight: torch.Tensor, dy_scales=None
    ) -> torch.Tensor:
        """dW = dY^T @ cols, as [K, ld] from dY^T [K, M'] and cols^T [ld, M'] (the
        reduction M padded to M' with zeros), stored in ``weight``'s strides.
        ``x_scales``: the forward's (scale, inverse) of x; ``dy_scales`` as for
        backward_data."""
        g, cfg = self.geometry, self.config
        dy_dims = (0, *range(2, dy.dim()))
        sdy, inv_dy = dy_scales or self._scale(
            dy, cfg.grad_dtype, dy_dims if self.rowwise else None
        )
        gt = self._gradient(dy, sdy, transposed=True)  # a = dY^T, row-major
        # The kernel path reads x itself (through _rows_of where x is the columns).
        source = None if self._by_kernel(x) else self._patches(x, g.x_order_last)
        sx, inv_x = x_scales
        if self.rowwise:
            sx, inv_x = self._scale(source, cfg.forward_dtype, self._pixel_dims())
        # b = cols [M', ld] column-major: stored as cols^T [ld, M'].
        ct = self._columns(x, source, sx, cfg.forward_dtype, transposed=True)
        if self.rowwise:
            inv_dy = inv_dy.reshape(-1, 1)
            inv_x = self._padded_scale(inv_x.reshape(1, -1))
        dw_rows = self._mm(gt, ct.t(), inv_dy, inv_x, dy.dtype)
        dw = torch.empty_like(weight, dtype=dy.dtype)
        order = Layout.CHANNELS_LAST if g.x_order_last else Layout.CHANNELS_FIRST
        store_weight_rows(dw, dw_rows[:, : g.kred], order)
        return dw

    def backward_bias(self, dy: torch.Tensor) -> torch.Tensor:
        return bias_grad(dy, self.geometry.k)


def gemm_shapes(p: ConvProblem) -> dict[str, tuple[int, int, int]]:
    """(M, K, N) of each direction's fp8 GEMM, the reductions padded: for the probe's
    and explain's text."""
    ld = round_up(p.gemm_k, FP8_ALIGNMENT)
    m = p.gemm_m
    return {
        "forward": (m, ld, p.k),
        "backward_data": (m, p.k, ld),
        "backward_weights": (p.k, round_up(m, FP8_ALIGNMENT), ld),
    }


__all__ = ["Float8Run", "gemm_shapes", "kernel_casts", "problem_reasons"]
