"""The per-call memo of ops.py (problem + solver per operand metadata and selection
state) and the cheap precision context: same answers as deciding afresh every call."""

from __future__ import annotations

import pytest
import torch

import gemmconv
from gemmconv.core.precision import conv_gemm_precision, with_conv_precision
from gemmconv.roads import ops
from gemmconv.selection import dispatch
from gemmconv.solvers import get_solver

_matmul = torch.backends.cuda.matmul


def _operands(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 8, 8, generator=gen)
    w = torch.randn(5, 3, 4, 4, generator=gen)
    b = torch.randn(5, generator=gen)
    return x, w, b


def _reference(x, w, b):
    return torch.nn.functional.conv2d(x.double(), w.double(), b.double(), stride=4)


def _count_forwards(monkeypatch, solver_id: str) -> list[int]:
    """Counts the forward runs of one solver (its class's forward, wrapped)."""
    calls = [0]
    cls = type(get_solver(solver_id))
    original = cls.forward

    def counted(self, problem, tensors, out):
        if self.id == solver_id:
            calls[0] += 1
        return original(self, problem, tensors, out)

    monkeypatch.setattr(cls, "forward", counted)
    return calls


def test_a_forced_solver_takes_effect_without_clearing_the_cache(monkeypatch) -> None:
    x, w, b = _operands()
    first = gemmconv.conv2d(x, w, b, stride=4)
    assert dispatch.choose(gemmconv.functional.problem_of(x, w, b, 4)).solver != "im2col"
    calls = _count_forwards(monkeypatch, "im2col")
    monkeypatch.setenv("GEMMCONV_SOLVER", "im2col")
    forced = gemmconv.conv2d(x, w, b, stride=4)
    assert calls[0] == 1
    monkeypatch.delenv("GEMMCONV_SOLVER")
    gemmconv.conv2d(x, w, b, stride=4)
    assert calls[0] == 1  # back to the estimate's choice, still without a clear
    ref = _reference(x, w, b)
    for y in (first, forced):
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


def test_a_bad_setting_fails_every_call_even_after_a_good_one(monkeypatch) -> None:
    x, w, b = _operands()
    gemmconv.conv2d(x, w, b, stride=4)
    monkeypatch.setenv("GEMMCONV_DISABLE", "no_such_solver")
    for _ in range(2):
        try:
            gemmconv.conv2d(x, w, b, stride=4)
        except ValueError as e:
            assert "no_such_solver" in str(e)
        else:
            raise AssertionError("an unknown id in GEMMCONV_DISABLE was accepted")


def test_clear_cache_empties_the_plans() -> None:
    x, w, b = _operands()
    gemmconv.conv2d(x, w, b, stride=4)
    assert ops._plans
    dispatch.clear_cache()
    assert not ops._plans


