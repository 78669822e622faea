"""Copies between strided views in the widest integer words their innermost runs allow.

torch's CPU copy through a permuted view steps one element at a time along its
innermost dimension: a channels-first 2x2 patch gather (runs of two fp32) moved a
4 MB input in 2.3 ms on the 2-core EPYC, the same copy as int64 words in 0.33
(bench/NOTES.md). Where both sides' innermost runs are contiguous and every other
stride and the offsets keep a wider word aligned, the copy runs on integer views of
that width: the same bits, fewer and wider elements.

On the CPU only: the GPU solvers' costs are fitted to torch's CUDA copy as it is, and
not while torch.compile traces (inductor fuses the copy itself).
"""

from __future__ import annotations

import torch

# Word widths tried, widest first, and the integer dtype that views each.
WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16))


def word_dtype(dst: torch.Tensor, src: torch.Tensor) -> torch.dtype | None:
    """The integer dtype ``src`` can be copied into ``dst`` in (wider than their
    elements), or None where the plain copy must run."""
    if (
        dst.device.type != "cpu"
        or src.device != dst.device
        or src.dtype != dst.dtype
        or src.shape != dst.shape
        or dst.dim() == 0
        or dst.numel() == 0
        or torch.compiler.is_compiling()
        or (torch.is_grad_enabled() and (src.requires_grad or dst.requires_grad))
        or dst.dtype.is_complex
    ):
        return None
    element = dst.element_size()
    for width, dtype in WORDS:
        if width > element and all(_aligned(t, width // element) for t in (dst, src)):
            return dtype
    return None


def _aligned(t: torch.Tensor, ratio: int) -> bool:
    """Whether ``t.view(word)`` with ``ratio`` elements a word is possible: torch's own
    rule (a contiguous innermost run of whole words, every other stride and the offset
    whole words)."""
    if t.stride(-1) != 1 or t.shape[-1] % ratio:
        return False
    if t.storage_offset() % ratio:
        return False
    return all(s % ratio == 0 for s in t.stride()[:-1])


def copy_in_words(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)`` for same-dtype, same-shape tensors, in wider words where both
    allow; returns ``dst``."""
    dtype = word_dtype(dst, src)
    if dtype is None:
        return dst.copy_(src)
    dst.view(dtype).copy_(src.view(dtype))
    return dst


def contiguous_in_words(src: torch.Tensor) -> torch.Tensor:
    """``src.contiguous()``, copied in wider words where ``src`` allows."""
    if src.device.type != "cpu" or torch.compiler.is_compiling() or src.is_contiguous():
        return src.contiguous()  # no copy, or no words: allocate nothing to find that out
    return copy_in_words(torch.empty(src.shape, dtype=src.dtype, device=src.device), src)


__all__ = ["contiguous_in_words", "copy_in_words", "word_dtype"]
