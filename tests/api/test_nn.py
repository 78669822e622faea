"""gemmconv.nn.Conv1d/2d/3d are torch's modules in everything but the computation:
same constructor, init, parameters, state_dict keys and repr; values and gradients
equal torch's within tolerance (padding modes included); solvers() is not state."""

from __future__ import annotations

import pytest
import torch

import gemmconv
from gemmconv.measuring.verify import rms_range, tolerance

PAIRS = {
    1: (gemmconv.nn.Conv1d, torch.nn.Conv1d),
    2: (gemmconv.nn.Conv2d, torch.nn.Conv2d),
    3: (gemmconv.nn.Conv3d, torch.nn.Conv3d),
}

# (dims, constructor kwargs, input spatial size)
CONFIGS = [
    (2, dict(in_channels=3, out_channels=8, kernel_size=4, stride=4), (8, 9)),
    (2, dict(in_channels=3, out_channels=8, kernel_size=4, stride=4, bias=False), (4, 4)),
    (2, dict(in_channels=6, out_channels=4, kernel_size=1), (5, 3)),
    (2, dict(in_channels=6, out_channels=4, kernel_size=1, stride=2), (5, 7)),
    (
        2,
        dict(in_channels=4, out_channels=6, kernel_size=3, padding=1, padding_mode="reflect"),
        (5, 5),
    ),
    (
        2,
        dict(in_channels=4, out_channels=6, kernel_size=3, padding="same", padding_mode="circular"),
        (5, 6),
    ),
    (2, dict(in_channels=4, out_channels=6, kernel_size=3, groups=2, dilation=2), (7, 7)),
    (1, dict(in_channels=3, out_channels=5, kernel_size=4, stride=4), (13,)),
    (
        1,
        dict(in_channels=3, out_channels=5, kernel_size=3, padding=2, padding_mode="replicate"),
        (6,),
    ),
    (3, dict(in_channels=3, out_channels=4, kernel_size=(2, 3, 3), stride=(2, 3, 3)), (4, 6, 7)),
    (3, dict(in_channels=3, out_channels=4, kernel_size=1), (2, 3, 3)),
]
IDS = [f"{d}d-{i}" for i, (d, _, _) in enumerate(CONFIGS)]


def _pair(dims, kwargs, seed=0):
    ours_cls, torch_cls = PAIRS[dims]
    torch.manual_seed(seed)
    ours = ours_cls(**kwargs)
    torch.manual_seed(seed)
    theirs = torch_cls(**kwargs)
    return ours, theirs


def _input(kwargs, spatial, n=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.rand((n, kwargs["in_channels"], *spatial), generator=g) * 2 - 1


@pytest.mark.parametrize("dims,kwargs,spatial", CONFIGS, ids=IDS)
def test_same_init_parameters_keys_and_repr(dims, kwargs, spatial):
    ours, theirs = _pair(dims, kwargs)
    assert isinstance(ours, PAIRS[dims][1])
    assert repr(ours) == repr(theirs)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    for (name, p), (name_t, p_t) in zip(
        ours.named_parameters(), theirs.named_parameters(), strict=True
    ):
        assert name == name_t and torch.equal(p, p_t) and type(p) is type(p_t)


@pytest.mark.parametrize("dims,kwargs,spatial", CONFIGS, ids=IDS)
def test_forward_and_gradients_match_torch(dims, kwargs, spatial):
    ours, theirs = _pair(dims, kwargs)
    x = _input(kwargs, spatial)
    x_ours, x64 = x.clone().requires_grad_(), x.double().requires_grad_()
    y = ours(x_ours)
    y64 = theirs.double()(x64)
    dy = torch.rand(y.shape, generator=torch.Generator().manual_seed(2)) * 2 - 1
    y.backward(dy)
    y64.backward(dy.double())
    tol = tolerance(torch.float32, "cpu")
    assert rms_range(y, y64) <= tol
    assert rms_range(x_ours.grad, x64.grad) <= tol
    for p, p64 in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert rms_range(p.grad, p64.grad) <= tol


@pytest.mark.parametrize("dims,kwargs,spatial", CONFIGS, ids=IDS)
def test_state_dict_round_trip_is_lossless(dims, kwargs, spatial):
    ours, theirs = _pair(dims, kwargs, seed=3)
    torch.manual_seed(4)
    source = PAIRS[dims][1](**kwargs)
    ours.load_state_dict(source.state_dict())
    theirs.load_state_dict(ours.state_dict())
    for key, value in source.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value)
        assert torch.equal(theirs.state_dict()[key], value)