def test_plans_follow_strides_not_only_shapes() -> None:
    x, w, b = _operands(1)
    y_first = gemmconv.conv2d(x, w, b, stride=4)
    x_last = x.to(memory_format=torch.channels_last)
    y_last = gemmconv.conv2d(x_last, w, b, stride=4)
    assert y_first.is_contiguous()
    assert y_last.is_contiguous(memory_format=torch.channels_last)
    # A non-dense input of the same shape is copied, not read as if it were dense.
    wide = torch.randn(2, 3, 8, 16, generator=torch.Generator().manual_seed(2))
    x_sliced = wide[..., ::2]
    y_sliced = gemmconv.conv2d(x_sliced, w, b, stride=4)
    torch.testing.assert_close(y_sliced.double(), _reference(x_sliced, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y_last.double(), _reference(x, w, b), rtol=1e-5, atol=1e-5)


def test_precision_context_sets_and_restores_only_what_differs() -> None:
    saved = (
        torch.backends.cudnn.allow_tf32,
        _matmul.fp32_precision,
        _matmul.allow_fp16_reduced_precision_reduction,
        _matmul.allow_bf16_reduced_precision_reduction,
    )
    try:
        torch.backends.cudnn.allow_tf32 = False
        _matmul.fp32_precision = "tf32"
        with conv_gemm_precision(torch.float32, "cuda"):
            assert _matmul.fp32_precision == "ieee"
        assert _matmul.fp32_precision == "tf32"
        torch.backends.cudnn.allow_tf32 = True
        with conv_gemm_precision(torch.float32, "cuda"):
            assert _matmul.fp32_precision == "tf32"
        assert _matmul.fp32_precision == "tf32"
        _matmul.allow_fp16_reduced_precision_reduction = True
        _matmul.allow_bf16_reduced_precision_reduction = True
        with conv_gemm_precision(torch.bfloat16, "cuda"):
            # Only the flag of the dtype: a bf16 GEMM reads no other.
            assert _matmul.allow_fp16_reduced_precision_reduction
            assert not _matmul.allow_bf16_reduced_precision_reduction
        assert _matmul.allow_fp16_reduced_precision_reduction
        assert _matmul.allow_bf16_reduced_precision_reduction
        _matmul.allow_bf16_reduced_precision_reduction = False
        with conv_gemm_precision(torch.bfloat16, "cuda"):
            assert not _matmul.allow_bf16_reduced_precision_reduction
        assert not _matmul.allow_bf16_reduced_precision_reduction
        with conv_gemm_precision(torch.float32, "cpu"):
            assert _matmul.fp32_precision == "tf32"  # the CPU path touches nothing
    finally:
        (
            torch.backends.cudnn.allow_tf32,
            _matmul.fp32_precision,
            _matmul.allow_fp16_reduced_precision_reduction,
            _matmul.allow_bf16_reduced_precision_reduction,
        ) = saved


def test_half_precision_context_restores_each_flag_exactly() -> None:
    """The reduced-precision flags are (allow, allow split-K) pairs from torch 2.8 on:
    a flag the context turns off comes back with its split-K half as it was, and one
    already off is left alone."""
    get_fp16 = torch._C._get_cublas_allow_fp16_reduced_precision_reduction
    get_bf16 = torch._C._get_cublas_allow_bf16_reduced_precision_reduction
    saved = (get_fp16(), get_bf16())
    try:
        _matmul.allow_fp16_reduced_precision_reduction = True
        _matmul.allow_bf16_reduced_precision_reduction = (False, False)
        before = (get_fp16(), get_bf16())
        with conv_gemm_precision(torch.float16, "cuda"):
            inside = (get_fp16(), get_bf16())
        assert (get_fp16(), get_bf16()) == before
        off = (False, True) if isinstance(before[0], tuple) else False
        assert inside == (off, before[1])
    finally:
        _matmul.allow_fp16_reduced_precision_reduction = saved[0]
        _matmul.allow_bf16_reduced_precision_reduction = saved[1]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_wrapped_run_turns_its_dtypes_flag_off_and_back_even_when_it_raises(dtype) -> None:
    """with_conv_precision switches the flag inline (no context manager): inside the
    run it is off, after it (returned or raised) exactly as before, split-K half
    included; the other half dtype's flag is never touched."""
    kinds = {torch.float16: "fp16", torch.bfloat16: "bf16"}
    other = torch.bfloat16 if dtype == torch.float16 else torch.float16
    get = getattr(torch._C, f"_get_cublas_allow_{kinds[dtype]}_reduced_precision_reduction")
    get_other = getattr(torch._C, f"_get_cublas_allow_{kinds[other]}_reduced_precision_reduction")
    names = {d: f"allow_{kinds[d]}_reduced_precision_reduction" for d in kinds}
    saved = {d: getattr(_matmul, names[d]) for d in kinds}
    seen = []

    def run(fail: bool) -> str:
        seen.append((get(), get_other()))
        if fail:
            raise ValueError("solver failed")
        return "result"

    try:
        setattr(_matmul, names[dtype], True)
        setattr(_matmul, names[other], True)
        before, other_before = get(), get_other()
        wrapped = with_conv_precision(dtype, "cuda", run)
        assert wrapped(False) == "result"
        with pytest.raises(ValueError, match="solver failed"):
            wrapped(True)
        assert (get(), get_other()) == (before, other_before)
        off = (False, *before[1:]) if isinstance(before, tuple) else False
        assert seen == [(off, other_before)] * 2
        setattr(_matmul, names[dtype], False)  # already off: left alone
        off_before = get()
        assert wrapped(False) == "result" and get() == off_before
        assert with_conv_precision(dtype, "cpu", run) is run  # nothing to switch off CUDA
    finally:
        for d, value in saved.items():
            setattr(_matmul, names[d], value)


def test_a_wrapped_fp32_run_follows_the_convolution_tf32_flag() -> None:
    saved = torch.backends.cudnn.allow_tf32, _matmul.fp32_precision
    try:
        torch.backends.cudnn.allow_tf32 = False
        _matmul.fp32_precision = "tf32"
        modes = []
        with_conv_precision(torch.float32, "cuda", lambda: modes.append(_matmul.fp32_precision))()
        assert modes == ["ieee"] and _matmul.fp32_precision == "tf32"
    finally:
        torch.backends.cudnn.allow_tf32, _matmul.fp32_precision = saved
