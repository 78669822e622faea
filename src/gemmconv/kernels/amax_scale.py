"""A tensor's fp8 scale and its inverse from the current absolute maximum, in one launch.

The tensorwise recipe's scale took four torch calls an operand in eager mode (the norm,
the clamp at eps, the division by the format's maximum, the reciprocal), four launches
and, on an H200's host under cProfile, 220 of the 1434 us that Qwen2-VL's fp8 training
step spent issuing work (bench/probes/results/fp8_host_h200.jsonl). Here every program
reduces a chunk of the tensor to its largest |value|, merges it into one word with an
atomic maximum and counts itself done; the program that finishes last turns the word
into the scale and its inverse, and zeroes the two words for the next launch.

Those two words live in a buffer kept per device and stream, zeroed once: launches on
one stream run one after another, so each finds them zero. A buffer zeroed per call
cost a `torch.zeros` launch an operand, 55 us of host time in Qwen2-VL's fp8 training
step on an H100 under cProfile (bench/probes/results/fp8_host_h100.jsonl); the result
is now an allocation alone. A CUDA graph capture still zeroes a buffer of its own,
which each replay re-zeroes on the device.

|value| is compared as the bits of an fp32 number: a non-negative float orders as its
bits do, and a NaN (positive once its sign is cleared) lies above +inf, so a NaN wins as
it does in torch's norm. The arithmetic is torch's, so the results are its bytes:
scale = 1 / inverse rounded to nearest, and inverse = max(amax, eps) / fp8_max as torch
divides by a Python number on the tensor's device: on the CPU a rounded division, on
CUDA a product with fp8_max's fp32 reciprocal (ATen's div_true_kernel_cuda; the two
gave other last bits to 12 of the tests' 30 random scales on an H100).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemmconv.kernels.launch import LaunchCache, PreparedLaunch, TensorSlot

_BLOCK = 1024
# Blocks a program reduces: 16K elements, about 600 programs for Qwen2-VL's x at 8192
# patches and 2400 for ViT-B/16's at batch 256, each merged by two atomics.
_BLOCKS_PER_PROGRAM = 16
# The result's 32-bit words: the scale (word 0) and the inverse each start a 16-byte
# line (a GEMM's scale pointer is read as any tensor's).
_INVERSE, _WORDS = 4, 8
# The kept state's words: the merged maximum and the count of programs done.
_AMAX, _DONE, _STATE_WORDS = 0, 1, 2


@triton.jit
def _larger(a, b):
    # tl.max's combine, spelt out: tl.max is a jit helper that Triton's interpreter
    # (the CPU tests) cannot call, tl.reduce is a builtin it runs.
    return tl.maximum(a, b)


def _amax_scale_kernel(
    src_ptr,
    state_ptr,
    result_ptr,
    NUMEL,
    FP8_MAX: tl.constexpr,
    FP8_MAX_RECIPROCAL: tl.constexpr,
    BY_RECIPROCAL: tl.constexpr,
    EPS: tl.constexpr,
    INVERSE: tl.constexpr,
    AMAX: tl.constexpr,
    DONE: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """result[0], result[INVERSE] (fp32) <- fp8_max / max(amax, EPS) and its inverse,
    amax the largest |src[i]| for i < NUMEL, the inverse a product with
    FP8_MAX_RECIPROCAL where BY_RECIPROCAL, else a division by FP8_MAX. ``state_ptr``
    is an int32 buffer that is zero at the launch (the merged maximum's bits at AMAX,
    the programs done at DONE) and zero again after it."""
    start = tl.program_id(0).to(tl.int64) * (BLOCK * BLOCKS)
    lanes = tl.arange(0, BLOCK)
    largest = tl.full((BLOCK,), 0, dtype=tl.int32)
    for b in range(BLOCKS):
        offsets = start + b * BLOCK + lanes
        values = tl.load(src_ptr + offsets, mask=offsets < NUMEL, other=0.0)
        bits = tl.abs(values.to(tl.float32)).to(tl.int32, bitcast=True)
        largest = tl.maximum(largest, bits)
    tl.atomic_max(state_ptr + AMAX, tl.reduce(largest, 0, _larger))
    # acq_rel (the default): the last program sees every other program's maximum.
    done = tl.atomic_add(state_ptr + DONE, 1)
    if done == tl.num_programs(0) - 1:
        amax = tl.atomic_max(state_ptr + AMAX, 0).to(tl.float32, bitcast=True)
        # where(), not maximum(): a NaN amax stays NaN, as torch's clamp keeps it.
        clamped = tl.where(amax < EPS, EPS, amax)
        if BY_RECIPROCAL:
            inverse = clamped * FP8_MAX_RECIPROCAL
        else:
            inverse = tl.math.div_rn(clamped, FP8_MAX)
        tl.store(result_ptr, tl.math.div_rn(1.0, inverse))
        tl.store(result_ptr + INVERSE, inverse)
        # Every other program has counted itself done, so none touches the words again.
        tl.store(state_ptr + AMAX, 0)
        tl.store(state_ptr + DONE, 0)


def dense_flat(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s elements as one contiguous vector over the same memory (any dimension
    order), or None where its memory has gaps or repeats (a slice, an expanded
    gradient): those keep torch's norm."""
    if t.is_contiguous():
        return t.view(-1)
    order = sorted(range(t.dim()), key=lambda d: t.stride(d))
    expected = 1
    for d in order:
        if t.size(d) != 1 and t.stride(d) != expected:
            return None
        expected *= t.size(d)
    return t.as_strided((t.numel(),), (1,))


