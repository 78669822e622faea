"""profile(model, *example_inputs): what gemmconv does for a model, on this device.

One forward of a copy of the model, with a forward pre-hook on every torch.nn.Conv1d,
Conv2d and Conv3d, records each convolution's input. Another copy is converted
(``gemmconv.convert``), and per convolution the profile gives its shape, whether
convert() swapped it (the reason where not), the solver each direction chooses on this
device for the recorded input (``module.solvers``, as ``gemmconv.explain`` says it), and
torch's and gemmconv's time per call, forward and (when training) forward + backward,
the two timed back to back and interleaved (measuring.timing.time_interleaved).

Then the whole model: the forward (eval mode, no grad) and a training step (train
mode: forward, a loss summing every floating-point output, backward, an SGD step) of
the torch copy and the converted copy, interleaved step by step in a fresh random order
each round (timing.interleaved_orders), each step timed from an idle device to the end
of the step; a time is the median of ``steps``. The model passed in is never changed.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from gemmconv.convert import convert
from gemmconv.core.problem import dtype_name
from gemmconv.measuring.timing import Timing, interleaved_orders, time_interleaved
from gemmconv.measuring.verify import rms_range

# The convolutions the profile looks at (subclasses too: convert() says why it leaves
# those alone).
_TORCH_CONVS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
DIRECTIONS = ("forward", "backward_data", "backward_weights")
# What profile(dtype="auto") picks: what each device type runs fast.
AUTO_DTYPES = {"cuda": torch.bfloat16, "cpu": torch.float32}
_DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# progress(done, total, what): called as the profile advances, outside timed regions.
Progress = Callable[[int, int, str], None]


@dataclasses.dataclass
class ConvProfile:
    """One convolution module of the model, as the recorded forward called it."""

    name: str
    module_class: str
    calls: int  # calls per forward
    needs_dx: bool  # the input needs a gradient in training (it is not the model's input)
    input_shape: tuple[int, ...]
    weight_shape: tuple[int, ...]
    bias: bool
    stride: tuple[int, ...]
    padding: tuple[int, ...] | str
    dilation: tuple[int, ...]
    groups: int
    dtype: str  # the convolution's dtype (autocast's where it is on)
    reducible: bool  # convert() swapped it
    problem_class: str | None  # patch, pointwise, strided pointwise; None where not swapped
    reason: str | None  # why convert() left it alone
    solvers: dict[str, str]  # direction -> solver id on this device; {} where not swapped
    notes: list[str]  # where eager training calls run torch's convolution instead
    torch_ms: dict[str, float]  # "forward", "forward_backward" -> ms per call
    gemmconv_ms: dict[str, float]
    same_as: str | None = None  # the earlier convolution of this problem whose times these are

    def speedup(self, mode: str) -> float | None:
        """torch's time over gemmconv's for ``mode`` ("forward", "forward_backward")."""
        ours, theirs = self.gemmconv_ms.get(mode), self.torch_ms.get(mode)
        return None if ours is None or theirs is None else theirs / ours


@dataclasses.dataclass
class StepTiming:
    """A whole-model step, torch's and the converted copy's, median of ``steps``."""

    torch_ms: float
    gemmconv_ms: float
    torch_min_ms: float
    gemmconv_min_ms: float
    steps: int

    @property
    def speedup(self) -> float:
        return self.torch_ms / self.gemmconv_ms


@dataclasses.dataclass
class ModelProfile:
    """What ``gemmconv.profile`` found: per convolution, then the whole model."""

    device: str
    dtype: str  # "fp32", "bf16" (autocast), or "model's own"
    autocast: bool
    train: bool
    steps: int
    warmup: int
    convs: list[ConvProfile]
    not_called: list[str]  # convolution modules the forward never called
    forward: StepTiming | None
    train_step: StepTiming | None
    train_note: str | None  # why there is no training step, where there is none
    rms_vs_torch: float | None  # the converted forward's output against torch's
    conversion: str  # convert()'s report on the copy

    @property
    def has_convolutions(self) -> bool:
        return bool(self.convs)

    def to_dict(self) -> dict[str, Any]:
        """The profile as JSON-ready data (tuples as lists)."""
        data = dataclasses.asdict(self)
        for row, conv in zip(data["convs"], self.convs):
            row["speedup"] = {mode: conv.speedup(mode) for mode in conv.gemmconv_ms}
        for key in ("forward", "train_step"):
            timing = getattr(self, key)
            if timing is not None:
                data[key]["speedup"] = timing.speedup
        return data

    def __str__(self) -> str:
        return _text(self)


def profile(
    model: torch.nn.Module,
    *example_inputs: Any,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = "auto",
    train: bool = True,
    steps: int = 10,
    warmup: int = 2,
    conv_times: bool = True,
    progress: Progress | None = None,
) -> ModelProfile:
    """Profile what ``gemmconv.convert`` does for ``model`` called as ``model(*example_inputs)``.

    Per convolution (every torch.nn.Conv1d/2d/3d the forward calls): its shape, whether
    convert() swaps it and why not, the solver per direction on ``device``, and torch's
    and gemmconv's milliseconds per call, forward and, with ``train``, forward +
    backward. Then the whole model's forward and training step (forward, loss,
    backward, SGD step), torch's copy and a converted copy interleaved, the median of
    ``steps`` after ``warmup`` untimed steps each. ``conv_times=False`` skips the
    per-convolution times.

    ``device``: where to run (default: the model's device); the copies and the inputs
    are moved there, the model itself is never changed. ``dtype``: None runs the model
    as it is; torch.float32 or "fp32" likewise; torch.bfloat16/"bf16" and
    torch.float16/"fp16" run under torch.autocast; "auto" (the default) is bf16 on CUDA
    and fp32 elsewhere. ``progress(done, total, what)`` is called as work finishes,
    outside every timed region.

    Returns a ``ModelProfile``: ``str()`` is a table, ``to_dict()`` JSON-ready data;
    ``convs`` is empty where the forward calls no convolution (nothing is timed then).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"profile: model={type(model).__name__}: expected a torch.nn.Module")
    if not example_inputs:
        raise ValueError("profile(model): expected at least one example input, as model(*inputs)")
    for argument, value, least in (("steps", steps, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"profile: {argument}={value!r}: expected an int >= {least}")
    device = _device_of(model) if device is None else torch.device(device)
    compute_dtype = _compute_dtype(dtype, device)
    autocast = compute_dtype not in (None, torch.float32)

    def amp() -> contextlib.AbstractContextManager:
        if not autocast:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=compute_dtype)

    inputs = tuple(_to(value, device) for value in example_inputs)
    reference = copy.deepcopy(model).to(device)
    converted = copy.deepcopy(model).to(device)
    report = convert(converted)
    # Eval mode: a training-mode forward would move the reference's batch-norm
    # statistics away from the converted copy's. Grad mode says which inputs need dx.
    reference.eval()
    recorded, not_called, trains = _record(reference, inputs, amp, train)

    result = ModelProfile(
        device=_device_text(device),
        dtype=dtype_name(compute_dtype) if compute_dtype is not None else "model's own",
        autocast=autocast,
        train=train,
        steps=steps,
        warmup=warmup,
        convs=[],
        not_called=not_called,
        forward=None,
        train_step=None,
        train_note=None if train else "not asked for (train=False)",
        rms_vs_torch=None,
        conversion=str(report),
    )
    if not recorded:
        return result

    train_possible = train and trains
    if train and not train_possible:
        result.train_note = "no floating-point output of the forward needs a gradient"
    step_rounds = warmup + steps
    total = (len(recorded) if conv_times else 0) + 2 * step_rounds * (1 + train_possible)
    done = 0

    def tick(what: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total, what)

    swapped = {s.name: s for s in report.swapped}
    skipped = {s.name: s for s in report.skipped}
    measured: dict[tuple, ConvProfile] = {}
    for name, seen in recorded.items():
        row = _row(name, seen, swapped, skipped, converted, amp, train_possible)
        key = seen.key(row.reducible)
        earlier = measured.get(key)
        if earlier is not None:
            row.torch_ms, row.gemmconv_ms = dict(earlier.torch_ms), dict(earlier.gemmconv_ms)
            row.same_as = earlier.same_as or earlier.name
        elif conv_times:
            ours = converted.get_submodule(name) if row.reducible else None
            _time_conv(row, seen, ours, device, amp, steps, warmup, train_possible)
            measured[key] = row
        if conv_times:
            tick(f"convolution {name}")
        result.convs.append(row)

    result.rms_vs_torch = _agreement(reference, converted, inputs, amp)
    result.forward = _time_steps(
        {name: _forward_step(m, inputs, amp) for name, m in _pair(reference, converted)},
        device, steps, warmup, tick, "forward",
    )  # fmt: skip
    if train_possible:
        result.train_step = _time_steps(
            {name: _train_step(m, inputs, amp) for name, m in _pair(reference, converted)},
            device, steps, warmup, tick, "training step",
        )  # fmt: skip
    return result


