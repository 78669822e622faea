"""Random convolution cases: a plain description (ConvCase), the tensors it stands for,
and the checks every case must pass against torch and a float64 reference.

The property tests (test_properties.py) draw ConvCases with hypothesis; a case that
ever failed is kept as a literal ConvCase in test_regressions.py and runs through the
same checks, so a regression test and a property example mean the same thing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

import gemmconv
from gemmconv import ConvProblem, ConvTensors, Direction, Layout
from gemmconv.core.memory_format import empty_in
from gemmconv.measuring.verify import reference, rms_range, tolerance
from gemmconv.solvers import SOLVERS

TORCH_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
GEMMCONV_CONV = {1: gemmconv.conv1d, 2: gemmconv.conv2d, 3: gemmconv.conv3d}

CF, CL = Layout.CHANNELS_FIRST, Layout.CHANNELS_LAST

# How the input reaches the convolution. Every kind but "dense" is a non-contiguous
# (or offset, or overlapping) view of a larger or reordered leaf tensor.
X_VIEWS = (
    "dense",
    "offset",  # dense, but not at the start of its storage
    "sliced_channels",
    "sliced_spatial",  # every other element of the last spatial dimension
    "spatial_transposed",  # first and last spatial dims swapped in memory (1-D: N and C)
    "expanded_batch",  # one sample broadcast over the batch (stride 0)
)
W_VIEWS = ("dense", "offset", "sliced_out_channels")
DY_VIEWS = ("dense", "other_layout", "expanded", "sliced")


@dataclasses.dataclass(frozen=True)
class ConvCase:
    """One call of gemmconv.conv{dims}d and its backward, described by value."""

    dims: int
    n: int
    c: int
    k: int
    spatial: tuple[int, ...]
    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...] | str
    dilation: tuple[int, ...]
    groups: int
    dtype: torch.dtype
    bias: bool
    x_layout: Layout = CF
    w_layout: Layout = CF
    x_view: str = "dense"
    w_view: str = "dense"
    dy_view: str = "dense"
    needs_grad: tuple[bool, bool, bool] = (True, True, True)  # input, weight, bias
    seed: int = 0

    @property
    def int_padding(self) -> bool:
        return not isinstance(self.padding, str)

    def problem(
        self, direction: Direction, layout: Layout, device_type: str = "cpu"
    ) -> ConvProblem:
        """The solver-level problem (integer padding only)."""
        assert self.int_padding
        return ConvProblem.from_sizes(
            n=self.n,
            c=self.c,
            k=self.k,
            spatial=self.spatial,
            kernel=self.kernel,
            stride=self.stride,
            padding=self.padding,
            dilation=self.dilation,
            groups=self.groups,
            layout=layout,
            dtype=self.dtype,
            device_type=device_type,
            direction=direction,
            has_bias=self.bias and direction is Direction.FORWARD,
        )


# ---- tensors ------------------------------------------------------------------


def _random(shape, layout: Layout, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Uniform(-1, 1) values, never all zeros, dense in ``layout``."""
    t = empty_in(tuple(shape), layout, dtype, torch.device("cpu"))
    t.copy_(torch.rand(tuple(shape), generator=gen, dtype=torch.float64) * 2 - 1)
    return t


def _input_leaf(case: ConvCase, gen) -> tuple[torch.Tensor, Callable]:
    """The leaf tensor gradients accumulate into, and the view of it that is convolved."""
    n, c, s, lay, dt = case.n, case.c, case.spatial, case.x_layout, case.dtype
    kind = case.x_view
    if kind == "dense":
        return _random((n, c, *s), lay, dt, gen), lambda t: t
    if kind == "offset":
        return _random((n + 1, c, *s), lay, dt, gen), lambda t: t[1:]
    if kind == "sliced_channels":
        return _random((n, c + 2, *s), lay, dt, gen), lambda t: t[:, 1 : 1 + c]
    if kind == "sliced_spatial":
        return _random((n, c, *s[:-1], 2 * s[-1]), lay, dt, gen), lambda t: t[..., ::2]
    if kind == "spatial_transposed":
        if case.dims == 1:
            return _random((c, n, *s), lay, dt, gen), lambda t: t.transpose(0, 1)
        last = 1 + case.dims
        swapped = list(s)
        swapped[0], swapped[-1] = swapped[-1], swapped[0]
        return _random((n, c, *swapped), lay, dt, gen), lambda t: t.transpose(2, last)
    if kind == "expanded_batch":
        return _random((1, c, *s), lay, dt, gen), lambda t: t.expand(n, *t.shape[1:])
    raise ValueError(f"x_view={kind!r}: expected one of {X_VIEWS}")


