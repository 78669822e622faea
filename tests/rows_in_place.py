"""Tests' switch for the rows path's in-place GEMMs on CUDA (solvers/patch/rows_path.py),
which otherwise run there only where the estimate and the size limits say so."""

from __future__ import annotations

import pytest

from gemmconv.solvers.patch import rows_path


def force_in_place_on_cuda(monkeypatch: pytest.MonkeyPatch, on: bool) -> None:
    """The in-place GEMMs in every half-precision direction and size on CUDA, or in none."""
    monkeypatch.setattr(rows_path, "in_place_is_cheaper", lambda p, rates: on)
    monkeypatch.setattr(rows_path, "IN_PLACE_MIN_ROWS", 0)
    monkeypatch.setattr(rows_path, "IN_PLACE_MIN_RUN_BYTES", 0)