# ---- recording ----------------------------------------------------------------------


@dataclasses.dataclass
class _Seen:
    """A convolution module and the first input the recorded forward gave it."""

    module: torch.nn.Module
    input: torch.Tensor
    needs_dx: bool
    calls: int = 1

    def key(self, reducible: bool) -> tuple:
        """What makes two convolutions the same problem, to time each problem once."""
        m, x = self.module, self.input
        return (
            type(m), tuple(x.shape), x.stride(), x.dtype, self.needs_dx, tuple(m.weight.shape),
            m.weight.dtype, m.weight.requires_grad, m.bias is not None, tuple(m.stride),
            m.padding, tuple(m.dilation), m.groups, m.padding_mode, reducible,
        )  # fmt: skip


def _record(
    model: torch.nn.Module, inputs: tuple, amp: Callable, train: bool
) -> tuple[dict[str, _Seen], list[str], bool]:
    """One forward of ``model`` with a pre-hook on every convolution: per qualified
    name, the first input it saw, in call order; the convolutions never called; and
    whether a floating-point output needs a gradient (with ``train``), which a
    training step's loss needs."""
    seen: dict[str, _Seen] = {}
    handles = []
    convs = [(n, m) for n, m in model.named_modules() if isinstance(m, _TORCH_CONVS)]

    def hook_for(name: str) -> Callable:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            x = args[0] if args else kwargs.get("input")
            if name in seen:
                seen[name].calls += 1
            elif isinstance(x, torch.Tensor):
                seen[name] = _Seen(module, x.detach(), x.requires_grad)

        return hook

    try:
        for name, module in convs:
            handles.append(module.register_forward_pre_hook(hook_for(name), with_kwargs=True))
        with torch.set_grad_enabled(train), amp():
            output = model(*inputs)
    finally:
        for handle in handles:
            handle.remove()
    trains = any(t.requires_grad for t in _floating_tensors(output))
    return seen, [name for name, _ in convs if name not in seen], trains


