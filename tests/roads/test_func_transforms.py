"""torch.func transforms and forward-mode AD give torch's results through gemmconv.

grad, vjp, jacrev, jacfwd, jvp, hessian, vmap (of the forward, and of grad for
per-sample gradients) and torch.autograd.forward_ad dual tensors run on
gemmconv.conv1d/2d/3d and on converted modules, in both layouts, with and without a
bias. Each is compared, in float64 on the CPU, to the same transform of torch's
convolution on the same fresh random operands.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

import gemmconv
from gemmconv.core.memory_format import Layout
from gemmconv.measuring.verify import rms_range, tolerance
from gemmconv.roads.transform_state import transforms_active

from conftest import GemmconvOpLog, random_in

F64 = torch.float64
TIGHT = {"rtol": 1e-10, "atol": 1e-12}
TORCH_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
GEMMCONV_CONV = {1: gemmconv.conv1d, 2: gemmconv.conv2d, 3: gemmconv.conv3d}
TORCH_MODULE = {1: torch.nn.Conv1d, 2: torch.nn.Conv2d, 3: torch.nn.Conv3d}


@dataclasses.dataclass(frozen=True)
class Case:
    """A patch convolution (kernel 2, stride 2) of [2, 3, 4..] into 4 channels."""

    dims: int
    layout: Layout
    bias: bool

    def __str__(self) -> str:
        return f"{self.dims}d-{self.layout.value}-{'bias' if self.bias else 'nobias'}"

    def operands(self, seed: int, batch: int | None = None) -> tuple[torch.Tensor, ...]:
        """(input, weight[, bias]), each with a leading dimension of ``batch`` for vmap
        when given; every sample is dense in the case's layout."""
        gen = torch.Generator().manual_seed(seed)
        x = _random(batch, (2, 3, *(4,) * self.dims), self.layout, gen)
        w = _random(batch, (4, 3, *(2,) * self.dims), self.layout, gen)
        if not self.bias:
            return x, w
        return x, w, _random(batch, (4,), Layout.CHANNELS_FIRST, gen)

    def conv(self, of: str):
        """f(input, weight[, bias]) of gemmconv or of torch, stride 2."""
        conv = (GEMMCONV_CONV if of == "gemmconv" else TORCH_CONV)[self.dims]
        return lambda x, w, b=None: conv(x, w, b, stride=2)


def _random(batch: int | None, shape: tuple[int, ...], layout: Layout, gen) -> torch.Tensor:
    """Uniform(-1, 1) values of ``shape`` in ``layout``, ``batch`` of them stacked in
    front when given (each one dense in ``layout``)."""
    if batch is None:
        return random_in(shape, layout, F64, "cpu", gen)
    if len(shape) == 1:
        return random_in((batch, *shape), Layout.CHANNELS_FIRST, F64, "cpu", gen)
    flat = random_in((batch * shape[0], *shape[1:]), layout, F64, "cpu", gen)
    return flat.unflatten(0, (batch, shape[0]))


CASES = [Case(d, layout, bias) for d in (1, 2, 3) for layout in Layout for bias in (False, True)]


def _assert_matches(ours, theirs, what: str) -> None:
    for i, (a, b) in enumerate(zip(_leaves(ours), _leaves(theirs), strict=True)):
        assert b.abs().sum() > 0, f"{what}[{i}]: torch's result is zero, so the check is void"
        torch.testing.assert_close(a, b, **TIGHT, msg=lambda m, i=i: f"{what}[{i}]: {m}")


def _leaves(tree) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


# ---- forward mode -------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=str)
def test_jvp_matches_torch(case: Case):
    primals, tangents = case.operands(1), case.operands(2)
    ours = jvp(case.conv("gemmconv"), primals, tangents)
    theirs = jvp(case.conv("torch"), primals, tangents)
    _assert_matches(ours, theirs, "jvp (output, tangent)")


def _with_operands(case: Case, which: tuple[str, ...]) -> list:
    """(case, w) for each w in ``which`` that the case has operands for."""
    return [(case, w) for w in which if case.bias or "bias" not in w]


DUAL_CASES = [p for c in CASES for p in _with_operands(c, ("input", "weight", "bias", "all"))]


@pytest.mark.parametrize(("case", "dual"), DUAL_CASES, ids=lambda v: str(v))
def test_forward_ad_dual_tensors_match_torch(case: Case, dual: str):
    names = ("input", "weight", "bias")[: len(case.operands(1))]
    primals, tangents = case.operands(3), case.operands(4)

    def tangent_of(conv):
        with fwAD.dual_level():
            args = [
                fwAD.make_dual(p, t) if dual in (name, "all") else p
                for name, p, t in zip(names, primals, tangents)
            ]
            return fwAD.unpack_dual(conv(*args)).tangent

    ours = tangent_of(case.conv("gemmconv"))
    assert ours is not None, "the output carries no tangent"
    _assert_matches(ours, tangent_of(case.conv("torch")), f"tangent for dual {dual}")


