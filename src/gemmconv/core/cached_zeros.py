"""Zeros that cost a call no kernel: a stride-0 view of one zero kept per device, dtype and
stream.

A weight padded to aligned GEMM rows needs zero columns. torch's F.pad launches two
kernels for it (a fill of the whole result, then the copy), and so does a
``torch.cat`` against zeros made for the call (their fill, then the cat); a
``torch.cat`` against an expanded zero made once is one (measured on an H100,
bench/NOTES.md). The zero is kept per stream, so that no stream
reads it before the fill that wrote it has run on the stream that made it; a stream
capturing a CUDA graph makes none, since its fill would run only when the graph does.
Nothing ever writes to a kept zero: it is only read, through expanded views.
"""

from __future__ import annotations

import torch

_KEPT: dict[tuple, torch.Tensor] = {}
# Streams made per request would grow the table without end; past this many entries
# it starts again (a dropped zero is freed in its own stream's order, as any tensor).
_MAX_KEPT = 64


def zeros(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """Read-only zeros of ``shape`` with ``like``'s dtype and device: an expanded view
    of a kept zero where one can be kept, else a new one (a fake or meta tensor, a
    capture, a device that is neither the CPU nor CUDA)."""
    key = _key(like)
    zero = _KEPT.get(key) if key is not None else None
    if zero is None:
        # A factory rather than a method of ``like``: under a functorch transform a
        # method would return a wrapped tensor, which must not outlive the transform.
        with torch.inference_mode(False):
            zero = torch.zeros((), dtype=like.dtype, device=like.device)
        if key is not None and type(zero) is torch.Tensor and not _capturing(like.device):
            if len(_KEPT) >= _MAX_KEPT:
                _KEPT.clear()
            _KEPT[key] = zero
    return zero.expand(shape)


# The operand types whose zero may be kept: a subclass (a fake tensor, a tensor
# wrapper) may live on a device it does not occupy, or outlive nothing it can say.
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _key(like: torch.Tensor) -> tuple | None:
    if type(like) not in _PLAIN:
        return None
    device = like.device
    if device.type == "cpu":
        return (device, like.dtype)
    if device.type != "cuda":
        return None
    return (device, like.dtype, torch.cuda.current_stream(device).cuda_stream)


def _capturing(device: torch.device) -> bool:
    """Whether ``device``'s current stream is capturing a CUDA graph (asked only where
    a zero is made: one kept from before a capture is read inside it safely)."""
    if device.type != "cuda":
        return False
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


__all__ = ["zeros"]
