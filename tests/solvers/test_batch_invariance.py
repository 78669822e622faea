"""gemmconv.batch_invariant(): a sample's forward output is the same bits whatever the
batch it runs in, for every GEMM-reducible problem class, dtype and layout.

Each case computes a full batch once, then batches of 1, 7 and 64 samples drawn from it
at other positions (its head, its tail, a shuffled pick, a sample alone in fresh
memory) and compares every sample of them with torch.equal against the full batch's.
The CPU solvers run here; the CUDA forms (the chunked GEMM by CUDA's policy, and the
implicit patch GEMM where cuBLAS is refused) run here on CPU tensors (Triton's
interpreter for the kernels) in fp32 and fp16, and compiled in
tests/solvers/test_gpu_batch_invariance.py.
"""

from __future__ import annotations

import math

import pytest
import torch

import gemmconv
from gemmconv.core.memory_format import Layout
from gemmconv.core.problem import ConvProblem
from gemmconv.selection import dispatch
from gemmconv.solvers import SOLVERS, ConvTensors, get_solver, invariant
from gemmconv.solvers.invariant import invariant_rows_gemm, rows_chunk

FULL = 96
BATCHES = (1, 7, 64)

# (label, C, K, spatial, kernel, stride, the solver gemmconv picks on the CPU)
CASES = [
    ("patch1d", 3, 5, (12,), (4,), (4,)),
    ("patch2d", 4, 6, (8, 9), (2, 3), (2, 3)),
    ("patch3d", 3, 5, (4, 6, 4), (2, 3, 2), (2, 3, 2)),
    ("sd3_patchify", 16, 24, (8, 8), (2, 2), (2, 2)),
    ("point_output", 3, 6, (7, 7), (7, 7), (7, 7)),
    ("point_output_cropped", 3, 6, (9, 8), (7, 7), (7, 7)),
    ("pointwise", 8, 6, (5, 5), (1, 1), (1, 1)),
    ("strided_pointwise", 8, 6, (9, 9), (1, 1), (2, 2)),
    ("strided_pointwise3d", 4, 6, (5, 7, 6), (1, 1, 1), (2, 3, 2)),
]
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LAYOUTS = (Layout.CHANNELS_FIRST, Layout.CHANNELS_LAST)


def _conv(dims: int):
    return {1: gemmconv.conv1d, 2: gemmconv.conv2d, 3: gemmconv.conv3d}[dims]