@pytest.mark.parametrize("case", CASES, ids=str)
def test_jacfwd_and_jacrev_match_torch(case: Case):
    operands = case.operands(5)
    argnums = tuple(range(len(operands)))
    for transform in (jacfwd, jacrev):
        ours = transform(case.conv("gemmconv"), argnums=argnums)(*operands)
        theirs = transform(case.conv("torch"), argnums=argnums)(*operands)
        _assert_matches(ours, theirs, transform.__name__)


# ---- reverse mode -------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=str)
def test_grad_and_vjp_match_torch(case: Case):
    operands = case.operands(6)
    probe = torch.randn(case.conv("torch")(*operands).shape, dtype=F64)
    argnums = tuple(range(len(operands)))

    def loss(conv):
        return lambda *args: (conv(*args) * probe).sum()

    ours = grad(loss(case.conv("gemmconv")), argnums=argnums)(*operands)
    theirs = grad(loss(case.conv("torch")), argnums=argnums)(*operands)
    _assert_matches(ours, theirs, "grad")

    _, vjp_ours = vjp(case.conv("gemmconv"), *operands)
    _, vjp_theirs = vjp(case.conv("torch"), *operands)
    _assert_matches(vjp_ours(probe), vjp_theirs(probe), "vjp")


@pytest.mark.parametrize("layout", Layout, ids=lambda layout: layout.value)
@pytest.mark.parametrize("dims", (1, 2, 3))
def test_hessian_matches_torch(dims: int, layout: Layout):
    """jacfwd(jacrev(.)): forward mode through the backward directions."""
    case = Case(dims, layout, bias=True)
    x, w, b = case.operands(7)

    def loss(conv):
        return lambda w: (conv(x, w, b) ** 2).sum()

    ours = hessian(loss(case.conv("gemmconv")))(w)
    _assert_matches(ours, hessian(loss(case.conv("torch")))(w), "hessian over the weight")


# ---- vmap ---------------------------------------------------------------------------

BATCHED = ("input", "weight", "bias", "input+weight", "input+weight+bias")
VMAP_CASES = [p for c in CASES for p in _with_operands(c, BATCHED)]


@pytest.mark.parametrize(("case", "batched"), VMAP_CASES, ids=lambda v: str(v))
def test_vmap_of_the_forward_matches_torch(case: Case, batched: str):
    names = ("input", "weight", "bias")[: len(case.operands(1))]
    stacked, single = case.operands(8, batch=3), case.operands(9)
    in_dims = tuple(0 if name in batched else None for name in names)
    operands = [s if d == 0 else o for s, o, d in zip(stacked, single, in_dims)]
    ours = vmap(case.conv("gemmconv"), in_dims=in_dims)(*operands)
    _assert_matches(ours, vmap(case.conv("torch"), in_dims=in_dims)(*operands), "vmap")