def _weight_leaf(case: ConvCase, gen) -> tuple[torch.Tensor, Callable]:
    shape = (case.k, case.c // case.groups, *case.kernel)
    lay, dt = case.w_layout, case.dtype
    if case.w_view == "dense":
        return _random(shape, lay, dt, gen), lambda t: t
    if case.w_view == "offset":
        return _random((shape[0] + 1, *shape[1:]), lay, dt, gen), lambda t: t[1:]
    if case.w_view == "sliced_out_channels":
        return _random((2 * shape[0], *shape[1:]), lay, dt, gen), lambda t: t[::2]
    raise ValueError(f"w_view={case.w_view!r}: expected one of {W_VIEWS}")


def _bias_leaf(case: ConvCase, gen) -> tuple[torch.Tensor | None, Callable]:
    if not case.bias:
        return None, lambda t: t
    if case.w_view == "sliced_out_channels":
        return _random((2 * case.k,), CF, case.dtype, gen), lambda t: t[::2]
    return _random((case.k,), CF, case.dtype, gen), lambda t: t


def _grad_output(case: ConvCase, y: torch.Tensor, gen) -> torch.Tensor:
    shape = tuple(y.shape)
    y_layout = CL if (y.dim() > 1 and not y.is_contiguous()) else CF
    kind = case.dy_view
    if kind == "dense":
        return _random(shape, y_layout, case.dtype, gen)
    if kind == "other_layout":
        return _random(shape, CF if y_layout is CL else CL, case.dtype, gen)
    if kind == "expanded":
        return _random((1, *shape[1:]), y_layout, case.dtype, gen).expand(shape)
    if kind == "sliced":
        wide = (*shape[:-1], 2 * shape[-1])
        return _random(wide, y_layout, case.dtype, gen)[..., ::2]
    raise ValueError(f"dy_view={kind!r}: expected one of {DY_VIEWS}")


def _same_strides_copy(t: torch.Tensor | None, dtype: torch.dtype | None = None):
    if t is None:
        return None
    out = torch.empty_strided(t.shape, t.stride(), dtype=dtype or t.dtype)
    out.copy_(t.detach())
    return out


# ---- the checks -----------------------------------------------------------------


def conditioned_rms(a: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor) -> float:
    """rms_range with the result's natural scale: ``scale`` is the same direction run on
    the operands' absolute values, the sum of |terms| behind each element.

    Rounding error in a sum is proportional to the sum of its terms' magnitudes, not
    to the sum itself; on a tiny output where terms cancel (two channels, one pixel),
    rms_range's max|ref| understates the scale and flags exact-as-possible results.
    """
    a64, ref64 = a.detach().double(), ref.detach().double()
    if a64.numel() == 0:
        return 0.0
    if not torch.isfinite(a64).all():
        return math.inf
    norm = max(a64.abs().max().item(), ref64.abs().max().item(), scale.abs().max().item())
    if norm == 0.0:
        return 0.0
    return (torch.linalg.vector_norm(a64 - ref64) / (math.sqrt(a64.numel()) * norm)).item()


def assert_matches_reference(
    what: str,
    ours: torch.Tensor | None,
    ref: torch.Tensor,
    scale: torch.Tensor,
    case,
    device_type: str = "cpu",
) -> None:
    """``ours`` within the dtype's tolerance of the float64 ``ref``: by rms_range, or,
    where terms cancel, by conditioned_rms."""
    assert ours is not None, f"{what}: gemmconv gave no result"
    assert tuple(ours.shape) == tuple(ref.shape), f"{what}: shape {ours.shape} != {ref.shape}"
    assert ours.dtype == case.dtype, f"{what}: dtype {ours.dtype} != {case.dtype}"
    tol = tolerance(case.dtype, device_type)
    ours, ref, scale = (t.detach().cpu() for t in (ours, ref, scale))
    plain = rms_range(ours, ref)
    if plain <= tol:
        return
    conditioned = conditioned_rms(ours, ref, scale)
    assert conditioned <= tol, (
        f"{what}: rms_range {plain:.3g} and conditioned {conditioned:.3g} > tol {tol:.3g} "
        f"for {case}"
    )


def _output_format_is_torch_cpu_quirk(case: ConvCase, x: torch.Tensor, w: torch.Tensor) -> bool:
    """Where torch's CPU output strides come from a backend heuristic gemmconv does not
    follow (the values are the same; only the stride comparison is skipped):

    - conv1d runs as a 2-D oneDNN convolution of unsqueezed operands, whose stride
      heuristics make the 1-D output non-contiguous for a transposed (channels-last)
      weight, or for a single input channel with channel stride 1;
    - fp32 conv3d runs on oneDNN (channels-last output for channels-last operands) or on
      the native Slow3d kernel (always contiguous), chosen from the batch size, kernel
      size and thread count.
    """
    if case.dims == 1:
        return case.w_layout is CL or (case.c == 1 and case.x_layout is CL)
    if case.dims == 3 and case.dtype == torch.float32 and case.int_padding:
        backend = torch._C._select_conv_backend(
            x,
            w,
            None,
            list(case.stride),
            list(case.padding),
            list(case.dilation),
            False,
            [0] * 3,
            case.groups,
        )
        return backend.name in ("Slow3d", "SlowDilated3d")
    return case.dims == 3 and case.dtype == torch.float32  # 'same'/'valid': not resolved here


def _memory_format(t: torch.Tensor) -> tuple[bool, ...]:
    flags = [t.is_contiguous()]
    if t.dim() == 4:
        flags.append(t.is_contiguous(memory_format=torch.channels_last))
    if t.dim() == 5:
        flags.append(t.is_contiguous(memory_format=torch.channels_last_3d))
    return tuple(flags)


def check_against_torch(case: ConvCase) -> None:
    """gemmconv.conv{d}d forward and every gradient against float64, with torch's output
    shape, dtype and memory format, on the same (possibly non-contiguous) operands."""
    gen = torch.Generator().manual_seed(case.seed)
    x_leaf, x_view = _input_leaf(case, gen)
    w_leaf, w_view = _weight_leaf(case, gen)
    b_leaf, b_view = _bias_leaf(case, gen)
    leaves = (x_leaf, w_leaf, b_leaf)

    def run(conv, dtype, magnitudes=False, reference=False):
        mine = [_same_strides_copy(t, dtype) for t in leaves]
        if magnitudes:
            mine = [None if t is None else t.abs_() for t in mine]
        for t, needs in zip(mine, case.needs_grad, strict=True):
            if t is not None:
                t.requires_grad_(needs)
        x, w = x_view(mine[0]), w_view(mine[1])
        if reference:
            # On channels-first copies (measuring.verify.reference says why).
            x, w = (t.clone(memory_format=torch.contiguous_format) for t in (x, w))
        b = None if mine[2] is None else b_view(mine[2])
        kwargs = dict(
            stride=case.stride, padding=case.padding, dilation=case.dilation, groups=case.groups
        )
        return mine, (x, w), conv(x, w, b, **kwargs)

    conv_ours, conv_torch = GEMMCONV_CONV[case.dims], TORCH_CONV[case.dims]
    ours, _, y = run(conv_ours, case.dtype)
    theirs, operands_torch, y_torch = run(conv_torch, case.dtype)
    refs, _, y_ref = run(conv_torch, torch.float64, reference=True)
    scales, _, y_scale = run(conv_torch, torch.float64, magnitudes=True, reference=True)

    assert tuple(y.shape) == tuple(y_torch.shape)
    if not _output_format_is_torch_cpu_quirk(case, *operands_torch):
        assert _memory_format(y) == _memory_format(y_torch), (
            f"output strides {y.stride()} vs torch's {y_torch.stride()} for {case}"
        )
    assert_matches_reference("forward", y, y_ref, y_scale, case)

    if not y.requires_grad:
        assert not y_torch.requires_grad
        return
    dy = _grad_output(case, y, gen)
    y.backward(dy)
    y_torch.backward(dy)
    y_ref.backward(dy.to(torch.float64))
    y_scale.backward(dy.to(torch.float64).abs())
    for name, mine, torch_leaf, ref_leaf, scale_leaf in zip(
        ("input grad", "weight grad", "bias grad"), ours, theirs, refs, scales, strict=True
    ):
        if mine is None:
            continue
        assert (mine.grad is None) == (torch_leaf.grad is None), name
        if mine.grad is not None:
            assert_matches_reference(name, mine.grad, ref_leaf.grad, scale_leaf.grad, case)


def check_every_solver(case: ConvCase, device_type: str = "cpu") -> list[str]:
    """Every solver that accepts the case's problem, in every direction and in both
    layouts, run into a NaN-filled output and judged against float64. Returns the ids
    of the solvers that ran (so a property test can report its coverage)."""
    from solver_cases import nan_output, operands

    ran = []
    for layout in (CF, CL):
        for direction in (Direction.FORWARD, Direction.BACKWARD_DATA, Direction.BACKWARD_WEIGHTS):
            problem = case.problem(direction, layout, device_type)
            tensors: ConvTensors = operands(problem, device_type, case.seed)
            ref = reference(problem, tensors)
            scale = reference(problem, _magnitudes(tensors))
            for solver in SOLVERS:
                if solver.not_supported_reasons(problem):
                    continue
                out = nan_output(problem, device_type)
                result = solver.run(problem, tensors, out=out)
                what = f"{solver.id} {direction.value} {layout.value}"
                assert result.data_ptr() == out.data_ptr(), f"{what}: did not write into out"
                assert_matches_reference(what, result, ref, scale, case, device_type)
                fresh = solver.run(problem, tensors)
                again = f"{what} (allocated result)"
                assert_matches_reference(again, fresh, ref, scale, case, device_type)
                ran.append(solver.id)
    return ran


def _magnitudes(tensors: ConvTensors) -> ConvTensors:
    def magnitude(t):
        return None if t is None else t.abs()

    return ConvTensors(
        input=magnitude(tensors.input),
        weight=magnitude(tensors.weight),
        bias=magnitude(tensors.bias),
        grad_output=magnitude(tensors.grad_output),
    )
