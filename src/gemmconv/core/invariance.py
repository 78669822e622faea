"""The batch-invariance switch: whether a sample's forward output must not depend on the
batch it is computed in (its size, the sample's position in it).

Serving stacks batch requests together; under this switch a request's convolution
gives the same bits whether it ran alone or among others. GEMM libraries choose their
kernels (tile shapes, split reductions, small-matrix paths) by the number of rows,
so a row's sum can be taken in another order in another batch; the solvers that
declare themselves batch-invariant (``Solver.invariance_reasons``) fix that order for
every batch size, and selection keeps to them while the switch is on
(gemmconv.selection.dispatch).

The switch comes from, first to last: ``batch_invariant(...)`` (a context manager),
``set_batch_invariant(...)``, ``$GEMMCONV_BATCH_INVARIANT``. Process-wide, like the find
mode and torch.backends flags: the autograd engine runs CUDA backward passes on its own
threads, which a per-thread setting would not reach.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

ENV = "GEMMCONV_BATCH_INVARIANT"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")

# (the innermost block's setting, the process's): None where unset. One tuple, replaced
# whole on every change, so that dispatch.selection_key reads it in one attribute load.
setting: tuple[bool | None, bool | None] = (None, None)


def _parse_env(raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(
        f"{ENV}={raw!r}: expected one of {', '.join(repr(v) for v in _TRUE + _FALSE[1:])}"
    )


def _check(enabled: object, name: str) -> bool:
    if not isinstance(enabled, bool):
        raise TypeError(f"{name}={enabled!r}: expected True or False")
    return enabled


def set_batch_invariant(enabled: bool | None) -> None:
    """Make every later convolution of this process batch-invariant (True) or not
    (False); None returns to ``$GEMMCONV_BATCH_INVARIANT`` (off where unset).
    TypeError for anything but a bool or None."""
    global setting
    value = None if enabled is None else _check(enabled, "enabled")
    setting = (setting[0], value)


@contextlib.contextmanager
def batch_invariant(enabled: bool = True) -> Iterator[bool]:
    """Batch-invariant convolutions inside the block (``enabled=False``: the default
    selection there), process-wide as ``gemmconv.find_mode`` is; the setting before the
    block comes back when it ends, by an exception too:
    ``with gemmconv.batch_invariant(): y = model(x)``."""
    global setting
    value = _check(enabled, "enabled")
    saved = setting
    setting = (value, saved[1])
    try:
        yield value
    finally:
        setting = (saved[0], setting[1])


def batch_invariant_enabled() -> bool:
    """Whether convolutions run batch-invariant now. ValueError for a
    ``$GEMMCONV_BATCH_INVARIANT`` that is not a yes or a no."""
    block, process = setting
    if block is not None:
        return block
    if process is not None:
        return process
    return _parse_env(os.environ.get(ENV, ""))


__all__ = ["ENV", "batch_invariant", "batch_invariant_enabled", "set_batch_invariant"]
