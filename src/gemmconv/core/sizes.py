"""Size arithmetic shared by the solvers' layouts and chunkings."""

from __future__ import annotations


def round_up(value: int, multiple: int) -> int:
    """The least multiple of ``multiple`` at or above ``value`` (integers, multiple > 0;
    symbolic sizes under torch.compile too)."""
    return -(-value // multiple) * multiple


__all__ = ["round_up"]