_launches = LaunchCache()
# The kept state buffers, by device and stream.
_states: dict[tuple[torch.device, int], torch.Tensor] = {}


def _state_for(device: torch.device) -> torch.Tensor:
    """The zeroed state words for a launch on ``device``'s current stream: the kept
    buffer (its kernel leaves it zeroed), or inside a CUDA graph capture a fresh one,
    whose zeroing the graph records."""
    if device.type != "cuda":
        stream = 0
    elif torch.cuda.is_current_stream_capturing():
        return torch.zeros(_STATE_WORDS, dtype=torch.int32, device=device)
    else:
        stream = torch.cuda.current_stream(device).cuda_stream
    key = (device, stream)
    state = _states.get(key)
    if state is None:
        state = _states[key] = torch.zeros(_STATE_WORDS, dtype=torch.int32, device=device)
    return state


def amax_scale(
    flat: torch.Tensor, fp8_max: float, eps: float, by_reciprocal: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8_max / max(amax, eps), its inverse) as [1] fp32 tensors on ``flat``'s
    device, amax the largest |value| of the 1-D contiguous ``flat`` (see
    ``dense_flat``); NaN where ``flat`` holds one. ``by_reciprocal``: whether the
    inverse is a product with fp8_max's fp32 reciprocal rather than a division, as
    torch divides on CUDA (None: as it divides on ``flat``'s device)."""
    if flat.dim() != 1 or flat.stride(0) != 1 or flat.numel() == 0:
        raise ValueError(
            f"flat of shape {tuple(flat.shape)}, strides {flat.stride()}: expected a "
            "non-empty contiguous vector"
        )
    if by_reciprocal is None:
        by_reciprocal = flat.device.type == "cuda"
    result = torch.empty(_WORDS, dtype=torch.float32, device=flat.device)
    state = _state_for(flat.device)
    key = (flat.numel(), flat.dtype, flat.device, fp8_max, eps, by_reciprocal)
    _launches.launch(key, lambda: _prepare(flat, fp8_max, eps, by_reciprocal), flat, state, result)
    scale, _, inverse, _ = result.split((1, _INVERSE - 1, 1, _WORDS - _INVERSE - 1))
    return scale, inverse


def fp32_reciprocal(value: float) -> float:
    """1 / value as fp32 computes it (an fp32 number), as ATen's CUDA division by a
    Python number takes it."""
    one = torch.ones((), dtype=torch.float32)
    return float(one / torch.tensor(value, dtype=torch.float32))


def _prepare(flat: torch.Tensor, fp8_max: float, eps: float, by_reciprocal: bool) -> PreparedLaunch:
    numel = flat.numel()
    grid = (triton.cdiv(numel, _BLOCK * _BLOCKS_PER_PROGRAM),)
    constants = {"FP8_MAX": fp8_max, "FP8_MAX_RECIPROCAL": fp32_reciprocal(fp8_max),
                 "BY_RECIPROCAL": by_reciprocal, "EPS": eps, "INVERSE": _INVERSE,
                 "AMAX": _AMAX, "DONE": _DONE, "BLOCK": _BLOCK,
                 "BLOCKS": _BLOCKS_PER_PROGRAM}  # fmt: skip
    return PreparedLaunch(
        _amax_scale_kernel, grid, (TensorSlot(0), TensorSlot(1), TensorSlot(2), numel),
        constants, {"num_warps": 4}, flat.device,
    )  # fmt: skip


__all__ = ["amax_scale", "dense_flat", "fp32_reciprocal"]