def _in_layout(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    if layout is Layout.CHANNELS_FIRST:
        return t.contiguous()
    return t.movedim(1, -1).contiguous().movedim(-1, 1)


def _operands(c, k, spatial, kernel, dtype, layout, full=FULL):
    g = torch.Generator().manual_seed(hash((c, k, spatial, kernel)) % 2**31)
    x = _in_layout(torch.randn(full, c, *spatial, generator=g).to(dtype), layout)
    w = _in_layout(torch.randn(k, c, *kernel, generator=g).to(dtype), layout)
    b = torch.randn(k, generator=g).to(dtype)
    return x, w, b


def _picks(batch: int, full: int = FULL) -> list[torch.Tensor]:
    """Index sets of ``batch`` samples at other positions than in the full batch."""
    g = torch.Generator().manual_seed(batch)
    picks = [torch.arange(full - batch, full), torch.randperm(full, generator=g)[:batch]]
    if batch > 1:
        picks.append(torch.arange(batch).flip(0))
    return picks


def assert_batch_invariant(run, x: torch.Tensor, layout: Layout) -> None:
    """Every sample of every smaller batch equals its own row of the full batch."""
    full = run(x)
    for batch in BATCHES:
        for pick in _picks(batch, x.shape[0]):
            part = run(_in_layout(x[pick], layout))
            for j, i in enumerate(pick.tolist()):
                assert torch.equal(part[j], full[i]), (batch, j, i)
    alone = run(_in_layout(x[5:6].clone(), layout))  # fresh memory, another alignment
    assert torch.equal(alone[0], full[5])
    sliced = run(x[33:34])  # a view into the full batch's memory
    assert torch.equal(sliced[0], full[33])


def check_invariant_forward(x, w, b, stride, layout: Layout, tolerance: float) -> None:
    """Under batch_invariant(): an invariant solver is chosen, every sample is bitwise
    itself in any batch (assert_batch_invariant), and the result is torch's convolution
    in float64 within ``tolerance``, with torch's strides."""
    torch_conv = torch.nn.functional.__dict__[f"conv{x.dim() - 2}d"]
    conv = _conv(x.dim() - 2)
    with gemmconv.batch_invariant():
        forward = gemmconv.explain(x, w, b, stride=stride)["forward"]
        problem = ConvProblem.from_tensors(x, w, b, stride)
        assert not get_solver(forward.solver).invariance_reasons(problem), forward
        assert "NOT batch-invariant" not in forward.reason
        assert_batch_invariant(lambda t: conv(t, w, b, stride=stride), x, layout)
        y = conv(x, w, b, stride=stride)
    reference = torch_conv(x.double(), w.double(), b.double(), stride=stride)
    torch.testing.assert_close(y.double(), reference, atol=tolerance, rtol=tolerance)
    assert y.stride() == torch_conv(x, w, b, stride=stride).stride()


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: v.value)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_public_call_is_batch_invariant(case, dtype, layout):
    label, c, k, spatial, kernel, stride = case
    x, w, b = _operands(c, k, spatial, kernel, dtype, layout)
    # The invariant form computes the convolution: torch's within the dtype's rounding.
    tolerance = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}[dtype]
    check_invariant_forward(x, w, b, stride, layout, tolerance)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_invariant_with_gradients_and_modules(case):
    """The eager road's autograd node and the nn modules keep the invariant forward (a
    call needing gradients must not move to torch's convolution), and their gradients
    stay right."""
    label, c, k, spatial, kernel, stride = case
    dims = len(spatial)
    x, w, b = _operands(c, k, spatial, kernel, torch.float32, Layout.CHANNELS_FIRST)
    module = {1: gemmconv.nn.Conv1d, 2: gemmconv.nn.Conv2d, 3: gemmconv.nn.Conv3d}[dims](
        c, k, kernel, stride=stride
    )
    with torch.no_grad():
        module.weight.copy_(w)
        module.bias.copy_(b)
    with gemmconv.batch_invariant():
        assert_batch_invariant(module, x, Layout.CHANNELS_FIRST)
        xg = x[:7].clone().requires_grad_(True)
        y = module(xg)
        assert torch.equal(y.detach(), module(x[:7]).detach())
        y.sum().backward()
    reference = x[:7].clone().requires_grad_(True)
    torch.nn.functional.__dict__[f"conv{dims}d"](reference, w, b, stride=stride).sum().backward()
    torch.testing.assert_close(xg.grad, reference.grad, atol=1e-4, rtol=1e-4)


@pytest.fixture
def products(monkeypatch):
    """The shapes of the products the CPU's invariant GEMMs run, as they run."""
    shapes = []
    product = invariant._product

    def recording(a, b, bias, out):
        shapes.append(tuple(out.shape))
        return product(a, b, bias, out)

    monkeypatch.setattr(invariant, "_product", recording)
    return shapes


@pytest.fixture
def per_sample_products(monkeypatch, products):
    """Every case of several pixels a sample takes the CPU's per-sample form
    (invariant.cpu_sample_products), however small its product; yields the shapes of
    the products the invariant GEMMs run."""
    monkeypatch.setattr(invariant, "SAMPLE_MACS", 1)
    dispatch.clear_cache()  # plans and prepared runs decided the form when made
    yield products
    dispatch.clear_cache()


