"""ConvProblem: the frozen description of one convolution in one direction.

A problem holds everything a solver needs to decide applicability and cost, and
nothing that depends on tensor contents, so it can be hashed, cached and stored
in the find database.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from collections.abc import Sequence

import torch

from gemmconv.core.memory_format import Layout, input_layout_of, layout_of


class Direction(str, enum.Enum):
    """The three directions of a convolution: forward (y from x and w), backward-data
    (dx from dy and w) and backward-weights (dw from dy and x)."""

    FORWARD = "forward"
    BACKWARD_DATA = "backward_data"
    BACKWARD_WEIGHTS = "backward_weights"


DIRECTIONS: tuple[Direction, ...] = (
    Direction.FORWARD,
    Direction.BACKWARD_DATA,
    Direction.BACKWARD_WEIGHTS,
)

_DTYPE_NAMES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float64: "fp64",
}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _as_tuple(value: int | Sequence[int], dims: int, name: str) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,) * dims
    out = tuple(int(v) for v in value)
    if len(out) == 1:
        return out * dims
    if len(out) != dims:
        raise ValueError(f"{name}={tuple(value)!r}: expected an int or {dims} ints")
    return out


def one_window_stride(
    spatial: Sequence[int],
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
) -> tuple[int, ...]:
    """``stride`` with the kernel's size in every dimension where the stride changes
    nothing: one window, unpadded and undilated, on an input narrower than twice the
    kernel, so one output whatever the stride (a 7x7 convolution with stride 1 on 7x7
    maps, as fully-convolutional heads write their first linear layer). With the
    kernel's size there the problem is a patch convolution, which the patch solvers
    (stride == kernel) compute as one GEMM."""
    return tuple(
        r if p == 0 and d == 1 and r <= s < 2 * r and s - r < u else u
        for s, r, u, p, d in zip(spatial, kernel, stride, padding, dilation)
    )


@dataclasses.dataclass(frozen=True)
class ConvProblem:
    """One convolution, groups and layout included, in one direction.

    ``spatial`` is the input's spatial size, ``kernel`` the filter's; padding is
    symmetric per spatial dimension (string paddings are resolved before this).

    ``layout`` follows torch's output rule (channels-last when the input or the
    weight is); ``input_layout`` is the memory order of x itself, which differs
    from it for a channels-first x with a channels-last weight. Solvers that gather
    x read it in its own order. None means ``layout``; a backward-data problem reads
    no x, so its input_layout is always its layout. A stride that changes nothing (one
    window in that dimension) is stored as the kernel's size (one_window_stride).
    """

    n: int
    c: int
    k: int
    spatial: tuple[int, ...]
    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int = 1
    layout: Layout = Layout.CHANNELS_FIRST
    dtype: torch.dtype = torch.float32
    device_type: str = "cpu"
    direction: Direction = Direction.FORWARD
    has_bias: bool = False
    input_layout: Layout | None = None

    def __post_init__(self) -> None:
        # One value per meaning, so equal problems compare and hash equal.
        if self.input_layout is None or self.direction is Direction.BACKWARD_DATA:
            object.__setattr__(self, "input_layout", self.layout)
        stride = one_window_stride(self.spatial, self.kernel, self.stride, self.padding,
                                   self.dilation)  # fmt: skip
        if stride != self.stride:
            object.__setattr__(self, "stride", stride)

    # ---- construction -------------------------------------------------------

    @classmethod
    def from_sizes(
        cls,
        n: int,
        c: int,
        k: int,
        spatial: Sequence[int],
        kernel: int | Sequence[int],
        stride: int | Sequence[int] = 1,
        padding: int | Sequence[int] = 0,
        dilation: int | Sequence[int] = 1,
        groups: int = 1,
        layout: Layout | str = Layout.CHANNELS_FIRST,
        dtype: torch.dtype = torch.float32,
        device_type: str = "cpu",
        direction: Direction | str = Direction.FORWARD,
        has_bias: bool = False,
        input_layout: Layout | str | None = None,
    ) -> ConvProblem:
        dims = len(spatial)
        return cls(
            n=int(n),
            c=int(c),
            k=int(k),
            spatial=tuple(int(s) for s in spatial),
            kernel=_as_tuple(kernel, dims, "kernel"),
            stride=_as_tuple(stride, dims, "stride"),
            padding=_as_tuple(padding, dims, "padding"),
            dilation=_as_tuple(dilation, dims, "dilation"),
            groups=int(groups),
            layout=Layout(layout),
            dtype=dtype,
            device_type=str(device_type),
            direction=Direction(direction),
            has_bias=bool(has_bias),
            input_layout=None if input_layout is None else Layout(input_layout),
        )

    @classmethod
    def from_tensors(
        cls,
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        stride: int | Sequence[int] = 1,
        padding: int | Sequence[int] = 0,
        dilation: int | Sequence[int] = 1,
        groups: int = 1,
        direction: Direction | str = Direction.FORWARD,
    ) -> ConvProblem:
        dims = input.dim() - 2
        return cls.from_sizes(
            n=input.shape[0],
            c=input.shape[1],
            k=weight.shape[0],
            spatial=tuple(input.shape[2:]),
            kernel=tuple(weight.shape[2:]),
            stride=_as_tuple(stride, dims, "stride"),
            padding=_as_tuple(padding, dims, "padding"),
            dilation=_as_tuple(dilation, dims, "dilation"),
            groups=groups,
            layout=layout_of(input, weight),
            dtype=input.dtype,
            device_type=input.device.type,
            direction=direction,
            has_bias=bias is not None,
            input_layout=input_layout_of(input),
        )

    def with_direction(self, direction: Direction | str) -> ConvProblem:
        return dataclasses.replace(self, direction=Direction(direction))

    # ---- derived sizes ------------------------------------------------------

    @property
    def dims(self) -> int:
        return len(self.spatial)

    @functools.cached_property
    def output_spatial(self) -> tuple[int, ...]:
        # Computed once per problem (solvers read it many times per call); the value
        # lives in the instance __dict__, outside the fields, so equality, hashing and
        # dataclasses.replace are unaffected.
        return tuple(
            (s + 2 * p - d * (r - 1) - 1) // u + 1
            for s, r, u, p, d in zip(
                self.spatial, self.kernel, self.stride, self.padding, self.dilation
            )
        )

    @property
    def view_steps(self) -> tuple[int, ...]:
        """The stride per dimension as the step of a strided view of the input: 1 where
        there is one output position, since the step is then never taken, and a stride
        near 2**63 times an element stride would overflow the view's 64-bit strides."""
        return tuple(u if o > 1 else 1 for u, o in zip(self.stride, self.output_spatial))

    @property
    def input_shape(self) -> tuple[int, ...]:
        return (self.n, self.c, *self.spatial)

    @property
    def weight_shape(self) -> tuple[int, ...]:
        return (self.k, self.c // self.groups, *self.kernel)

    @property
    def output_shape(self) -> tuple[int, ...]:
        return (self.n, self.k, *self.output_spatial)

    @property
    def gemm_m(self) -> int:
        """Rows of the forward GEMM: one per output pixel."""
        return self.n * math.prod(self.output_spatial)

    @property
    def gemm_k(self) -> int:
        """Reduction length of the forward GEMM, per group."""
        return (self.c // self.groups) * math.prod(self.kernel)

    @property
    def gemm_n(self) -> int:
        """Output channels of the forward GEMM, per group."""
        return self.k // self.groups

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    # ---- work and traffic ---------------------------------------------------

    def flops(self) -> int:
        """Multiply-adds of the GEMM, counted as two flops, equal in every direction."""
        return 2 * self.gemm_m * self.gemm_k * self.gemm_n * self.groups

    def largest_operand_bytes(self) -> int:
        """Bytes of the largest of input, weight and output: the memory bound for a
        direction's extra buffers."""
        sizes = (math.prod(self.input_shape), math.prod(self.weight_shape),
                 math.prod(self.output_shape))  # fmt: skip
        return max(sizes) * self.element_size

    def min_bytes(self) -> int:
        """The fewest bytes the direction must move: operands read once, the result written once.

        The forward reads only the input elements some window touches (the patch
        class never reads its spatial remainder); backward-data writes all of dx.
        """
        e = self.element_size
        x_all = math.prod(self.input_shape)
        x_read = self.n * self.c * math.prod(self._touched_extent())
        w = math.prod(self.weight_shape)
        y = math.prod(self.output_shape)
        bias = self.k if self.has_bias else 0
        if self.direction is Direction.FORWARD:
            return e * (x_read + w + y + bias)
        if self.direction is Direction.BACKWARD_DATA:
            return e * (y + w + x_all)
        return e * (y + x_read + w + bias)

    def _touched_extent(self) -> tuple[int, ...]:
        """Per dimension, how many input positions some kernel window reads (padding excluded)."""
        extent = []
        for s, r, u, p, d, o in zip(
            self.spatial,
            self.kernel,
            self.stride,
            self.padding,
            self.dilation,
            self.output_spatial,
        ):
            if p == 0 and d == 1 and u >= r:
                extent.append(min(s, o * r))
            elif p == 0 and r == 1:
                extent.append(min(s, o))
            else:
                extent.append(s)
        return tuple(extent)

    # ---- identity -----------------------------------------------------------

    def key(self) -> str:
        """Canonical string, stable across processes: the find database key."""

        def j(values: tuple[int, ...]) -> str:
            return "x".join(str(v) for v in values)

        # The input's own layout is named only where it differs, so that the keys of
        # problems whose operands share one layout are those stored before it existed.
        layouts = self.layout.value
        if self.input_layout is not self.layout:
            layouts += f"-input_{self.input_layout.value}"
        return (
            f"{self.dims}d-n{self.n}-c{self.c}-k{self.k}-s{j(self.spatial)}"
            f"-r{j(self.kernel)}-u{j(self.stride)}-p{j(self.padding)}"
            f"-l{j(self.dilation)}-g{self.groups}-{layouts}"
            f"-{dtype_name(self.dtype)}-{self.device_type}-{self.direction.value}"
            f"-b{int(self.has_bias)}"
        )

    def __str__(self) -> str:
        return self.key()
