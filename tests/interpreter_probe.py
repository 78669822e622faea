"""Whether Triton's interpreter runs a kernel that loops to a runtime bound, as every
GEMM kernel of gemmconv does (``for k0 in range(0, KRED, BLOCK_K)``).

The interpreter hands a kernel's runtime scalars as one-element numpy arrays and makes
a Python int of one through ``int(array)`` (Triton 3.6); NumPy 2.4 and later refuse that
for an array of one dimension ("only 0-dimensional arrays can be converted to Python
scalars"), so no such kernel runs interpreted there. Triton 3.8 converts through
``squeeze()`` and runs them.
"""

from __future__ import annotations

import torch
import triton.language as tl


def _count_to(out_ptr, n):
    total = 0
    for _ in range(0, n, 1):
        total += 1
    tl.store(out_ptr, total)


def interpreter_refusal() -> str | None:
    """None where the interpreter runs a loop to a runtime bound; else the TypeError's
    message, naming the Triton and NumPy releases that refuse it. Any other failure
    propagates: it is not this one."""
    import numpy
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    out = torch.zeros(1, dtype=torch.int32)
    try:
        InterpretedFunction(_count_to)[(1,)](out, 3)
    except Exception as e:
        cause = e.__cause__ if e.__cause__ is not None else e
        if not isinstance(cause, TypeError):
            raise
        return (
            f"Triton {triton.__version__}'s interpreter cannot loop to a runtime bound with "
            f"NumPy {numpy.__version__} ({cause})"
        )
    if out.item() != 3:
        raise AssertionError(f"the interpreted loop counted to {out.item()}, expected 3")
    return None
