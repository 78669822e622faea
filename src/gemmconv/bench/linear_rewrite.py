"""The reshape + F.linear rewrite of a patch convolution, in each direction.

This is what serving frameworks write instead of the convolution: the patches of x
cut into rows [M, Kred] with reshape/permute (in (c, r..) order for a channels-first x,
(r.., c) for a channels-last one), then one F.linear; the backward directions are the
same matmuls. The benchmark suite and the public-call timing compare gemmconv with it
(gemmconv.bench.linear_patch_embed is the same rewrite as a module for whole models).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from gemmconv.core.memory_format import Layout
from gemmconv.core.problem import ConvProblem, Direction
from gemmconv.solvers.base import ConvTensors


def _split(p: ConvProblem) -> list[int]:
    return [v for o, r in zip(p.output_spatial, p.kernel) for v in (o, r)]


def rewrite_columns(x: torch.Tensor, p: ConvProblem) -> torch.Tensor:
    """Patches as rows [M, Kred], by reshape/permute as the frameworks write it: in
    (c, r..) order for a channels-first x, (r.., c) for a channels-last one."""
    d, n, c = p.dims, p.n, p.c
    crop = tuple(slice(0, o * r) for o, r in zip(p.output_spatial, p.kernel))
    outs = [1 + 2 * i for i in range(d)]
    taps = [2 + 2 * i for i in range(d)]
    if p.layout is Layout.CHANNELS_FIRST:
        v = x[(slice(None), slice(None), *crop)].reshape(n, c, *_split(p))
        order = [0, *(o + 1 for o in outs), 1, *(t + 1 for t in taps)]
    else:
        v = x.movedim(1, -1)[(slice(None), *crop)].reshape(n, *_split(p), c)
        order = [0, *outs, *taps, 2 * d + 1]
    return v.permute(order).reshape(p.gemm_m, p.gemm_k)


def rewrite_weight(w: torch.Tensor, p: ConvProblem) -> torch.Tensor:
    if p.layout is Layout.CHANNELS_FIRST:
        return w.reshape(p.k, -1)
    return w.movedim(1, -1).reshape(p.k, -1)


def rewrite_rows(t: torch.Tensor) -> torch.Tensor:
    """[N, K, O..] as tokens [M, K] (a view for channels-last memory, else a copy)."""
    return t.movedim(1, -1).reshape(-1, t.shape[1])


def rewrite_unpatch(dcol: torch.Tensor, p: ConvProblem) -> torch.Tensor:
    """The column gradient [M, Kred] folded back to dx [N, C, S..] in the layout's
    memory order, zeros where no patch reaches."""
    d, n, c = p.dims, p.n, p.c
    covered = [o * r for o, r in zip(p.output_spatial, p.kernel)]
    # Interleave each output index with its kernel tap: (o1, r1, o2, r2, ..).
    if p.layout is Layout.CHANNELS_FIRST:
        v = dcol.reshape(n, *p.output_spatial, c, *p.kernel)  # n, o.., c, r..
        order = [0, d + 1, *[j for i in range(d) for j in (1 + i, d + 2 + i)]]
        dx = v.permute(order).reshape(n, c, *covered)
    else:
        v = dcol.reshape(n, *p.output_spatial, *p.kernel, c)  # n, o.., r.., c
        order = [0, *[j for i in range(d) for j in (1 + i, d + 1 + i)], 2 * d + 1]
        dx = v.permute(order).reshape(n, *covered, c).movedim(-1, 1)
    if tuple(covered) == p.spatial:
        return dx
    pads = [v for s, e in reversed(list(zip(p.spatial, covered))) for v in (0, s - e)]
    return F.pad(dx, pads)


def rewrite_fn(p: ConvProblem, t: ConvTensors) -> Callable[[], torch.Tensor]:
    """The reshape + F.linear computation of the problem's direction."""
    if p.direction is Direction.FORWARD:

        def forward() -> torch.Tensor:
            y = F.linear(rewrite_columns(t.input, p), rewrite_weight(t.weight, p), t.bias)
            # Token-major result, as the frameworks consume it: [N, O.., K] memory.
            return y.view(p.n, *p.output_spatial, p.k).movedim(-1, 1)

        return forward
    if p.direction is Direction.BACKWARD_DATA:

        def backward_data() -> torch.Tensor:
            dcol = torch.mm(rewrite_rows(t.grad_output), rewrite_weight(t.weight, p))
            return rewrite_unpatch(dcol, p)

        return backward_data

    def backward_weights() -> torch.Tensor:
        dw = torch.mm(rewrite_rows(t.grad_output).t(), rewrite_columns(t.input, p))
        if p.layout is Layout.CHANNELS_FIRST:
            return dw.view(p.weight_shape)
        return dw.view(p.k, *p.kernel, p.c).movedim(-1, 1)

    return backward_weights


__all__ = ["rewrite_columns", "rewrite_fn", "rewrite_rows", "rewrite_unpatch", "rewrite_weight"]