@pytest.mark.parametrize("groups", (1, 2))
@pytest.mark.parametrize("batched", ("input", "weight", "input+weight"))
def test_vmap_with_groups_and_a_moved_batch_dimension(batched: str, groups: int):
    """A batch folded into the channels must keep each group's channels together, and
    a vmapped dimension need not be the first."""
    gen = torch.Generator().manual_seed(10)
    x = torch.rand(2, 4, 5, 3, dtype=F64, generator=gen) - 0.5  # batch of 3 last
    w = torch.rand(6, 4 // groups, 2, 3, dtype=F64, generator=gen) - 0.5  # batch of 3 last
    b = torch.rand(6, dtype=F64, generator=gen) - 0.5
    in_dims = (3 if "input" in batched else None, 3 if "weight" in batched else None, None)
    x = x if in_dims[0] is not None else x[..., 0]
    w = w if in_dims[1] is not None else w[..., 0]

    def conv(f):
        return vmap(lambda x, w, b: f(x, w, b, groups=groups), in_dims=in_dims)(x, w, b)

    _assert_matches(conv(gemmconv.conv1d), conv(F.conv1d), "vmap with groups")


@pytest.mark.parametrize("groups", (1, 2))
def test_hessian_and_per_sample_gradients_with_groups(groups: int):
    """The full hessian over (input, weight) batches every vmap rule of every direction
    over one operand at a time (jacfwd of jvps of the backward directions); per-sample
    gradients batch both operands of the backward directions."""
    gen = torch.Generator().manual_seed(16)
    x = torch.rand(2, 4, 6, dtype=F64, generator=gen) - 0.5
    w = torch.rand(6, 4 // groups, 2, dtype=F64, generator=gen) - 0.5
    probe = torch.rand(2, 6, 3, dtype=F64, generator=gen) - 0.5

    def loss(conv):
        return lambda x, w: ((conv(x, w, stride=2, groups=groups) ** 2) * probe).sum()

    def both(conv):
        full = jacfwd(jacrev(loss(conv), argnums=(0, 1)), argnums=(0, 1))(x, w)
        per_sample = vmap(
            grad(lambda x, w: loss(conv)(x.unsqueeze(0), w), argnums=(0, 1)), in_dims=(0, None)
        )(x, w)
        return full, per_sample

    _assert_matches(both(gemmconv.conv1d), both(F.conv1d), "hessian, per-sample gradients")


def test_vmap_over_both_operands_is_one_grouped_call_logged_at_debug(caplog):
    case = Case(2, Layout.CHANNELS_FIRST, bias=True)
    x, w, b = case.operands(11, batch=3)
    with caplog.at_level(logging.DEBUG, logger="gemmconv.dispatch"), GemmconvOpLog() as ops:
        ours = vmap(case.conv("gemmconv"))(x, w, b)
    assert ops.calls == ["conv_forward"]
    assert any("grouped convolution (groups=3)" in r.getMessage() for r in caplog.records)
    _assert_matches(ours, vmap(case.conv("torch"))(x, w, b), "vmap over both")


def test_vmap_over_one_operand_is_one_gemm_problem(caplog):
    case = Case(2, Layout.CHANNELS_LAST, bias=True)
    stacked, single = case.operands(12, batch=3), case.operands(13)
    for in_dims in ((0, None, None), (None, 0, 0)):
        operands = [s if d == 0 else o for s, o, d in zip(stacked, single, in_dims)]
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="gemmconv.dispatch"), GemmconvOpLog() as ops:
            vmap(case.conv("gemmconv"), in_dims=in_dims)(*operands)
        assert ops.calls == ["conv_forward"], in_dims
        assert not any("grouped" in r.getMessage() for r in caplog.records), in_dims


# ---- which ops compute what ---------------------------------------------------------


def test_tangents_and_gradients_are_computed_by_gemmconv_ops():
    case = Case(2, Layout.CHANNELS_FIRST, bias=True)
    primals, tangents = case.operands(14), case.operands(15)
    with GemmconvOpLog() as ops:
        jvp(case.conv("gemmconv"), primals, tangents)
    # the primal, then conv(tx, w) + tb and conv(x, tw)
    assert ops.calls == ["conv_forward"] * 3
    with GemmconvOpLog() as ops:
        grad(lambda *a: case.conv("gemmconv")(*a).sum(), argnums=(0, 1, 2))(*primals)
    assert sorted(ops.calls) == ["conv_backward_data", "conv_backward_weights", "conv_forward"]


def test_transforms_active_only_inside_a_transform_or_dual_level():
    seen = {}

    def probe(label):
        def f(t):
            seen[label] = transforms_active()
            return t

        return f

    t = torch.ones(2)
    probe("plain")(t)
    with torch.no_grad():
        probe("no_grad")(t)
    grad(lambda t: probe("grad")(t).sum())(t)
    vmap(probe("vmap"))(t)
    jvp(probe("jvp"), (t,), (t,))
    with fwAD.dual_level():
        probe("dual_level")(t)
    probe("after")(t)
    assert seen == {
        "plain": False,
        "no_grad": False,
        "grad": True,
        "vmap": True,
        "jvp": True,
        "dual_level": True,
        "after": False,
    }


# ---- converted modules --------------------------------------------------------------


def _model_pair(dims: int, bias: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(converted, torch) copies of a patch convolution, a tanh and a pointwise one."""
    conv = TORCH_MODULE[dims]
    torch.manual_seed(dims)
    reference = torch.nn.Sequential(
        conv(3, 8, kernel_size=2, stride=2, bias=bias),
        torch.nn.Tanh(),
        conv(8, 4, kernel_size=1, bias=bias),
    ).to(F64)
    converted = copy.deepcopy(reference)
    assert gemmconv.convert(converted).swapped_names == ["0", "2"]
    return converted, reference


MODULE_CASES = list(itertools.product((1, 2, 3), Layout, (False, True)))


def _module_id(case) -> str:
    dims, layout, bias = case
    return f"{dims}d-{layout.value}-{'bias' if bias else 'nobias'}"


@pytest.mark.parametrize("module_case", MODULE_CASES, ids=_module_id)
def test_per_sample_gradients_of_a_converted_model_match_torch(module_case):
    """vmap(grad(loss)) over samples through functional_call, as differential-privacy
    training computes per-sample gradients."""
    dims, layout, bias = module_case
    converted, reference = _model_pair(dims, bias)
    gen = torch.Generator().manual_seed(20)
    x = random_in((5, 3, *(4,) * dims), layout, F64, "cpu", gen)
    target = torch.rand(5, 4, *(2,) * dims, dtype=F64, generator=gen)
    params = {k: v.detach() for k, v in reference.named_parameters()}

    def per_sample(model):
        def loss(params, sample, target):
            y = functional_call(model, params, (sample.unsqueeze(0),))
            return ((y - target.unsqueeze(0)) ** 2).sum()

        return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, target)

    _assert_matches(per_sample(converted), per_sample(reference), "per-sample gradients")


@pytest.mark.parametrize("module_case", MODULE_CASES, ids=_module_id)
def test_jvp_jacrev_and_dual_tensors_through_a_converted_model_match_torch(module_case):
    dims, layout, bias = module_case
    converted, reference = _model_pair(dims, bias)
    gen = torch.Generator().manual_seed(21)
    x = random_in((2, 3, *(4,) * dims), layout, F64, "cpu", gen)
    tx = random_in((2, 3, *(4,) * dims), layout, F64, "cpu", gen)
    params = {k: v.detach() for k, v in reference.named_parameters()}
    tangents = {k: torch.rand(v.shape, dtype=F64, generator=gen) for k, v in params.items()}

    def by_params(model):
        return lambda params, x: functional_call(model, params, (x,))

    for name, run in {
        "jvp": lambda m: jvp(by_params(m), (params, x), (tangents, tx)),
        "jacrev": lambda m: jacrev(by_params(m))(params, x),
        "forward_ad": lambda m: _dual_forward(m, params, tangents, x, tx),
    }.items():
        _assert_matches(run(converted), run(reference), name)


def _dual_forward(model, params, tangents, x, tx) -> torch.Tensor:
    with fwAD.dual_level():
        duals = {k: fwAD.make_dual(v, tangents[k]) for k, v in params.items()}
        y = functional_call(model, duals, (fwAD.make_dual(x, tx),))
        return fwAD.unpack_dual(y).tangent


# ---- on the GPU ---------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("layout", Layout, ids=lambda layout: layout.value)
def test_transforms_on_cuda_match_float64(layout: Layout, dtype: torch.dtype):
    """On the GPU the GEMM solvers (Triton kernels among them) compute tangents and
    per-sample gradients; each result is judged against torch's float64 convolution
    of the same rounded operands on the CPU, by the dtype's tolerance."""
    gen = torch.Generator().manual_seed(30)

    rounded = [
        random_in((6, 3, 32, 32), layout, dtype, "cpu", gen),  # input
        random_in((64, 3, 4, 4), layout, dtype, "cpu", gen),  # weight
        random_in((64,), Layout.CHANNELS_FIRST, dtype, "cpu", gen),  # bias
        random_in((6, 3, 32, 32), layout, dtype, "cpu", gen),  # input tangent
        random_in((64, 3, 4, 4), layout, dtype, "cpu", gen),  # weight tangent
        random_in((6, 64, 8, 8), Layout.CHANNELS_FIRST, dtype, "cpu", gen),  # probe
    ]

    def results(conv, device, dtype):
        x, w, b, tx, tw, probe = (t.to(device=device, dtype=dtype) for t in rounded)

        def f(x, w, b):
            return conv(x, w, b, stride=4)

        def loss(params, sample, probe):
            return (f(sample.unsqueeze(0), *params) * probe.unsqueeze(0)).sum()

        with fwAD.dual_level():
            dual = fwAD.unpack_dual(f(fwAD.make_dual(x, tx), w, b)).tangent
        return {
            "jvp": jvp(f, (x, w, b), (tx, tw, torch.zeros_like(b)))[1],
            "forward_ad": dual,
            "per_sample": vmap(grad(loss), in_dims=(None, 0, 0))((w, b), x, probe),
        }

    ours = results(gemmconv.conv2d, "cuda", dtype)
    reference = results(F.conv2d, "cpu", F64)
    limit = tolerance(dtype, "cuda")
    for name in ours:
        for a, b in zip(_leaves(ours[name]), _leaves(reference[name]), strict=True):
            assert a.dtype == dtype and a.device.type == "cuda", name
            error = rms_range(a, b)
            assert error <= limit, f"{name}: rms_range {error:.3g} > {limit:.3g}"