def test_unbatched_input_like_torch():
    ours, theirs = _pair(2, dict(in_channels=3, out_channels=4, kernel_size=2, stride=2))
    x = _input(dict(in_channels=3), (4, 6))[0]
    y = ours(x)
    assert y.shape == theirs(x).shape == (4, 2, 3)
    assert rms_range(y, theirs.double()(x.double())) <= tolerance(torch.float32, "cpu")


@pytest.mark.parametrize("kind", ["plain_attribute", "weight_norm"])
def test_a_weight_that_is_not_a_registered_parameter_is_read_as_torch_reads_it(kind):
    """The forward reads a registered Parameter directly; a weight held otherwise (a
    plain tensor attribute, torch's hook-based weight_norm recomputing one before each
    forward) is read through the attribute, as torch's forward reads it."""
    torch.manual_seed(0)
    ours = gemmconv.nn.Conv2d(3, 8, 4, stride=4)
    theirs = torch.nn.Conv2d(3, 8, 4, stride=4)
    theirs.load_state_dict(ours.state_dict())
    for m in (ours, theirs):
        if kind == "plain_attribute":
            weight = m.weight.detach() * 2
            del m.weight
            m.weight = weight
        else:
            with pytest.warns(FutureWarning):
                torch.nn.utils.weight_norm(m)
    assert "weight" not in ours._parameters
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(ours(x), theirs(x))


@pytest.mark.usefixtures("work_costs_only")
def test_solvers_reports_each_direction_and_is_not_state():
    conv = gemmconv.nn.Conv2d(3, 8, kernel_size=4, stride=4)
    with pytest.raises(RuntimeError, match="no eager forward has run yet"):
        conv.solvers()
    example = torch.empty(2, 3, 8, 8)
    assert conv.solvers(example)["forward"].solver == "vendor"  # the CPU's oneDNN
    conv(_input(dict(in_channels=3), (4, 4)))
    choices = conv.solvers()
    assert set(choices) == {"forward", "backward_data", "backward_weights"}
    assert all(c.solver == "point_output" for c in choices.values())
    assert list(conv.state_dict()) == ["weight", "bias"]
    pointwise = gemmconv.nn.Conv2d(6, 4, kernel_size=1)
    x = _input(dict(in_channels=6), (3, 3))
    pointwise(x)
    # Each module reports its own last call: the 1x1's, as explain() decides it.
    reported = pointwise.solvers()["forward"]
    assert reported.rejected != choices["forward"].rejected
    assert reported.solver == gemmconv.explain(x, pointwise.weight)["forward"].solver


def test_solvers_reflects_padding_mode_and_vendor_fallback():
    conv = gemmconv.nn.Conv2d(4, 6, kernel_size=3, padding=1, padding_mode="reflect")
    conv(_input(dict(in_channels=4), (5, 5)))
    forward = conv.solvers()["forward"]
    assert forward.solver in ("im2col", "vendor")
    assert "patch" in forward.rejected


def test_module_compiles_fullgraph():
    conv = gemmconv.nn.Conv3d(3, 4, kernel_size=(2, 3, 3), stride=(2, 3, 3))
    compiled = torch.compile(conv, backend="aot_eager", fullgraph=True)
    x = _input(dict(in_channels=3), (4, 6, 6)).requires_grad_()
    y = compiled(x)
    y.sum().backward()
    x64 = x.detach().double()
    ref = torch.nn.functional.conv3d(
        x64, conv.weight.double(), conv.bias.double(), stride=(2, 3, 3)
    )
    assert rms_range(y, ref) <= tolerance(torch.float32, "cpu")
    assert conv.weight.grad is not None and x.grad is not None
