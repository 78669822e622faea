"""The general implicit forward's tiles: chosen from the dtype and the geometry alone
(batch invariance), wide for channels-first runs of 16-byte vectors, shallow for short
runs and short reductions, the table's otherwise and wherever a choice does not fit the
device's shared memory."""

from __future__ import annotations

import pytest
import torch

from gemmconv.kernels import patch_gemm, tiles
from gemmconv.kernels.patch_gemm import (
    FORWARD_TILES,
    SHALLOW_TILES,
    WHOLE_ROW_FORWARD_TILES,
    WIDE_RUN_TILES,
    forward_tiles,
)
from gemmconv.kernels.patch_permute import PatchGeometry

CPU = torch.device("cpu")


def _geometry(n, c, spatial, kernel, channels_last):
    x = torch.empty(n, c, *spatial)
    if channels_last:
        x = x.to(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
    outs = tuple(s // r for s, r in zip(spatial, kernel))
    return PatchGeometry.of(x, outs, kernel, channels_last)


# (name, C, spatial, kernel, channels-last columns, the tiles expected in bf16)
ROWS = [
    ("vit_b16 cf", 3, (224, 224), (16, 16), False, WIDE_RUN_TILES),
    ("videomae cf", 3, (4, 32, 32), (2, 16, 16), False, WIDE_RUN_TILES),
    ("vit_b16 cl", 3, (224, 224), (16, 16), True, FORWARD_TILES[torch.bfloat16]),
    ("clip_l14 cf", 3, (336, 336), (14, 14), False, FORWARD_TILES[torch.bfloat16]),
    ("clip_l14 cl", 3, (336, 336), (14, 14), True, FORWARD_TILES[torch.bfloat16]),
    ("dit_xl2 cf", 4, (32, 32), (2, 2), False, SHALLOW_TILES),
    ("dit_xl2 cl", 4, (32, 32), (2, 2), True, SHALLOW_TILES),
    ("sd3 cl", 16, (16, 16), (2, 2), True, SHALLOW_TILES),
    ("convnext cf", 192, (8, 8), (2, 2), False, SHALLOW_TILES),
    ("convnext cl", 192, (8, 8), (2, 2), True, FORWARD_TILES[torch.bfloat16]),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("name", "c", "spatial", "kernel", "last", "expected"), ROWS,
                         ids=[r[0] for r in ROWS])  # fmt: skip
def test_half_precision_tiles_follow_the_geometry(name, c, spatial, kernel, last, expected, dtype):
    for n in (1, 7, 64):  # never the batch: a sample alone runs a batch's tiles
        assert forward_tiles(_geometry(n, c, spatial, kernel, last), dtype, 0, CPU) == expected


def test_fp32_and_whole_rows_keep_their_tables():
    g = _geometry(2, 3, (224, 224), (16, 16), False)
    assert forward_tiles(g, torch.float32, 0, CPU) == FORWARD_TILES[torch.float32]
    assert forward_tiles(g, torch.bfloat16, 8, CPU) == WHOLE_ROW_FORWARD_TILES[torch.bfloat16]


def test_tiles_that_do_not_fit_the_shared_memory_fall_back_to_the_table(monkeypatch):
    # 128x256x64 in 3 stages wants 144 KB: a card with about 100 KB gets the table's.
    cuda = torch.device("cuda", 0)
    g = _geometry(2, 3, (224, 224), (16, 16), False)
    monkeypatch.setattr(tiles, "shared_memory", lambda index: 101376)
    assert forward_tiles(g, torch.bfloat16, 0, cuda) == FORWARD_TILES[torch.bfloat16]
    monkeypatch.setattr(tiles, "shared_memory", lambda index: 232448)
    assert forward_tiles(g, torch.bfloat16, 0, cuda) == WIDE_RUN_TILES


def test_the_launch_takes_the_chosen_tiles():
    x = torch.empty(2, 4, 8, 8, dtype=torch.bfloat16)
    w = torch.empty(32, 16, dtype=torch.bfloat16)
    y = torch.empty(2, 32, 4, 4, dtype=torch.bfloat16)
    launch = patch_gemm.forward_launch(x, w, None, (2, 2), False, y, False, CPU)
    blocks = tuple(launch.constants[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
    assert blocks == (SHALLOW_TILES.block_m, SHALLOW_TILES.block_n, SHALLOW_TILES.block_k)
    assert launch.options == SHALLOW_TILES.launch_options()