def _row(
    name: str,
    seen: _Seen,
    swapped: Mapping,
    skipped: Mapping,
    converted: torch.nn.Module,
    amp: Callable,
    train: bool,
) -> ConvProfile:
    m, x = seen.module, seen.input
    dtype = x.dtype
    with amp():
        # The convolution's dtype: autocast's where it is on (it leaves float64 alone).
        if torch.is_autocast_enabled(x.device.type) and x.dtype in (
            torch.float32,
            torch.half,
            torch.bfloat16,
        ):
            dtype = torch.get_autocast_dtype(x.device.type)
    reducible = name in swapped
    solvers: dict[str, str] = {}
    notes: list[str] = []
    if reducible:
        ours = converted.get_submodule(name)
        with amp():
            choices = ours.solvers(x.detach().requires_grad_(seen.needs_dx and train))
        solvers = {direction: choices[direction].solver for direction in DIRECTIONS}
        notes = list(getattr(choices, "notes", []) or []) if train else []
    padding = m.padding if isinstance(m.padding, str) else tuple(m.padding)
    return ConvProfile(
        name=name,
        module_class=type(m).__name__,
        calls=seen.calls,
        needs_dx=seen.needs_dx,
        input_shape=tuple(x.shape),
        weight_shape=tuple(m.weight.shape),
        bias=m.bias is not None,
        stride=tuple(m.stride),
        padding=padding,
        dilation=tuple(m.dilation),
        groups=m.groups,
        dtype=dtype_name(dtype),
        reducible=reducible,
        problem_class=swapped[name].problem_class if reducible else None,
        reason=skipped[name].reason if name in skipped else None,
        solvers=solvers,
        notes=notes,
        torch_ms={},
        gemmconv_ms={},
    )


# ---- per-convolution times ----------------------------------------------------------


def _time_conv(
    row: ConvProfile,
    seen: _Seen,
    ours: torch.nn.Module | None,
    device: torch.device,
    amp: Callable,
    steps: int,
    warmup: int,
    train: bool,
) -> None:
    """torch's and (for a swapped convolution) gemmconv's ms per call into ``row``."""
    modules = {"torch": seen.module}
    if ours is not None:
        modules["gemmconv"] = ours
    x = seen.input
    with torch.no_grad(), amp():
        forward = time_interleaved(
            {name: [_call(m, x)] for name, m in modules.items()},
            device, reps=steps, warmup=warmup,
        )  # fmt: skip
    _store(row, "forward", forward)
    if not train:
        return
    calls = {name: _call_backward(m, x, seen.needs_dx, amp) for name, m in modules.items()}
    if any(call is None for call in calls.values()):
        return  # nothing of this convolution needs a gradient
    with amp():
        both = time_interleaved(
            {name: [call] for name, call in calls.items()}, device, reps=steps, warmup=warmup
        )
    _store(row, "forward_backward", both)


