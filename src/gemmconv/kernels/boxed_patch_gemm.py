"""GEMMs of patch embeddings whose columns the tensor memory accelerator (TMA) loads
in boxes: no column buffer, no gather in the loads' addresses.

With stride equal to the kernel and no padding, x [N, C, F, H, W] (2-D: F = 1) seen as

    [N * C * F, HP, PH, WP, PW]    strides [H * W, PH * W, W, PW, 1]

is a 5-D tensor TMA can box, where HP, WP are the patches along H and W: a box
[1, BHP, BKH, BWP, PW] at (frame, hp0, kh0, wp0, 0) holds, for BHP x BWP patches,
BKH rows of each patch's pixels of one channel and frame. Permuted to
[BHP, BWP, BKH, PW] in registers it is a [BLOCK_M, BLOCK_K] tile of the column matrix
whose reduction order (c, dt, kh, kw) is the weight's, so the weight's rows load as
plain 2-D boxes. Patch rows past HP or WP read as zeros (TMA's bounds), and their
outputs are not stored. TMA needs the innermost extent and every other stride to be
16-byte multiples: PW and W a multiple of 8 half-precision elements (ViT-B/16, SAM,
VideoMAE), not CLIP-L/14's 14-pixel patches.

A program owns BHP x BWP patches of one sample and frame-patch and BLOCK_N output
channels, and stores its tile into channels-first y [N, K, TP, HP, WP] through y's
strides with the bias added. Patch grids that are not a multiple of the box (ViT's
14 x 14 in 16-wide boxes) leave part of each tile idle: 196 of 256 rows.

``boxed_patch_weight_grad`` reads x by the same boxes as the B operand of
dW = dY^T @ cols, dY through its strides as [BLOCK_N, BHP, BWP] tiles (ViT's 14-patch
rows are 28 bytes, which TMA cannot box; the host proves their 4-byte alignment and
they load in pipelined 4-byte copies), each program summing its share of the patch
tiles in a fixed order into an fp32 partial.

``boxed_patch_backward_data`` runs the same boxes the other way: a program computes
one box's columns of dY @ W (dY as the weight gradient reads it, transposed in
registers) and stores them into dx's 5-D view by TMA, so the scatter costs no pass.

Where each sample is one patch whose memory is dense in the reduction's order and its
rows are 16-byte multiples (Qwen2-VL's and Qwen3-VL's [2, 14, 14] and [2, 16, 16]
video patches, point 3D), the column matrix is x itself as [M, Kred] rows, and
``boxed_rows_forward`` loads it by plain 2-D boxes: a GEMM whose tiles and reduction
order do not depend on M (no split-K), like the implicit GEMM's whole-row form, which
loads the same rows through pointers at about half cuBLAS's speed on an H100 (point
3D's forward: 100 us against 51; bench/probes/results/whole_row_h100.txt).

The tiles are for half precision; fp32 operands (the CPU tests') multiply in TF32 on
a GPU, tl.dot's default, where a solver would follow torch's TF32 setting. No solver
runs any of them yet: bench/probes/boxed_patch_gemm.py times them against
the implicit GEMMs of patch_gemm and cuBLAS on the same columns.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from gemmconv.kernels import compiled
from gemmconv.kernels.paired_rows_gemm import TMA_ALIGNMENT
from gemmconv.kernels.patch_gemm import TileConfig, vector_elements
from gemmconv.kernels.patch_index import DeviceHelper, below
from gemmconv.kernels.program_order import grouped_tile


def _patch_origin(tile, TP, HP, WP, BHP: tl.constexpr, BWP: tl.constexpr):
    """(n, tp, hp0, wp0) of patch tile ``tile``: the tiles of a sample's frame patch in
    patch-row order, then its frame patches, then the samples."""
    hp_tiles = (HP + BHP - 1) // BHP  # not tl.cdiv: a jit helper the interpreter lacks
    wp_tiles = (WP + BWP - 1) // BWP
    patch_tile = tile % (hp_tiles * wp_tiles)
    sample_frame = tile // (hp_tiles * wp_tiles)  # n * TP + tp
    hp0 = (patch_tile // wp_tiles) * BHP
    wp0 = (patch_tile % wp_tiles) * BWP
    return sample_frame // TP, sample_frame % TP, hp0, wp0


def _box_start(step, n, tp, C, F, KT: tl.constexpr, PH: tl.constexpr, BKH: tl.constexpr):
    """(row of x's 5-D view, first pixel row) of reduction box ``step`` (channel c, frame
    dt of the kernel, BKH pixel rows: the weight's order) of sample n's frame patch tp."""
    STEPS_PER_FRAME: tl.constexpr = PH // BKH
    channel_frame = step // STEPS_PER_FRAME  # c * KT + dt
    frame = (n * C + channel_frame // KT) * F + tp * KT + channel_frame % KT
    return frame, (step % STEPS_PER_FRAME) * BKH


def _box_columns(box, BHP: tl.constexpr, BKH: tl.constexpr, BWP: tl.constexpr,
                 PW: tl.constexpr):  # fmt: skip
    """A box [1, BHP, BKH, BWP, PW] as its [BHP * BWP, BKH * PW] tile of the column matrix."""
    tile = tl.permute(box.reshape(BHP, BKH, BWP, PW), (0, 2, 1, 3))
    return tile.reshape(BHP * BWP, BKH * PW)


def _pixel_block(channels, n, tp, hp0, wp0, HP, WP, YSN, YST, YSH, YSW,
                 PIXEL_ALIGN: tl.constexpr, BHP: tl.constexpr, BWP: tl.constexpr,
                 CHANNELS_OUTER: tl.constexpr):  # fmt: skip
    """(offsets, mask over the patches) of a block of y or dY: ``channels`` (their
    offsets) by BHP patch rows by BWP patches, as [channels, BHP, BWP] where
    CHANNELS_OUTER, else [BHP, BWP, channels]. Patches along a row are an axis of their
    own, so Triton sees their runs (and the host's PIXEL_ALIGN claim on them) and moves
    them in vectors; through a flattened patch index it moved 2-byte pieces."""
    hp = hp0 + tl.arange(0, BHP)
    wp = wp0 + tl.arange(0, BWP)
    row = n.to(tl.int64) * YSN + tp.to(tl.int64) * YST + hp * YSH
    inside = (hp < HP)[:, None] & below(wp, WP, PIXEL_ALIGN)[None, :]
    pixels = row[:, None] + (wp * YSW)[None, :]
    if CHANNELS_OUTER:
        offsets = channels[:, None, None] + pixels[None, :, :]
        mask = inside[None, :, :]
        if PIXEL_ALIGN > 1:
            offsets = tl.multiple_of(offsets, [1, 1, PIXEL_ALIGN])
            offsets = tl.max_contiguous(offsets, [1, 1, PIXEL_ALIGN])
    else:
        offsets = pixels[:, :, None] + channels[None, None, :]
        mask = inside[:, :, None]
        if PIXEL_ALIGN > 1:
            offsets = tl.multiple_of(offsets, [1, PIXEL_ALIGN, 1])
            offsets = tl.max_contiguous(offsets, [1, PIXEL_ALIGN, 1])
    return offsets, mask


patch_origin = DeviceHelper(_patch_origin)
box_start = DeviceHelper(_box_start)
box_columns = DeviceHelper(_box_columns)
pixel_block = DeviceHelper(_pixel_block)


def _forward_kernel(
    x_desc, w_desc, b_ptr, y_ptr,
    C, F, TP, HP, WP, KOUT,
    YSN, YSC, YST, YSH, YSW, BS,
    KT: tl.constexpr,
    PH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PIXEL_ALIGN: tl.constexpr,
    BHP: tl.constexpr,
    BWP: tl.constexpr,
    BKH: tl.constexpr,
    PW: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """y[n, k, tp, hp, wp] = sum over (c, dt, kh, kw) of
    x[n, c, tp*KT + dt, hp*PH + kh, wp*PW + kw] * w[k, (c, dt, kh, kw)] (+ b[k]). A
    program owns one patch tile and BLOCK_N output channels."""
    n, tp, hp0, wp0 = patch_origin(tl.program_id(0), TP, HP, WP, BHP, BWP)
    k0 = tl.program_id(1) * BLOCK_N
    acc = tl.full((BHP * BWP, BLOCK_N), 0.0, dtype=tl.float32)
    for step in range(C * KT * (PH // BKH)):
        frame, kh0 = box_start(step, n, tp, C, F, KT, PH, BKH)
        a = box_columns(x_desc.load([frame, hp0, kh0, wp0, 0]), BHP, BKH, BWP, PW)
        b = w_desc.load([k0, step * BKH * PW])
        acc = tl.dot(a, b.T, acc)

    kout = k0 + tl.arange(0, BLOCK_N)
    k_ok = kout < KOUT
    if HAS_BIAS:
        acc += tl.load(b_ptr + kout * BS, mask=k_ok, other=0.0).to(tl.float32)[None, :]
    offsets, mask = pixel_block(kout.to(tl.int64) * YSC, n, tp, hp0, wp0, HP, WP, YSN, YST, YSH,
                                YSW, PIXEL_ALIGN, BHP, BWP, False)  # fmt: skip
    tl.store(y_ptr + offsets, acc.reshape(BHP, BWP, BLOCK_N).to(y_ptr.dtype.element_ty),
             mask=mask & k_ok[None, None, :])  # fmt: skip


def _wgrad_kernel(
    dy_ptr, x_desc, part_ptr,
    C, F, TP, HP, WP, KOUT, KRED, TILES, PER_SPLIT,
    YSN, YSC, YST, YSH, YSW,
    KT: tl.constexpr,
    PH: tl.constexpr,
    PIXEL_ALIGN: tl.constexpr,
    BHP: tl.constexpr,
    BWP: tl.constexpr,
    BKH: tl.constexpr,
    PW: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """part[split, k, r] = sum over the split's patch tiles of dY[n, k, tp, hp, wp] *
    x's column (n, tp, hp, wp; r), r in the weight's order (c, dt, kh, kw). A program
    owns BLOCK_N output channels by one box's reduction columns and walks PER_SPLIT
    patch tiles in order, so the sum's order is fixed by the shapes."""
    BLOCK_K: tl.constexpr = BKH * PW
    steps = KRED // BLOCK_K
    step = tl.program_id(0) % steps
    kout = (tl.program_id(0) // steps) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = kout < KOUT
    split = tl.program_id(1)
    acc = tl.full((BLOCK_N, BLOCK_K), 0.0, dtype=tl.float32)
    first = split * PER_SPLIT
    last = tl.where(first + PER_SPLIT < TILES, first + PER_SPLIT, TILES)
    for tile in range(first, last):
        n, tp, hp0, wp0 = patch_origin(tile, TP, HP, WP, BHP, BWP)
        offsets, mask = pixel_block(kout.to(tl.int64) * YSC, n, tp, hp0, wp0, HP, WP, YSN,
                                    YST, YSH, YSW, PIXEL_ALIGN, BHP, BWP, True)  # fmt: skip
        a = tl.load(dy_ptr + offsets, mask=mask & k_ok[:, None, None], other=0.0)
        frame, kh0 = box_start(step, n, tp, C, F, KT, PH, BKH)
        b = box_columns(x_desc.load([frame, hp0, kh0, wp0, 0]), BHP, BKH, BWP, PW)
        acc = tl.dot(a.reshape(BLOCK_N, BHP * BWP), b, acc)

    r = step * BLOCK_K + tl.arange(0, BLOCK_K)
    offsets = (split * KOUT + kout[:, None]).to(tl.int64) * KRED + r[None, :]
    tl.store(part_ptr + offsets, acc, mask=k_ok[:, None])


def _dgrad_kernel(
    dy_ptr, w_desc, dx_desc,
    C, F, TP, HP, WP, KOUT, KRED,
    YSN, YSC, YST, YSH, YSW,
    KT: tl.constexpr,
    PH: tl.constexpr,
    PIXEL_ALIGN: tl.constexpr,
    BHP: tl.constexpr,
    BWP: tl.constexpr,
    BKH: tl.constexpr,
    PW: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dx's box at (frame, hp0, kh0, wp0, 0) = the column tile dY[patches, :] @ w[:, the
    box's reduction columns], permuted back into the box and stored by TMA (patches
    past HP or WP are not written). A program owns one box: one patch tile, one box's
    reduction columns, and walks the output channels in BLOCK_N steps. dY is read as
    the weight gradient reads it, [BLOCK_N, BHP, BWP] (its pipelined copies; with the
    channels innermost they were plain loads), and transposed in registers."""
    BLOCK_M: tl.constexpr = BHP * BWP
    BLOCK_K: tl.constexpr = BKH * PW
    steps = KRED // BLOCK_K
    step = tl.program_id(0) % steps  # a patch tile's boxes run one after another
    n, tp, hp0, wp0 = patch_origin(tl.program_id(0) // steps, TP, HP, WP, BHP, BWP)
    acc = tl.full((BLOCK_M, BLOCK_K), 0.0, dtype=tl.float32)
    for k0 in range(0, KOUT, BLOCK_N):
        kout = k0 + tl.arange(0, BLOCK_N)
        offsets, mask = pixel_block(kout.to(tl.int64) * YSC, n, tp, hp0, wp0, HP, WP, YSN,
                                    YST, YSH, YSW, PIXEL_ALIGN, BHP, BWP, True)  # fmt: skip
        # Channels past KOUT read as zeros, as W's box does.
        a = tl.load(dy_ptr + offsets, mask=mask & (kout < KOUT)[:, None, None], other=0.0)
        b = w_desc.load([k0, step * BLOCK_K])
        acc = tl.dot(tl.trans(a.reshape(BLOCK_N, BLOCK_M)), b, acc)

    frame, kh0 = box_start(step, n, tp, C, F, KT, PH, BKH)
    box = tl.permute(acc.reshape(BHP, BWP, BKH, PW), (0, 2, 1, 3))
    dx_desc.store([frame, hp0, kh0, wp0, 0], box.reshape(1, BHP, BKH, BWP, PW).to(dx_desc.dtype))


def _rows_kernel(
    x_desc, w_desc, b_ptr, y_ptr,
    M, KOUT, KRED, YSM, YSC, BS,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    """y[m, k] = sum over r of x[m, r] * w[k, r] (+ b[k]); rows past M and reduction
    columns past KRED read as zeros (TMA's bounds)."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, KOUT, BLOCK_M, BLOCK_N, GROUP_M)
    m0 = pid_m * BLOCK_M
    k0 = pid_n * BLOCK_N
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    for r0 in range(0, KRED, BLOCK_K):
        acc = tl.dot(x_desc.load([m0, r0]), w_desc.load([k0, r0]).T, acc)
    m = m0 + tl.arange(0, BLOCK_M)
    kout = k0 + tl.arange(0, BLOCK_N)
    k_ok = kout < KOUT
    if HAS_BIAS:
        acc += tl.load(b_ptr + kout * BS, mask=k_ok, other=0.0).to(tl.float32)[None, :]
    offsets = m[:, None].to(tl.int64) * YSM + kout[None, :].to(tl.int64) * YSC
    tl.store(y_ptr + offsets, acc.to(y_ptr.dtype.element_ty),
             mask=(m < M)[:, None] & k_ok[None, :])  # fmt: skip


# Tiles for half precision, not yet measured: 128 patches a tile (ViT-B/16: 8 patch
# rows of a 16-wide box over its 14 x 14 grid; box_shape), 64 reduction elements a step
# (four pixel rows of a 16-pixel patch) and 128 output channels. Shared memory a stage:
# 16 KiB of x and 16 KiB of W.
FORWARD_TILES = TileConfig(128, 128, 64, 8, 3)


@dataclasses.dataclass(frozen=True)
class _Boxes:
    """A channels-first x [N, C, (F,) H, W] under a patch ``kernel`` seen as TMA boxes,
    and the tiles of a configuration over it."""

    n: int
    c: int
    f: int  # frames (1 in 2-D)
    h: int
    w: int
    kt: int  # the kernel's frames (1 in 2-D)
    tp: int  # frame patches (1 in 2-D)
    ph: int
    pw: int
    hp: int
    wp: int
    volumes: bool  # 3-D
    rows: int  # BHP
    depth: int  # BKH
    width: int  # BWP

    @property
    def reduction(self) -> int:
        return self.c * self.kt * self.ph * self.pw

    @property
    def patch_tiles(self) -> int:
        return self.n * self.tp * triton.cdiv(self.hp, self.rows) * triton.cdiv(self.wp, self.width)

    @property
    def steps(self) -> int:
        """Boxes along the reduction."""
        return self.reduction // (self.depth * self.pw)

    @property
    def covers_all(self) -> bool:
        """Whether every pixel of x lies in some patch."""
        covered = (self.tp * self.kt, self.hp * self.ph, self.wp * self.pw)
        return covered == (self.f, self.h, self.w)

    def output_shape(self, kout: int) -> tuple[int, ...]:
        return (self.n, kout, *((self.tp,) if self.volumes else ()), self.hp, self.wp)

    def descriptor(self, t: torch.Tensor):
        """The 5-D view of ``t`` (x or dx) in this geometry's boxes."""
        from triton.tools.tensor_descriptor import TensorDescriptor

        shape = [self.n * self.c * self.f, self.hp, self.ph, self.wp, self.pw]
        strides = [self.h * self.w, self.ph * self.w, self.w, self.pw, 1]
        return TensorDescriptor(t, shape, strides, [1, self.rows, self.depth, self.width, self.pw])

    def weight_descriptor(self, weight_rows: torch.Tensor, block_n: int):
        from triton.tools.tensor_descriptor import TensorDescriptor

        kout = weight_rows.shape[0]
        box = [block_n, self.depth * self.pw]
        return TensorDescriptor(weight_rows, [kout, self.reduction], [self.reduction, 1], box)

    def pixel_strides(self, t: torch.Tensor) -> tuple[int, ...]:
        """(sample, channel, frame patch, patch row, patch) strides of y or dY ``t``."""
        ysn, ysc, *spatial = t.stride()
        return (ysn, ysc, *(spatial if self.volumes else (0, *spatial)))


def _boxes(
    name: str,
    x: torch.Tensor,
    kernel: tuple[int, ...],
    cfg: TileConfig,
    weight_rows: torch.Tensor | None = None,
    output: tuple[str, torch.Tensor] | None = None,
) -> _Boxes:
    """The boxes of ``x`` (called ``name``) under ``kernel`` and ``cfg``, after checking
    that TMA can box it (``applies``), that ``weight_rows`` is [K, C * prod(kernel)] and
    that the output-shaped operand ``output`` (its name and tensor) has the patches'
    shape: ValueError naming the argument otherwise."""
    reasons = applies(x, kernel, weight_rows)
    if reasons:
        raise ValueError(f"{name} {tuple(x.shape)}, kernel {kernel}: " + "; ".join(reasons))
    if x.dim() == 4:
        (n, c, h, w), f, kt = x.shape, 1, 1
    else:
        (n, c, f, h, w), kt = x.shape, kernel[0]
    ph, pw = kernel[-2], kernel[-1]
    rows, depth, width = box_shape(w // pw, ph, pw, cfg)
    boxes = _Boxes(n, c, f, h, w, kt, f // kt, ph, pw, h // ph, w // pw, x.dim() == 5,
                   rows, depth, width)  # fmt: skip
    if weight_rows is not None and weight_rows.shape[1] != boxes.reduction:
        raise ValueError(f"weight_rows {tuple(weight_rows.shape)}: expected [K, {boxes.reduction}]")
    if output is not None:
        label, t = output
        expected = boxes.output_shape(t.shape[1] if weight_rows is None else weight_rows.shape[0])
        if tuple(t.shape) != expected:
            raise ValueError(f"{label} {tuple(t.shape)}: expected {list(expected)}")
    return boxes


def applies(
    x: torch.Tensor, kernel: tuple[int, ...], weight_rows: torch.Tensor | None = None
) -> list[str]:
    """Why TMA cannot box x's patches (empty: it can): channels-first dense x of 2 or 3
    spatial dimensions, a patch width that is a power of two and, like x's rows, a
    16-byte multiple, a 16-byte aligned base, fewer than 2^31 frames (its boxes'
    coordinates and the kernels' frame index are 32-bit); and the forward's weight rows
    dense and 16-byte aligned."""
    if x.dim() not in (4, 5) or len(kernel) != x.dim() - 2:
        return [f"x of {x.dim()} dimensions with kernel {kernel}: expected 2-D or 3-D"]
    reasons = []
    if not x.is_contiguous():
        reasons.append("x is not contiguous channels-first")
    size, width = x.element_size(), kernel[-1]
    if width & (width - 1) or (width * size) % TMA_ALIGNMENT:
        reasons.append(f"patch width {width} of {size}-byte elements is not a power of two "
                       f"of at least {TMA_ALIGNMENT} bytes")  # fmt: skip
    if (x.shape[-1] * size) % TMA_ALIGNMENT:
        reasons.append(f"rows of {x.shape[-1]} {size}-byte elements are not a multiple of "
                       f"{TMA_ALIGNMENT} bytes")  # fmt: skip
    if x.data_ptr() % TMA_ALIGNMENT:
        reasons.append("x does not start 16-byte aligned")
    frames = x.shape[0] * x.shape[1] * (x.shape[2] if x.dim() == 5 else 1)
    if frames >= 2**31:
        reasons.append(f"{frames} frames of x (samples x channels x frames) exceed TMA's "
                       "32-bit coordinates")  # fmt: skip
    if weight_rows is not None:
        if not weight_rows.is_contiguous():
            reasons.append("the weight's rows are not dense")
        elif weight_rows.data_ptr() % TMA_ALIGNMENT:
            reasons.append("the weight does not start 16-byte aligned")
    return reasons


def pixel_alignment(t: torch.Tensor, box_width: int) -> int:
    """PIXEL_ALIGN for y or dY ``t`` [N, K, (TP,) HP, WP]: the largest power of two, up
    to 16 bytes' worth, such that each aligned group of that many patches along a row
    is consecutive memory from a multiple of it (it divides WP, the box's width and
    every other stride); 1 where the patches along a row are not adjacent (a
    channels-last t)."""
    if t.stride(-1) != 1:
        return 1
    return vector_elements(t.element_size(), t.shape[-1], box_width, *t.stride()[:-1])


def box_shape(row_patches: int, patch_height: int, patch_width: int, cfg: TileConfig):
    """(BHP, BKH, BWP): patch rows and pixel rows a box holds and patches along a row.
    BWP is the grid's row rounded up to a power of two, at most the tile's patches;
    BKH the most pixel rows within the tile's reduction depth that divide the patch."""
    width = min(triton.next_power_of_2(row_patches), cfg.block_m)
    depth = 1 << max(0, (cfg.block_k // patch_width).bit_length() - 1)
    while patch_height % depth:
        depth //= 2
    return cfg.block_m // width, depth, width


def boxed_patch_forward(
    x: torch.Tensor,
    weight_rows: torch.Tensor,
    bias: torch.Tensor | None,
    kernel: tuple[int, ...],
    out: torch.Tensor,
    cfg: TileConfig | None = None,
) -> torch.Tensor:
    """out [N, K, O..] (any strides) = conv(x, W, bias) with stride = ``kernel`` and no
    padding, for x TMA can box (``applies``); ``weight_rows`` [K, C * prod(kernel)] in
    the weight's own order. ``cfg`` overrides the tiles (the probe's sweep; block_m
    and block_k powers of two)."""
    cfg = cfg or FORWARD_TILES
    b = _boxes("x", x, kernel, cfg, weight_rows, ("out", out))
    kout = weight_rows.shape[0]
    if bias is not None and bias.shape != (kout,):
        raise ValueError(f"bias {tuple(bias.shape)}: expected [{kout}]")
    launch = compiled(_forward_kernel, x.device)
    launch[(b.patch_tiles, triton.cdiv(kout, cfg.block_n))](
        b.descriptor(x), b.weight_descriptor(weight_rows, cfg.block_n),
        weight_rows if bias is None else bias, out,
        b.c, b.f, b.tp, b.hp, b.wp, kout, *b.pixel_strides(out),
        1 if bias is None else bias.stride(0),
        KT=b.kt, PH=b.ph, HAS_BIAS=bias is not None, PIXEL_ALIGN=pixel_alignment(out, b.width),
        BHP=b.rows, BWP=b.width, BKH=b.depth, PW=b.pw, BLOCK_N=cfg.block_n,
        **cfg.launch_options(),
    )  # fmt: skip
    return out


# Backward-data tiles: 128 patches by one box's 64 reduction columns a program, the
# output channels walked 64 at a time.
DGRAD_TILES = TileConfig(128, 64, 64, 8, 3)
# Weight-gradient tiles for half precision: 128 output channels by 64 reduction columns
# (four pixel rows of a 16-pixel patch), 128 patches reduced a step. dY is read
# through its strides (ViT's 14-patch rows are 28 bytes, which TMA cannot box).
WGRAD_TILES = TileConfig(128, 128, 64, 8, 3)


def boxed_patch_weight_grad(
    grad_output: torch.Tensor,
    x: torch.Tensor,
    kernel: tuple[int, ...],
    programs: int,
    cfg: TileConfig | None = None,
) -> torch.Tensor:
    """dW as fp32 rows [K, C * prod(kernel)] in the weight's order, from dY [N, K, O..]
    (any strides) and x TMA can box (``applies``), stride = ``kernel``, no padding; the
    reduction over patch tiles cut into enough fp32 partials to run about ``programs``
    programs (gemmconv.kernels.split_programs), summed in a fixed order."""
    cfg = cfg or WGRAD_TILES
    b = _boxes("x", x, kernel, cfg, output=("grad_output", grad_output))
    kout = grad_output.shape[1]
    out_tiles = triton.cdiv(kout, cfg.block_n) * b.steps
    # Never a split of fewer than four tiles: each writes a whole partial.
    splits = max(1, min(triton.cdiv(programs, out_tiles), triton.cdiv(b.patch_tiles, 4)))
    per_split = triton.cdiv(b.patch_tiles, splits)
    splits = triton.cdiv(b.patch_tiles, per_split)  # every split owns at least one tile
    partials = torch.empty(splits, kout, b.reduction, dtype=torch.float32, device=x.device)
    launch = compiled(_wgrad_kernel, x.device)
    launch[(out_tiles, splits)](
        grad_output, b.descriptor(x), partials,
        b.c, b.f, b.tp, b.hp, b.wp, kout, b.reduction, b.patch_tiles, per_split,
        *b.pixel_strides(grad_output),
        KT=b.kt, PH=b.ph, PIXEL_ALIGN=pixel_alignment(grad_output, b.width), BHP=b.rows,
        BWP=b.width, BKH=b.depth, PW=b.pw, BLOCK_N=cfg.block_n, **cfg.launch_options(),
    )  # fmt: skip
    return partials[0] if splits == 1 else partials.sum(0)


def boxed_patch_backward_data(
    grad_output: torch.Tensor,
    weight_rows: torch.Tensor,
    kernel: tuple[int, ...],
    dx: torch.Tensor,
    cfg: TileConfig | None = None,
) -> torch.Tensor:
    """dx [N, C, (F,) H, W] (contiguous, TMA can box it: ``applies``) = the convolution's
    input gradient from dY [N, K, O..] (any strides) and ``weight_rows`` [K, C *
    prod(kernel)], stride = ``kernel``, no padding. Pixels no patch covers (sizes the
    kernel does not divide) are zeroed by a fill first. Returns dx."""
    cfg = cfg or DGRAD_TILES
    b = _boxes("dx", dx, kernel, cfg, weight_rows, ("grad_output", grad_output))
    if not b.covers_all:
        dx.zero_()
    launch = compiled(_dgrad_kernel, dx.device)
    launch[(b.patch_tiles * b.steps,)](
        grad_output, b.weight_descriptor(weight_rows, cfg.block_n), b.descriptor(dx),
        b.c, b.f, b.tp, b.hp, b.wp, weight_rows.shape[0], b.reduction,
        *b.pixel_strides(grad_output),
        KT=b.kt, PH=b.ph, PIXEL_ALIGN=pixel_alignment(grad_output, b.width), BHP=b.rows,
        BWP=b.width, BKH=b.depth, PW=b.pw, BLOCK_N=cfg.block_n, **cfg.launch_options(),
    )  # fmt: skip
    return dx


def rows_apply(x_rows: torch.Tensor, weight_rows: torch.Tensor) -> list[str]:
    """Why TMA cannot box these [M, Kred] rows and [K, Kred] weight rows (empty: it
    can): unit column strides, row strides that are 16-byte multiples, 16-byte aligned
    bases."""
    reasons = []
    for name, t in (("x_rows", x_rows), ("weight_rows", weight_rows)):
        if t.dim() != 2 or t.stride(1) != 1:
            reasons.append(f"{name} {tuple(t.shape)} with strides {t.stride()}: expected rows "
                           "with unit column stride")  # fmt: skip
        elif (t.stride(0) * t.element_size()) % TMA_ALIGNMENT or t.data_ptr() % TMA_ALIGNMENT:
            reasons.append(f"{name}'s rows of stride {t.stride(0)} are not 16-byte aligned")
    return reasons


def boxed_rows_forward(
    x_rows: torch.Tensor,
    weight_rows: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    cfg: TileConfig | None = None,
) -> torch.Tensor:
    """out[M, K] (any strides) = x_rows @ weight_rows^T (+ bias), both read by TMA boxes
    (``rows_apply``); ``cfg`` overrides the tiles (the probe's sweep)."""
    reasons = rows_apply(x_rows, weight_rows)
    if reasons:
        raise ValueError("; ".join(reasons))
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, reduction = x_rows.shape
    kout = weight_rows.shape[0]
    if weight_rows.shape[1] != reduction:
        raise ValueError(f"weight_rows {tuple(weight_rows.shape)}: expected [{kout}, {reduction}]")
    if tuple(out.shape) != (m, kout):
        raise ValueError(f"out {tuple(out.shape)}: expected [{m}, {kout}]")
    if bias is not None and bias.shape != (kout,):
        raise ValueError(f"bias {tuple(bias.shape)}: expected [{kout}]")
    cfg = cfg or FORWARD_TILES
    x_desc = TensorDescriptor(x_rows, [m, reduction], [x_rows.stride(0), 1],
                              [cfg.block_m, cfg.block_k])  # fmt: skip
    w_desc = TensorDescriptor(weight_rows, [kout, reduction], [weight_rows.stride(0), 1],
                              [cfg.block_n, cfg.block_k])  # fmt: skip
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(kout, cfg.block_n),)
    launch = compiled(_rows_kernel, x_rows.device)
    launch[grid](
        x_desc, w_desc, weight_rows if bias is None else bias, out,
        m, kout, reduction, out.stride(0), out.stride(1), 1 if bias is None else bias.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=8, **cfg.launch_options(),
    )  # fmt: skip
    return out


__all__ = [
    "DGRAD_TILES",
    "FORWARD_TILES",
    "WGRAD_TILES",
    "applies",
    "box_shape",
    "boxed_patch_backward_data",
    "boxed_patch_forward",
    "boxed_patch_weight_grad",
    "boxed_rows_forward",
    "rows_apply",
]
