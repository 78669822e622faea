"""Whether a torch.func transform or a forward-mode AD level is active.

The custom ops' autograd formulas are reverse-mode only and cannot run under torch.func
(grad, vjp, jacrev, jvp, jacfwd, vmap) or carry forward-mode tangents, so while either
is active a convolution takes gemmconv.roads.func_transforms instead. This runs on every
eager call: two reads of torch's own state, well under a microsecond.
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as forward_ad


def transforms_active() -> bool:
    """True inside torch.func.grad/vjp/jacrev/jvp/jacfwd/vmap/hessian and inside a
    ``torch.autograd.forward_ad.dual_level()``.

    A dual level is entered for forward AD alone, so its depth is the cheapest sign
    that tangents may be about (torch keeps it in ``forward_ad._current_level``, -1
    outside every level)."""
    return torch._C._are_functorch_transforms_active() or forward_ad._current_level >= 0