def _call(module: torch.nn.Module, x: torch.Tensor) -> Callable[[], object]:
    return lambda: module(x)


def _call_backward(
    module: torch.nn.Module, x: torch.Tensor, needs_dx: bool, amp: Callable
) -> Callable[[], object] | None:
    """A forward and the backward of the gradients a training step needs of it."""
    x = x.detach().requires_grad_(needs_dx)
    wrt = ([x] if needs_dx else []) + [p for p in module.parameters() if p.requires_grad]
    if not wrt:
        return None
    with amp():
        y = module(x)
    grad = torch.randn_like(y)
    return lambda: torch.autograd.grad(module(x), wrt, grad)


def _store(row: ConvProfile, mode: str, timings: dict[str, Timing]) -> None:
    row.torch_ms[mode] = timings["torch"].median_ms
    if "gemmconv" in timings:
        row.gemmconv_ms[mode] = timings["gemmconv"].median_ms


# ---- whole-model steps --------------------------------------------------------------


def _pair(reference: torch.nn.Module, converted: torch.nn.Module) -> Iterator[tuple]:
    yield "torch", reference
    yield "gemmconv", converted


def _forward_step(model: torch.nn.Module, inputs: tuple, amp: Callable) -> Callable[[], object]:
    model.eval()

    def step() -> object:
        with torch.no_grad(), amp():
            return model(*inputs)

    return step


def _train_step(model: torch.nn.Module, inputs: tuple, amp: Callable) -> Callable[[], object]:
    model.train()
    # lr 0 keeps the weights, so every step computes the same thing; the update's work
    # is done all the same.
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)

    def step() -> object:
        optimizer.zero_grad(set_to_none=True)
        with amp():
            loss = _loss(model(*inputs))
        loss.backward()
        optimizer.step()
        return loss

    return step


def _time_steps(
    steps_by_name: dict[str, Callable[[], object]],
    device: torch.device,
    steps: int,
    warmup: int,
    tick: Callable[[str], None],
    what: str,
) -> StepTiming:
    """Each step ``warmup`` times untimed, then ``steps`` timed rounds, the names in a
    fresh random order each round; a step runs from an idle device to its end."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for name, step in steps_by_name.items():
        for _ in range(warmup):
            step()
            sync()
            tick(f"{what}, {name}, warm-up")
    samples: dict[str, list[float]] = {name: [] for name in steps_by_name}
    for order in interleaved_orders(list(steps_by_name), steps):
        for name in order:
            sync()
            started = time.perf_counter()
            steps_by_name[name]()
            sync()
            samples[name].append((time.perf_counter() - started) * 1000.0)
            tick(f"{what}, {name}")
    torch_t = Timing.from_samples(tuple(samples["torch"]))
    ours = Timing.from_samples(tuple(samples["gemmconv"]))
    return StepTiming(torch_t.median_ms, ours.median_ms, torch_t.min_ms, ours.min_ms, steps)


def _floating_tensors(output: object) -> Iterator[torch.Tensor]:
    """Every floating-point tensor of a model's output (tensors, tuples, dicts,
    transformers' ModelOutput), in order."""
    if isinstance(output, torch.Tensor):
        if output.is_floating_point():
            yield output
    elif isinstance(output, Mapping):
        for value in output.values():
            yield from _floating_tensors(value)
    elif isinstance(output, Sequence) and not isinstance(output, (str, bytes)):
        for value in output:
            yield from _floating_tensors(value)


def _loss(output: object) -> torch.Tensor:
    """A scalar that depends on every floating-point output needing a gradient."""
    terms = [t.float().mean() for t in _floating_tensors(output) if t.requires_grad]
    return torch.stack(terms).sum()


def _agreement(
    reference: torch.nn.Module, converted: torch.nn.Module, inputs: tuple, amp: Callable
) -> float | None:
    """rms_range of the converted copy's first floating-point output against torch's."""
    outputs = []
    for model in (reference, converted):
        model.eval()
        with torch.no_grad(), amp():
            outputs.append(next(_floating_tensors(model(*inputs)), None))
    if outputs[0] is None or outputs[1] is None:
        return None
    return rms_range(outputs[1], outputs[0])


# ---- arguments ----------------------------------------------------------------------