MULTI_PIXEL_CASES = [case for case in CASES if not case[0].startswith("point_output")]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: v.value)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("case", MULTI_PIXEL_CASES, ids=lambda c: c[0])
def test_cpu_per_sample_form(case, dtype, layout, per_sample_products):
    """Where each sample is multiplied alone, every product is one sample's [K, P] (a
    channels-first y, written in place) or [P, K] (channels-last rows), and the public
    call stays batch-invariant and right."""
    label, c, k, spatial, kernel, stride = case
    x, w, b = _operands(c, k, spatial, kernel, dtype, layout)
    tolerance = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}[dtype]
    check_invariant_forward(x, w, b, stride, layout, tolerance)
    pixels = math.prod(ConvProblem.from_tensors(x, w, b, stride).output_spatial)
    assert per_sample_products
    assert set(per_sample_products) <= {(k, pixels), (pixels, k)}, label


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: v.value)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("float32", "bfloat16"))
def test_cpu_per_sample_form_at_its_threshold(dtype, layout, products):
    """A 1x1 whose sample's own product is SAMPLE_MACS (128 channels to 64 over 32x32
    pixels), as the library ships: each sample is multiplied alone, and the public call
    is batch-invariant and right."""
    c, k, spatial = 128, 64, (32, 32)
    assert math.prod(spatial) * c * k == invariant.SAMPLE_MACS
    x, w, b = _operands(c, k, spatial, (1, 1), dtype, layout, full=72)
    tolerance = {torch.float32: 1e-3, torch.bfloat16: 2e-1}[dtype]
    check_invariant_forward(x, w, b, 1, layout, tolerance)
    assert products and set(products) <= {(k, 1024), (1024, k)}


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: v.value)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_cpu_per_sample_solvers_agree_bitwise(dtype, layout, per_sample_products):
    """patch and pointwise both serve a 1x1, each through its own method and its
    prepared run: every sample meets one product of the same canonical operands, so a
    batch size whose selection picks another of them gives the same bits."""
    c, k, spatial = 8, 6, (5, 5)
    x, w, b = _operands(c, k, spatial, (1, 1), dtype, layout, full=12)
    results = {}
    for sid in ("pointwise", "patch"):
        solver = get_solver(sid)
        for n in (12, 3):
            q = ConvProblem.from_sizes(n, c, k, spatial, 1, 1, layout=layout, dtype=dtype,
                                       device_type="cpu", has_bias=True)  # fmt: skip
            t = ConvTensors(input=_in_layout(x[-n:].clone(), layout), weight=w, bias=b)
            with gemmconv.batch_invariant():
                assert solver.is_applicable(q) and not solver.invariance_reasons(q)
                assert invariant.cpu_sample_products(q)
                results[sid, n] = solver.run(q, t)
                results[sid, n, "prepared"] = solver.prepare(q, t)(t)
    reference = results["pointwise", 12]
    for key, y in results.items():
        assert torch.equal(y, reference[-y.shape[0] :]), key


