"""The host path on CUDA: no host synchronisation in any solver or on the eager road,
CUDA-graph capture and replay of a converted model, torch.compile's CUDA graphs, no
find inside a capture, and prepared Triton launches against ordinary ones."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import gemmconv
from gemmconv.core.memory_format import Layout
from gemmconv.core.problem import DIRECTIONS, ConvProblem
from gemmconv.kernels.patch_permute import _launches as permute_launches
from gemmconv.kernels.patch_permute import gather_patches
from gemmconv.measuring.verify import reference
from gemmconv.selection import dispatch
from gemmconv.solvers import SOLVERS

from conftest import nan_in, random_in

pytestmark = pytest.mark.gpu

CUDA = "cuda"
PROBLEMS = [
    # (label, n, c, k, spatial, kernel, stride)
    ("patch", 4, 3, 64, (32, 32), (8, 8), (8, 8)),
    ("point", 64, 3, 128, (14, 14), (14, 14), (14, 14)),
    ("pointwise", 4, 32, 48, (8, 8), (1, 1), (1, 1)),
    ("strided", 4, 32, 48, (8, 8), (1, 1), (2, 2)),
    ("general", 2, 8, 16, (9, 9), (3, 3), (2, 2)),
]


def _tensors(problem: ConvProblem, seed: int) -> gemmconv.ConvTensors:
    gen = torch.Generator().manual_seed(seed)
    t = gemmconv.ConvTensors()
    layout, dtype = problem.layout, problem.dtype
    t.input = random_in(problem.input_shape, layout, dtype, CUDA, gen)
    t.weight = random_in(problem.weight_shape, layout, dtype, CUDA, gen)
    t.grad_output = random_in(problem.output_shape, layout, dtype, CUDA, gen)
    return t


def _cases():
    for label, n, c, k, spatial, kernel, stride in PROBLEMS:
        for layout in Layout:
            for direction in DIRECTIONS:
                problem = ConvProblem.from_sizes(
                    n, c, k, spatial, kernel, stride, layout=layout, dtype=torch.bfloat16,
                    device_type=CUDA, direction=direction,
                )  # fmt: skip
                for solver in SOLVERS:
                    if solver.is_applicable(problem):
                        yield pytest.param(problem, solver, id=f"{label}-{layout.value}-"
                                           f"{direction.value}-{solver.id}")  # fmt: skip


@pytest.mark.parametrize(("problem", "solver"), list(_cases()))
def test_no_solver_synchronises_the_host(problem, solver):
    tensors = _tensors(problem, seed=len(problem.key()))
    prepared = solver.prepare(problem, tensors)  # what eager calls run
    solver.run(problem, tensors)  # compile and allocate outside the check
    prepared(tensors)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        results = [solver.run(problem, tensors), prepared(tensors)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = reference(problem, tensors, device=CUDA)
    for result in results:
        torch.testing.assert_close(result.double(), ref, rtol=3e-2, atol=3e-2)


def test_eager_road_forward_and_backward_never_synchronise():
    gen = torch.Generator().manual_seed(3)
    x = random_in((8, 3, 64, 64), Layout.CHANNELS_FIRST, torch.bfloat16, CUDA, gen)
    w = random_in((96, 3, 16, 16), Layout.CHANNELS_FIRST, torch.bfloat16, CUDA, gen)
    b = random_in((96,), Layout.CHANNELS_FIRST, torch.bfloat16, CUDA, gen)
    x.requires_grad_()
    w.requires_grad_()
    gemmconv.conv2d(x, w, b, stride=16).sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            y = gemmconv.conv2d(x, w, b, stride=16)
            y.backward(torch.ones_like(y))
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _vit():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    return timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=64, num_classes=10
    ).to(CUDA)


def _step(model, x, target):
    with torch.autocast(CUDA, dtype=torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(model(x), target)
    loss.backward()
    return loss


@pytest.mark.parametrize("memory_format", [None, torch.channels_last], ids=["default", "cl"])
def test_converted_vit_forward_backward_replays_as_a_cuda_graph(memory_format):
    model = _vit()
    if memory_format is None:
        gemmconv.convert(model)
    else:
        convert = gemmconv.convert
        try:
            convert(model, memory_format=memory_format)
        except TypeError:
            pytest.fail("gemmconv.convert takes no memory_format argument")
    gen = torch.Generator().manual_seed(1)
    x = torch.rand(8, 3, 64, 64, generator=gen).to(CUDA)
    target = torch.randint(0, 10, (8,), generator=gen).to(CUDA)
    eager_model = copy.deepcopy(model)
    eager_loss = _step(eager_model, x, target)

    static_x, static_target = x.clone(), target.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm up: compile, decide, allocate
            model.zero_grad(set_to_none=False)
            _step(model, static_x, static_target)
    torch.cuda.current_stream().wait_stream(side)
    model.zero_grad(set_to_none=False)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = _step(model, static_x, static_target)
    model.zero_grad(set_to_none=False)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(static_loss, eager_loss, rtol=1e-2, atol=1e-2)
    for (name, p), q in zip(model.named_parameters(), eager_model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=5e-2, atol=5e-3, msg=name)


def test_reduce_overhead_compile_of_a_converted_model_matches_eager():
    model = _vit().eval()
    gemmconv.convert(model)
    gen = torch.Generator().manual_seed(2)
    x = torch.rand(8, 3, 64, 64, generator=gen).to(CUDA)
    compiled = torch.compile(model, mode="reduce-overhead")
    with torch.no_grad(), torch.autocast(CUDA, dtype=torch.bfloat16):
        want = model(x)
        for _ in range(3):
            got = compiled(x)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_no_find_inside_a_capture(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("GEMMCONV_DB", str(tmp_path / "find.sqlite"))
    from gemmconv.selection import finddb

    finddb.reset_db()
    gen = torch.Generator().manual_seed(4)
    x = random_in((4, 3, 32, 32), Layout.CHANNELS_FIRST, torch.bfloat16, CUDA, gen)
    w = random_in((64, 3, 8, 8), Layout.CHANNELS_FIRST, torch.bfloat16, CUDA, gen)
    graph = torch.cuda.CUDAGraph()
    with gemmconv.find_mode("hybrid"), caplog.at_level(logging.INFO, "gemmconv.dispatch"):
        # Warm-up outside the capture would decide by find; here the first decision is
        # made inside the capture itself.
        with torch.cuda.graph(graph):
            y = gemmconv.conv2d(x, w, stride=8)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(
        y.double(), torch.nn.functional.conv2d(x.double(), w.double(), stride=8),
        rtol=3e-2, atol=3e-2,
    )  # fmt: skip
    assert "no find" in caplog.text
    dispatch.clear_cache()


def test_prepared_launches_go_direct_and_agree_with_ordinary_ones():
    gen = torch.Generator().manual_seed(5)
    x = random_in((4, 3, 32, 32), Layout.CHANNELS_FIRST, torch.bfloat16, CUDA, gen)
    outs, kernel = (2, 2), (16, 16)
    col = nan_in((16, 768), Layout.CHANNELS_FIRST, torch.bfloat16, CUDA)[:, :, None, None]
    col = col.view(16, 768)
    permute_launches.clear()
    gather_patches(x, outs, kernel, False, out=col)
    first = col.clone()
    col.fill_(float("nan"))
    (launch,) = [v for v in permute_launches._launches.values() if v is not None]
    assert launch._direct is not None
    ordinary = launch._ordinary
    ordinary_calls = []

    def counted(tensors):
        ordinary_calls.append(tensors)
        return ordinary(tensors)

    launch._ordinary = counted
    gather_patches(x, outs, kernel, False, out=col)  # the direct launch
    assert ordinary_calls == [], "the second launch took the ordinary route"
    launch._ordinary = ordinary
    torch.testing.assert_close(col, first, rtol=0, atol=0)
    want = x.view(4, 3, 2, 16, 2, 16).permute(0, 2, 4, 1, 3, 5).reshape(16, 768)
    torch.testing.assert_close(col, want, rtol=0, atol=0)
    # A source one element off 16-byte alignment takes the ordinary route, still right.
    wide = random_in((4 * 3 * 32 * 32 + 1,), Layout.CHANNELS_FIRST, torch.bfloat16, CUDA, gen)
    shifted = wide[1:].view(4, 3, 32, 32)
    col.fill_(float("nan"))
    gather_patches(shifted, outs, kernel, False, out=col)
    want = shifted.view(4, 3, 2, 16, 2, 16).permute(0, 2, 4, 1, 3, 5).reshape(16, 768)
    torch.testing.assert_close(col, want, rtol=0, atol=0)