def _device_of(model: torch.nn.Module) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def _device_text(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"{device} ({torch.get_num_threads()} threads)"


def _compute_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype) and dtype == torch.float32:
        return None if dtype is None else torch.float32
    if dtype == "auto":
        return AUTO_DTYPES.get(device.type, torch.float32)
    if isinstance(dtype, str) and dtype in _DTYPE_NAMES:
        return _DTYPE_NAMES[dtype]
    if dtype in (torch.bfloat16, torch.float16):
        return dtype
    raise ValueError(
        f"profile: dtype={dtype!r}: expected None, 'auto', 'fp32', 'bf16', 'fp16', "
        "torch.float32, torch.bfloat16 or torch.float16"
    )


def _to(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


# ---- the table ----------------------------------------------------------------------

_SHORT_DIRECTIONS = {"forward": "fwd", "backward_data": "dx", "backward_weights": "dW"}


def _dims(values: Sequence[int]) -> str:
    return "x".join(str(v) for v in values)


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"  # 3720, not 3.72e+03


def _pair_text(torch_ms: float | None, ours: float | None) -> str:
    if torch_ms is None:
        return "-"
    if ours is None:
        return f"{_ms(torch_ms)} / -"
    return f"{_ms(torch_ms)} / {_ms(ours)} ({torch_ms / ours:.2f}x)"


def _text(p: ModelProfile) -> str:
    if not p.convs:
        unused = f" ({len(p.not_called)} defined, never called)" if p.not_called else ""
        return (
            f"no torch.nn.Conv1d/2d/3d ran in the forward{unused}: nothing for gemmconv to convert"
        )
    swapped = sum(c.reducible for c in p.convs)
    lines = [
        f"gemmconv profile on {p.device}, {p.dtype}{' (autocast)' if p.autocast else ''}: "
        f"{len(p.convs)} convolutions, {swapped} GEMM-reducible (converted)",
        "",
    ]
    header = ["convolution", "input", "weight", "stride", "GEMM", "solvers fwd/dx/dW"]
    header.append("forward ms torch / gemmconv")
    if p.train:
        header.append("fwd+bwd ms torch / gemmconv")
    rows = [header]
    for c in p.convs:
        # In a training step a convolution whose input needs no gradient runs no dx.
        shown = [
            "-" if p.train and d == "backward_data" and not c.needs_dx else c.solvers[d]
            for d in DIRECTIONS
            if c.solvers
        ]
        solvers = "/".join(shown) if shown else "torch"
        row = [
            c.name + (f" (x{c.calls})" if c.calls > 1 else ""),
            _dims(c.input_shape),
            _dims(c.weight_shape),
            _dims(c.stride),
            c.problem_class or "no",
            solvers + (" *" if c.notes else ""),
            _pair_text(c.torch_ms.get("forward"), c.gemmconv_ms.get("forward")),
        ]
        if p.train:
            row.append(
                _pair_text(
                    c.torch_ms.get("forward_backward"), c.gemmconv_ms.get("forward_backward")
                )
            )
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    left = [c for c in p.convs if not c.reducible]
    if left:
        lines.append("")
        lines.append("left to torch:")
        lines.extend(f"  {c.name}: {c.reason}" for c in left)
    noted = [c for c in p.convs if c.notes]
    if noted:
        lines.append("")
        lines.append("* in eager training:")
        lines.extend(f"  {c.name}: {note}" for c in noted for note in c.notes)
    if p.not_called:
        lines.append("")
        lines.append(f"never called by the forward: {', '.join(p.not_called)}")
    lines.append("")
    lines.append(f"whole model (median of {p.steps} steps, {p.warmup} warm-up, interleaved):")
    table = [("", "torch ms", "converted ms", "speed-up")]
    for title, timing in (("forward", p.forward), ("training step", p.train_step)):
        if timing is not None:
            table.append(
                (title, _ms(timing.torch_ms), _ms(timing.gemmconv_ms), f"{timing.speedup:.2f}x")
            )
    widths = [max(len(r[i]) for r in table) for i in range(4)]
    for r in table:
        lines.append("  " + "  ".join(cell.rjust(w) for cell, w in zip(r, widths)).rstrip())
    if p.train_step is None and p.train_note:
        lines.append(f"  no training step: {p.train_note}")
    if p.rms_vs_torch is not None and math.isfinite(p.rms_vs_torch):
        lines.append(f"converted output vs torch's: rms {p.rms_vs_torch:.2g} of the range")
    elif p.rms_vs_torch is not None:
        lines.append("converted output vs torch's: not finite")
    return "\n".join(lines)


__all__ = ["AUTO_DTYPES", "ConvProfile", "ModelProfile", "StepTiming", "profile"]