def test_cpu_per_sample_operands_take_one_alignment():
    """A sample's operands are brought to one form wherever they lie: a view at an odd
    element (another address modulo the cache line), a strided y, a padded weight."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4 * 6 * 7 + 1, generator=g)[1:].view(4, 6, 7)  # one element off
    wm = torch.randn(5, 8, generator=g)[:, :6]  # rows of a wider matrix
    bias = torch.randn(5, generator=g)
    patches = x.permute(0, 2, 1).unsqueeze(2)  # [N, O=7, <patch>=(6, 1)] of a 1-D x
    expected = torch.addmm(bias.view(5, 1).double(), wm.double(), x[2].double())
    p = ConvProblem.from_sizes(4, 6, 5, (7,), 1, 1, device_type="cpu", has_bias=True)
    dense = invariant.store_invariant_samples(x.new_empty(4, 5, 7), patches, wm, bias, p)
    torch.testing.assert_close(dense[2].double(), expected, atol=1e-5, rtol=1e-5)
    strided = x.new_empty(4, 7, 5).transpose(1, 2)  # y's memory not its blocks
    assert torch.equal(invariant.store_invariant_samples(strided, patches, wm, bias, p), dense)
    aligned = x.clone()
    again = invariant.store_invariant_samples(
        x.new_empty(4, 5, 7), aligned.permute(0, 2, 1).unsqueeze(2), wm.contiguous(), bias, p
    )
    assert torch.equal(again, dense)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_invariant_rows_gemm_every_row_count(dtype):
    """The invariant GEMM gives each row the same bits for every row count, the
    counts BLAS takes other paths for (1 to 12 rows, tails) and past a chunk."""
    g = torch.Generator().manual_seed(0)
    kred, kout = 48, 20
    chunk = rows_chunk(kred, kout)
    total = chunk + 37
    a = torch.randn(total, kred, generator=g).to(dtype)
    wm = torch.randn(kout, kred, generator=g).to(dtype)
    bias = torch.randn(kout, generator=g).to(dtype)
    full = invariant_rows_gemm(a, wm, bias, a.new_empty(total, kout))
    for m in (*range(1, 14), 31, 64, chunk - 1, chunk, chunk + 1):
        for start in (0, 3, total - m):
            out = invariant_rows_gemm(a[start : start + m], wm, bias, a.new_empty(m, kout))
            assert torch.equal(out, full[start : start + m]), (m, start)
    strided = a.new_empty(kout, total).t()  # an out that is not dense rows
    assert torch.equal(invariant_rows_gemm(a, wm, bias, strided), full)
    torch.testing.assert_close(
        full.double(), torch.addmm(bias.double(), a.double(), wm.double().t()),
        atol=1e-1 if dtype != torch.float32 else 1e-4, rtol=1e-2,
    )  # fmt: skip


def test_rows_chunk_depends_on_widths_only():
    assert rows_chunk(768, 768) == 256
    assert rows_chunk(16, 64) > rows_chunk(768, 768)
    assert rows_chunk(1, 1) == 1 << 14


def test_declared_solvers_form():
    """Which solvers declare an invariant forward, per device: the column GEMMs and
    pointwise solvers on both, the implicit Triton GEMM on CUDA (never the padded
    solver, the vendor or im2col)."""
    declared = {s.id: s.batch_invariant_devices for s in SOLVERS}
    assert declared == {
        "point_output": {"cpu", "cuda"},
        "pointwise": {"cpu", "cuda"},
        "strided_pointwise": {"cpu", "cuda"},
        "patch": {"cpu", "cuda"},
        "patch_padded": frozenset(),
        "patch_triton": {"cuda"},
        "patch_implicit": {"cuda"},
        "im2col": frozenset(),
        "vendor": frozenset(),
    }
    for solver in SOLVERS:
        if "cuda" not in solver.batch_invariant_devices:
            p = ConvProblem.from_sizes(2, 3, 4, (4, 4), 2, 2, device_type="cuda")
            assert solver.invariance_reasons(p), solver.id


# ---- the CUDA forms, in Triton's interpreter ------------------------------------


def _row_by_row_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    """The interpreter's tl.dot, each row of the tile its own vector-matrix product: the
    interpreter's own np.matmul of the whole tile is a CPU BLAS call that sums a row by
    its place in the tile, which no GPU's matrix instructions do; with this one the test
    proves what the kernel decides, that every row meets the same operands in the same
    reduction steps whatever the batch."""
    import numpy as np
    from triton.runtime.interpreter import TensorHandle

    a_data, b_data = a.data, b.data
    rows = [np.matmul(a_data[i], b_data, dtype=d.data.dtype) for i in range(a_data.shape[0])]
    return TensorHandle(np.stack(rows) + d.data, d.dtype.scalar)


@pytest.fixture
def row_by_row_dot(monkeypatch):
    from triton.runtime.interpreter import InterpreterBuilder

    monkeypatch.setattr(InterpreterBuilder, "create_dot", _row_by_row_dot)


INTERPRETED_CASES = [
    ("patch2d", 4, 6, (8, 9), (2, 3), (2, 3)),
    ("point_output", 3, 6, (4, 4), (4, 4), (4, 4)),
    ("pointwise", 8, 6, (3, 3), (1, 1), (1, 1)),
    ("strided_pointwise", 8, 6, (5, 5), (1, 1), (2, 2)),
]


# The family CUDA's invariant forward runs per case: the chunked cuBLAS GEMM, or, where
# torch.use_deterministic_algorithms refuses cuBLAS (no CUBLAS_WORKSPACE_CONFIG), the
# implicit Triton GEMM.
CHUNKED_FAMILIES = {
    "patch2d": {"patch", "point_output", "patch_triton"},
    "point_output": {"patch", "point_output", "patch_triton"},
    "pointwise": {"pointwise"},
    "strided_pointwise": {"strided_pointwise"},
}


def cuda_family(label: str, dtype: torch.dtype, layout: Layout, refused: bool) -> set[str]:
    """The solvers CUDA's selection may pick under the switch (solvers.base
    chunked_form_reasons): the chunked cuBLAS family for fp32 and the channels-first or
    strided 1x1, the implicit Triton GEMM for the rest and wherever cuBLAS is refused
    (which has no form of a strided 1x1)."""
    chunked = not refused and (
        dtype == torch.float32
        or label == "strided_pointwise"
        or (label == "pointwise" and layout is Layout.CHANNELS_FIRST)
    )
    if chunked:
        return CHUNKED_FAMILIES[label]
    return set() if label == "strided_pointwise" else {"patch_implicit"}


@pytest.fixture(params=("cublas", "refused"))
def cublas(request, monkeypatch):
    """Whether cuBLAS may run: "refused" turns torch.use_deterministic_algorithms on
    with no CUBLAS_WORKSPACE_CONFIG, as a process could."""
    if request.param == "refused":
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    return request.param


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: v.value)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=("float32", "float16"))
@pytest.mark.parametrize("case", INTERPRETED_CASES, ids=lambda c: c[0])
def test_cuda_forms_in_the_interpreter(case, dtype, layout, cublas, row_by_row_dot, monkeypatch):
    """The solver CUDA picks under the switch, run on CPU tensors (CUDA's chunking
    policy on the CPU's GEMM; a Triton kernel interpreted): batch-invariant with its
    fixed shapes and tiles."""
    label, c, k, spatial, kernel, stride = case
    family = cuda_family(label, dtype, layout, cublas == "refused")
    full = 70
    x, w, b = _operands(c, k, spatial, kernel, dtype, layout, full=full)
    p = ConvProblem.from_tensors(x, w, b, stride)
    on_cuda = ConvProblem.from_sizes(
        p.n, p.c, p.k, p.spatial, p.kernel, p.stride, layout=p.layout, dtype=dtype,
        device_type="cuda", has_bias=True,
    )  # fmt: skip
    # Small chunks, so that these small batches take every branch of the policy: whole
    # chunks, the overlapping last one, and a padded one for the shorter batches.
    monkeypatch.setattr(invariant, "CUDA_CHUNK_MACS", 4 * c * k * math.prod(p.output_spatial))
    # The warn-once set is the process's: a test met first must not silence this one's.
    monkeypatch.setattr(dispatch, "_warned_variant", set())
    with gemmconv.batch_invariant():
        if not family:  # the strided 1x1 runs on cuBLAS only: not invariant, and says so
            with pytest.warns(UserWarning, match="cannot be made batch-invariant"):
                assert "NOT batch-invariant" in dispatch.estimate(on_cuda).reason
            return
        choice = dispatch.estimate(on_cuda)
        solver = get_solver(choice.solver)
        assert solver.id in family, choice
        assert "NOT batch-invariant" not in choice.reason

        def run(t: torch.Tensor) -> torch.Tensor:
            q = ConvProblem.from_sizes(
                t.shape[0], c, k, spatial, kernel, stride, layout=p.layout, dtype=dtype,
                device_type="cuda", has_bias=True,
            )  # fmt: skip
            return solver.run(q, ConvTensors(input=t, weight=w, bias=b))

        assert_batch_invariant(run, x, layout)
        y = run(x)
    reference = torch.nn.functional.__dict__[f"conv{len(spatial)}d"](
        x.double(), w.double(), b.double(), stride=stride
    )
    torch.testing.assert_close(y.double(), reference, atol=2e-2, rtol=2e-2)


# ---- CUDA's chunking policy, on CPU tensors -----------------------------------------


def _signature(t: torch.Tensor) -> tuple:
    """What a GEMM library may choose its kernel by: sizes, strides, dtype, alignment."""
    return tuple(t.shape), t.stride(), t.dtype, t.data_ptr() % invariant.ALIGN_BYTES


@pytest.fixture
def recorded_products(monkeypatch):
    """The operands of every product the invariant GEMMs issue, as signatures."""
    seen: list[tuple] = []
    product, bmm = invariant._product, torch.bmm

    def recording_product(a, b, bias, out):
        seen.append((_signature(a), _signature(b), _signature(out), bias is None))
        return product(a, b, bias, out)

    def recording_bmm(a, b, *, out):
        seen.append((_signature(a), _signature(b), _signature(out)))
        return bmm(a, b, out=out)

    monkeypatch.setattr(invariant, "_product", recording_product)
    monkeypatch.setattr(invariant.torch, "bmm", recording_bmm)
    return seen


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("widths", [(64, 32), (20, 6), (588, 48)], ids=lambda w: f"{w[0]}x{w[1]}")
def test_cuda_rows_gemm_one_product_shape(dtype, widths, recorded_products, monkeypatch):
    """By CUDA's policy every product has one shape, strides, dtype and pointer
    alignment whatever the row count, the rows' offset in memory (a view at an odd
    element) or the out buffer; the tail overlaps the chunk before it. Each row is
    right, and (on this CPU's BLAS, whose kernels also go by shape) the same bits."""
    kred, kout = widths
    monkeypatch.setattr(invariant, "CUDA_CHUNK_MACS", 1)  # the smallest chunk: 256 rows
    kp = invariant.aligned_width(kred, dtype)
    chunk = invariant.cuda_rows_chunk(kp, -(-kout // 16) * 16, dtype)
    assert chunk == invariant.CUDA_MIN_CHUNK_ROWS
    g = torch.Generator().manual_seed(1)
    total = 3 * chunk + 37
    store = torch.randn(total * kred + 1, generator=g).to(dtype)
    a = store[1:].view(total, kred)  # an odd element offset: not on a 16-byte boundary
    wm = torch.randn(kout, kred, generator=g).to(dtype)
    bias = torch.randn(kout, generator=g).to(dtype)
    full = invariant.cuda_rows_gemm(a, wm, bias, a.new_empty(total, kout))
    for m in (1, 7, chunk - 1, chunk, chunk + 1, 2 * chunk + 5):
        for start in (0, 3, total - m):
            out = invariant.cuda_rows_gemm(a[start : start + m], wm, bias)
            assert torch.equal(out, full[start : start + m]), (m, start)
    strided = a.new_empty(kout, total).t()  # an out that is not dense rows
    assert torch.equal(invariant.cuda_rows_gemm(a, wm, bias, strided), full)
    assert torch.equal(invariant_rows_gemm(a, wm, bias, a.new_empty(total, kout), "cuda"), full)
    assert len(set(recorded_products)) == 1, set(recorded_products)
    (a_sig, _, out_sig, _), *_ = recorded_products
    assert a_sig[0] == (chunk, kp) and a_sig[3] == 0 and out_sig[3] == 0
    torch.testing.assert_close(
        full.double(), torch.addmm(bias.double(), a.double(), wm.double().t()),
        atol=2e-1 if dtype != torch.float32 else 1e-3, rtol=2e-2,
    )  # fmt: skip


def test_cuda_rows_gemm_reads_padded_columns_as_they_are(recorded_products):
    """Columns a padded solver already made (zeros to 16 bytes, patch_triton's) are the
    canonical rows: no copy, and the same product as for the unpadded columns."""
    g = torch.Generator().manual_seed(2)
    a = torch.randn(600, 588, generator=g).to(torch.bfloat16)
    wm = torch.randn(32, 588, generator=g).to(torch.bfloat16)
    padded_a = torch.cat([a, a.new_zeros(600, 4)], dim=1)
    padded_w = torch.cat([wm, wm.new_zeros(32, 4)], dim=1)
    assert torch.equal(
        invariant.cuda_rows_gemm(a, wm, None), invariant.cuda_rows_gemm(padded_a, padded_w, None)
    )
    assert len(set(recorded_products)) == 1
    assert recorded_products[-1][0][0][1] == 592


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("sizes", [(8, 16, 12), (3, 5, 7)], ids=lambda s: "x".join(map(str, s)))
def test_cuda_batched_gemm_one_product_shape(dtype, sizes, recorded_products, monkeypatch):
    """The per-sample form: every batched product holds the same number of samples in
    the same canonical strides and alignment, whatever the batch; each sample right."""
    c, k, pixels = sizes
    per_sample = c * k * pixels * max(1, dtype.itemsize // 2)
    monkeypatch.setattr(invariant, "CUDA_CHUNK_MACS", 4 * per_sample)
    chunk = invariant.cuda_samples_chunk(c, k, pixels, dtype)
    assert chunk == 4
    g = torch.Generator().manual_seed(3)
    total = 23
    store = torch.randn(total * c * pixels + 1, generator=g).to(dtype)
    x3 = store[1:].view(total, c, pixels)
    w = torch.randn(k, c, generator=g).to(dtype)
    bias = torch.randn(k, generator=g).to(dtype)
    full = invariant.cuda_batched_gemm(w, x3, bias, x3.new_empty(total, k, pixels))
    for n in (1, 3, 4, 5, 9, 22):
        for start in (0, 1, total - n):
            part = invariant.cuda_batched_gemm(w, x3[start : start + n], bias,
                                               x3.new_empty(n, k, pixels))  # fmt: skip
            assert torch.equal(part, full[start : start + n]), (n, start)
    assert len(set(recorded_products)) == 1, set(recorded_products)
    assert recorded_products[0][1][0] == (chunk, c, pixels)
    reference = torch.einsum("kc,ncp->nkp", w.double(), x3.double()) + bias.double()[:, None]
    tolerance = 1e-4 if dtype == torch.float32 else 1e-1
    torch.testing.assert_close(full.double(), reference, atol=tolerance, rtol=1e-2)


def test_cuda_chunks_depend_on_widths_and_dtype_only():
    rows = invariant.cuda_rows_chunk(768, 768, torch.bfloat16)
    assert rows & (rows - 1) == 0 and rows * 768 * 768 <= invariant.CUDA_CHUNK_MACS
    assert invariant.cuda_rows_chunk(768, 768, torch.float32) == rows // 2  # TF32's rate
    assert invariant.cuda_rows_chunk(16, 16, torch.bfloat16) == invariant.CUDA_MAX_CHUNK_ROWS
    assert invariant.cuda_rows_chunk(1 << 20, 1 << 20, torch.bfloat16) == (
        invariant.CUDA_MIN_CHUNK_ROWS
    )
    # No operand of a chunk's product past 32-bit indexing.
    wide = invariant.cuda_rows_chunk(1 << 16, 1, torch.bfloat16, macs=1 << 40)
    assert wide * (1 << 16) <= 2**31 - 1
    assert invariant.cuda_samples_chunk(256, 256, 3136, torch.bfloat16, macs=1 << 32) == 16
    assert invariant.cuda_samples_chunk(4096, 4096, 4096, torch.float32) == 1
    assert invariant.chunk_starts(10, 4) == [0, 4, 6]
    assert invariant.chunk_starts(8, 4) == [0, 4]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: v.value)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=("float32", "float64"))
def test_cuda_column_solvers_agree_bitwise(dtype, layout, monkeypatch):
    """Every column solver CUDA may pick for a patch problem multiplies the same
    canonical matrix in the same chunks, so a batch size whose selection picks another
    of them gives the same bits: point_output's view of x (588 columns, copied to 592),
    patch's and patch_triton's padded Triton gather alike."""
    monkeypatch.setattr(invariant, "CUDA_CHUNK_MACS", 1)
    c, k, spatial, kernel = 3, 20, (14, 14), (14, 14)
    x, w, b = _operands(c, k, spatial, kernel, dtype, layout, full=300)
    results = {}
    for sid in ("point_output", "patch", "patch_triton"):
        for n in (300, 7):
            q = ConvProblem.from_sizes(n, c, k, spatial, kernel, kernel, layout=layout,
                                       dtype=dtype, device_type="cuda", has_bias=True)  # fmt: skip
            solver = get_solver(sid)
            with gemmconv.batch_invariant():
                assert solver.is_applicable(q) and not solver.invariance_reasons(q)
                results[sid, n] = solver.run(q, ConvTensors(input=x[:n], weight=w, bias=b))
    for sid in ("patch", "patch_triton"):
        assert torch.equal(results[sid, 300], results["point_output", 300]), sid
    for sid in ("point_output", "patch", "patch_triton"):
        assert torch.equal(results[sid, 7], results["point_output", 300][:7]), sid
