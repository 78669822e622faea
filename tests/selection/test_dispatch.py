"""Selection: every mode, forced and disabled solvers, caching, logging, find, ranks."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import gemmconv
from gemmconv.core.device_rates import CPU, H200
from gemmconv.core.memory_format import Layout
from gemmconv.core.problem import DIRECTIONS, ConvProblem, Direction
from gemmconv.measuring import measure
from gemmconv.selection import dispatch, finddb
from gemmconv.selection import find as find_module
from gemmconv.selection.dispatch import FindMode
from gemmconv.solvers import SOLVERS, get_solver
from gemmconv.solvers.im2col import Im2colSolver
from gemmconv.solvers.patch import PatchSolver
from gemmconv.solvers.vendor import VendorSolver, vendor_efficiency

from find_counting import count_finds, is_finds_pick
from recorded_runs import vendor_measured_competitive


def _patch_problem(direction=Direction.FORWARD, **kw) -> ConvProblem:
    """A patch-class problem (2x2 output pixels) where patch, im2col and vendor apply."""
    return ConvProblem.from_sizes(4, 3, 8, (8, 8), 4, stride=4, direction=direction, **kw)


def _gemm_sized_patch_problem() -> ConvProblem:
    """A patch-class problem on which a GEMM beats the vendor in the CPU's cost model:
    one patch of 48 taps per sample (on tiny problems the vendor's single launch wins on
    host time; torch's CPU convolution matches a GEMM on many-pixel patches, and beats
    one with its gather on small patches)."""
    return ConvProblem.from_sizes(16, 3, 8, (4, 4), 4, stride=4)


def _applicable(problem: ConvProblem) -> set[str]:
    return {s.id for s in SOLVERS if s.is_applicable(problem)}


def _no_find(monkeypatch) -> None:
    def refuse(*args, **kw):
        raise AssertionError("this mode must not benchmark")

    monkeypatch.setattr(find_module, "find_best", refuse)


def _identity() -> finddb.Identity:
    return finddb.identity_for("cpu")


def _store(problem: ConvProblem, solver: str) -> None:
    record = finddb.Record(problem.key(), _identity(), solver, {}, 1.0, 0)
    finddb.get_db().store(record)


# ---- the mode ------------------------------------------------------------------


def test_default_mode_follows_cudnn_benchmark(monkeypatch):
    assert dispatch.current_find_mode() is FindMode.DATABASE
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    assert dispatch.current_find_mode() is FindMode.HYBRID


def test_mode_precedence_context_then_setter_then_environment(monkeypatch):
    monkeypatch.setenv("GEMMCONV_FIND_MODE", "Find")
    assert dispatch.current_find_mode() is FindMode.FIND
    gemmconv.set_find_mode("hybrid")
    assert dispatch.current_find_mode() is FindMode.HYBRID
    with gemmconv.find_mode("immediate") as mode:
        assert mode is FindMode.IMMEDIATE
        assert dispatch.current_find_mode() is FindMode.IMMEDIATE
    assert dispatch.current_find_mode() is FindMode.HYBRID
    gemmconv.set_find_mode(None)
    assert dispatch.current_find_mode() is FindMode.FIND
    gemmconv.set_find_mode("immediate-with-database")
    assert dispatch.current_find_mode() is FindMode.DATABASE


def test_find_mode_block_reaches_other_threads():
    # The autograd engine runs CUDA backward passes on its own threads.
    import threading

    seen = []
    with gemmconv.find_mode("find"):
        worker = threading.Thread(target=lambda: seen.append(dispatch.current_find_mode()))
        worker.start()
        worker.join()
    assert seen == [FindMode.FIND]
    assert dispatch.current_find_mode() is FindMode.DATABASE


def test_unknown_mode_is_an_error_naming_its_source(monkeypatch):
    with pytest.raises(ValueError, match="mode='fast'"):
        gemmconv.set_find_mode("fast")
    monkeypatch.setenv("GEMMCONV_FIND_MODE", "often")
    with pytest.raises(ValueError, match="GEMMCONV_FIND_MODE='often'.*immediate"):
        dispatch.choose(_patch_problem())


# ---- immediate and database ------------------------------------------------------


def test_immediate_picks_the_lowest_estimate_and_touches_no_database(monkeypatch, tmp_path):
    _no_find(monkeypatch)
    problem = _patch_problem()
    with gemmconv.find_mode("immediate"):
        choice = dispatch.choose(problem)
    estimates = {s.id: s.call_ms(problem) for s in SOLVERS if s.is_applicable(problem)}
    assert choice.solver == min(estimates, key=estimates.__getitem__)
    assert choice.estimates_ms == pytest.approx(estimates)
    assert choice.source == "estimate" and choice.mode == "immediate"
    assert not (tmp_path / "find.sqlite").exists()


def test_database_mode_uses_a_hit_and_never_benchmarks(monkeypatch):
    _no_find(monkeypatch)
    problem = _patch_problem()
    immediate = dispatch.decide(problem).solver
    stored = next(s for s in ("im2col", "vendor") if s != immediate)
    _store(problem, stored)
    choice = dispatch.choose(problem)  # the default mode: cudnn.benchmark is False
    assert choice.mode == "database" and choice.source == "database"
    assert choice.solver == stored


def test_database_mode_miss_falls_back_to_the_estimate(monkeypatch):
    _no_find(monkeypatch)
    problem = _patch_problem()
    choice = dispatch.choose(problem)
    assert choice.source == "estimate"
    assert choice.solver == dispatch.decide(problem).solver


def test_database_hit_naming_a_disabled_solver_is_ignored(monkeypatch):
    _no_find(monkeypatch)
    problem = _patch_problem()
    _store(problem, "im2col")
    monkeypatch.setenv("GEMMCONV_DISABLE", "im2col")
    choice = dispatch.choose(problem)
    assert choice.solver != "im2col" and choice.source == "estimate"


def test_rows_of_another_device_are_not_hits(monkeypatch):
    _no_find(monkeypatch)
    problem = _patch_problem()
    other = finddb.Identity("NVIDIA H200", "9.0", torch.__version__, gemmconv.__version__)
    finddb.get_db().store(finddb.Record(problem.key(), other, "vendor", {}, 1.0, 0))
    assert dispatch.choose(problem).source == "estimate"


# ---- find and hybrid -------------------------------------------------------------


def test_find_times_every_applicable_solver_and_stores_the_winner(monkeypatch):
    calls = count_finds(monkeypatch)
    problem = _patch_problem(direction=Direction.BACKWARD_DATA)
    with gemmconv.find_mode("find"):
        choice = dispatch.choose(problem)
        again = dispatch.choose(problem)
    assert again is choice and len(calls) == 1  # decided once, then cached
    assert set(choice.times_ms) == _applicable(problem)
    assert all(t > 0 for t in choice.times_ms.values())
    assert is_finds_pick(choice.solver, choice.times_ms, dispatch.decide(problem).solver)
    assert choice.source == "find"
    record = finddb.get_db().lookup(problem.key(), _identity())
    assert record is not None and record.solver == choice.solver
    assert record.time_ms == pytest.approx(choice.times_ms[choice.solver])


def test_hybrid_uses_a_hit_else_finds(monkeypatch):
    calls = count_finds(monkeypatch)
    hit, miss = _patch_problem(), _patch_problem(direction=Direction.BACKWARD_WEIGHTS)
    _store(hit, "vendor")
    with gemmconv.find_mode("hybrid"):
        assert dispatch.choose(hit).solver == "vendor"
        assert calls == []
        found = dispatch.choose(miss)
    assert calls == [miss] and found.source == "find"
    assert finddb.get_db().lookup(miss.key(), _identity()).solver == found.solver


def test_cudnn_benchmark_true_means_hybrid(monkeypatch):
    calls = count_finds(monkeypatch)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    choice = dispatch.choose(_patch_problem())
    assert choice.mode == "hybrid" and choice.source == "find" and len(calls) == 1


def test_find_skips_a_raising_or_out_of_memory_candidate(monkeypatch, caplog):
    def oom(self, p, t, out):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

    def broken(self, p, t, out):
        raise RuntimeError("kernel launch failed (simulated)")

    monkeypatch.setattr(VendorSolver, "forward", oom)
    monkeypatch.setattr(Im2colSolver, "forward", broken)
    problem = _patch_problem()
    with caplog.at_level(logging.WARNING, "gemmconv.dispatch"), gemmconv.find_mode("find"):
        choice = dispatch.choose(problem)
    assert choice.solver == "patch"
    assert set(choice.times_ms) == {"patch"}
    assert "out of memory" in choice.rejected["vendor"][0]
    assert "kernel launch failed" in choice.rejected["im2col"][0]
    logged = caplog.text
    assert "vendor skipped, out of memory" in logged and "im2col skipped" in logged
    assert finddb.get_db().lookup(problem.key(), _identity()).solver == "patch"


def test_find_with_every_candidate_failing_is_an_error_and_stores_nothing(monkeypatch):
    def broken(self, p, t, out):
        raise RuntimeError("simulated failure")

    for cls in (PatchSolver, Im2colSolver, VendorSolver):
        monkeypatch.setattr(cls, "forward", broken)
    problem = _patch_problem()
    with gemmconv.find_mode("find"), pytest.raises(RuntimeError, match="every candidate failed"):
        dispatch.choose(problem)
    assert finddb.get_db().lookup(problem.key(), _identity()) is None


def _fast_but_wrong(self, p, t, out):
    # Writes the right shape quickly with wrong values: only verification can tell.
    ones = torch.ones(p.output_shape, dtype=p.dtype)
    return ones if out is None else out.copy_(ones)


def test_find_verify_drops_a_wrong_candidate(monkeypatch):
    monkeypatch.setattr(Im2colSolver, "forward", _fast_but_wrong)
    problem = _patch_problem()
    monkeypatch.setenv("GEMMCONV_FIND_VERIFY", "1")
    with gemmconv.find_mode("find"):
        choice = dispatch.choose(problem)
    assert "im2col" not in choice.times_ms
    assert choice.rejected["im2col"][0].startswith("skipped in find: verification FAILED")
    assert choice.solver in {"patch", "vendor"}


def test_without_find_verify_a_wrong_candidate_is_timed(monkeypatch):
    # The counterpart of the test above: it is verification that drops the candidate.
    monkeypatch.setattr(Im2colSolver, "forward", _fast_but_wrong)
    with gemmconv.find_mode("find"):
        choice = dispatch.choose(_patch_problem())
    assert "im2col" in choice.times_ms


def test_find_does_not_store_a_search_restricted_by_disable(monkeypatch):
    monkeypatch.setenv("GEMMCONV_DISABLE", "vendor")
    problem = _patch_problem()
    with gemmconv.find_mode("find"):
        choice = dispatch.choose(problem)
    assert "vendor" not in choice.times_ms
    assert finddb.get_db().lookup(problem.key(), _identity()) is None


def test_find_operands_are_random_and_in_the_problem_layout():
    problem = _patch_problem(layout=Layout.CHANNELS_LAST, direction=Direction.BACKWARD_WEIGHTS)
    t = measure.operands(problem, torch.device("cpu"))
    assert t.weight is None and t.bias is None
    for x in (t.input, t.grad_output):
        assert x.movedim(1, -1).is_contiguous()
        assert x.abs().min() > 0 or x.std() > 0.4  # uniform(-1, 1), never zeros
    again = measure.operands(problem, torch.device("cpu"))
    assert torch.equal(t.input, again.input)  # seeded


# ---- forced and disabled solvers ---------------------------------------------------


@pytest.mark.parametrize("mode", ["immediate", "database", "find", "hybrid"])
def test_forced_solver_wins_in_every_mode(monkeypatch, mode):
    _no_find(monkeypatch)
    monkeypatch.setenv("GEMMCONV_SOLVER", "im2col")
    with gemmconv.find_mode(mode):
        choice = dispatch.choose(_patch_problem())
    assert choice.solver == "im2col" and choice.source == "forced"


def test_forced_by_argument_beats_the_environment(monkeypatch):
    monkeypatch.setenv("GEMMCONV_SOLVER", "im2col")
    assert dispatch.solver_for(_patch_problem(), solver="vendor").id == "vendor"


def test_forced_solver_that_does_not_apply_lists_its_reasons():
    with pytest.raises(RuntimeError, match=r"'pointwise' was forced.*kernel \(4, 4\) is not 1x1"):
        dispatch.choose(_patch_problem(), solver="pointwise")


def test_unknown_forced_solver_lists_the_known_ones(monkeypatch):
    monkeypatch.setenv("GEMMCONV_SOLVER", "winograd")
    with pytest.raises(ValueError, match="'winograd'.*expected one of.*im2col"):
        dispatch.choose(_patch_problem())


def test_disabled_solvers_are_never_chosen(monkeypatch):
    problem = _patch_problem()
    with gemmconv.find_mode("immediate"):
        first = dispatch.choose(problem).solver
        monkeypatch.setenv("GEMMCONV_DISABLE", f" {first} ,vendor")
        choice = dispatch.choose(problem)
    assert choice.solver not in (first, "vendor")
    assert choice.rejected[first] == ["disabled by GEMMCONV_DISABLE"]


def test_disabling_everything_that_applies_lists_every_reason(monkeypatch):
    monkeypatch.setenv("GEMMCONV_DISABLE", ",".join(_applicable(_patch_problem())))
    with pytest.raises(RuntimeError, match="no solver applies.*disabled by GEMMCONV_DISABLE"):
        dispatch.choose(_patch_problem())


def test_unknown_disabled_id_is_an_error(monkeypatch):
    monkeypatch.setenv("GEMMCONV_DISABLE", "patch,fft")
    with pytest.raises(ValueError, match="GEMMCONV_DISABLE='patch,fft'.*fft"):
        dispatch.choose(_patch_problem())


def test_forcing_a_disabled_solver_is_an_error(monkeypatch):
    monkeypatch.setenv("GEMMCONV_DISABLE", "im2col")
    with pytest.raises(ValueError, match="forced and also listed"):
        dispatch.choose(_patch_problem(), solver="im2col")


# ---- caching and logging -----------------------------------------------------------


def test_decisions_are_cached_per_problem_mode_and_solver_set(monkeypatch):
    decided = []
    real = dispatch._decide_in_mode

    def counting(problem, mode, forced, disabled, *more):
        decided.append((mode, forced, disabled, *more))
        return real(problem, mode, forced, disabled, *more)

    monkeypatch.setattr(dispatch, "_decide_in_mode", counting)
    problem = _patch_problem()
    for _ in range(3):
        dispatch.choose(problem)
    assert len(decided) == 1
    with gemmconv.find_mode("immediate"):
        dispatch.choose(problem)
    dispatch.choose(problem, solver="vendor")
    monkeypatch.setenv("GEMMCONV_DISABLE", "vendor")
    dispatch.choose(problem)
    dispatch.choose(problem)
    assert len(decided) == 4
    with gemmconv.batch_invariant():  # the batch-invariance switch is part of the state
        dispatch.choose(problem)
        dispatch.choose(problem)
    assert len(decided) == 5
    dispatch.clear_cache()
    dispatch.choose(problem)
    assert len(decided) == 6


def test_every_decision_is_logged_and_vendor_fallback_at_info(monkeypatch, caplog):
    general = ConvProblem.from_sizes(2, 4, 4, (6, 6), 3, padding=1)  # a 3x3 conv
    monkeypatch.setenv("GEMMCONV_DISABLE", "im2col")
    with caplog.at_level(logging.DEBUG, "gemmconv.dispatch"):
        dispatch.choose(_gemm_sized_patch_problem())
        dispatch.choose(general)
    levels = {r.getMessage().split(" ")[0]: r.levelno for r in caplog.records}
    assert levels[_gemm_sized_patch_problem().key()] == logging.DEBUG
    assert levels[general.key()] == logging.INFO
    assert "-> vendor" in caplog.text


def test_convolution_runs_the_found_solver_and_is_correct(monkeypatch):
    g = torch.Generator().manual_seed(0)
    x = torch.rand(4, 3, 8, 8, generator=g, requires_grad=True)
    w = torch.rand(8, 3, 4, 4, generator=g, requires_grad=True)
    with gemmconv.find_mode("find"):
        y = gemmconv.conv2d(x, w, stride=4)
        y.backward(torch.rand(y.shape, generator=g))
    expected = torch.nn.functional.conv2d(x.double(), w.double(), stride=4)
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)
    stored = {r.problem.rsplit("-", 2)[-2] for r in finddb.get_db().records()}
    assert stored == {"forward", "backward_data", "backward_weights"}


# ---- the cost model on the benchmark suite ---------------------------------------------

# The benchmark suite's cases (gemmconv.bench.suite.SUITE): (name, N, C, spatial, K, kernel =
# stride, dtype).
SUITE = [
    ("point 2D", 9500, 3, (14, 14), 1280, (14, 14), torch.bfloat16),
    ("point 3D", 9500, 3, (2, 14, 14), 1280, (2, 14, 14), torch.bfloat16),
    ("ViT-B/16", 256, 3, (224, 224), 768, (16, 16), torch.bfloat16),
    ("CLIP-L/14 336", 128, 3, (336, 336), 1024, (14, 14), torch.bfloat16),
    ("SAM ViT-H", 8, 3, (1024, 1024), 1280, (16, 16), torch.bfloat16),
    ("VideoMAE", 16, 3, (16, 224, 224), 768, (2, 16, 16), torch.bfloat16),
    ("DiT-XL/2", 256, 4, (32, 32), 1152, (2, 2), torch.bfloat16),
    ("ConvNeXt down", 128, 192, (56, 56), 384, (2, 2), torch.bfloat16),
    ("ResNet 1x1", 256, 256, (56, 56), 64, (1, 1), torch.bfloat16),
    ("point 2D fp16", 9500, 3, (14, 14), 1280, (14, 14), torch.float16),
    ("point 2D fp32", 9500, 3, (14, 14), 1280, (14, 14), torch.float32),
]


def suite_problems(device_type: str):
    for name, n, c, spatial, k, kernel, dtype in SUITE:
        for layout in Layout:
            for direction in DIRECTIONS:
                problem = ConvProblem.from_sizes(
                    n,
                    c,
                    k,
                    spatial,
                    kernel,
                    stride=kernel,
                    layout=layout,
                    dtype=dtype,
                    device_type=device_type,
                    direction=direction,
                )
                yield f"{name} {layout.value} {direction.value}", problem


@pytest.mark.parametrize(("device_type", "rates"), [("cuda", H200), ("cpu", CPU)])
def test_immediate_picks_a_gemm_solver_for_every_suite_problem(device_type, rates):
    not_gemm = {"vendor", "im2col"}
    picks, problems = {}, {}
    for label, problem in suite_problems(device_type):
        problems[label] = problem
        applicable = [s for s in SOLVERS if s.is_applicable(problem)]
        assert set(s.id for s in applicable) - not_gemm, f"{label}: no GEMM solver applies"
        picks[label] = dispatch.decide(problem, applicable, rates=rates).solver
    # The vendor may win only where the H200 measured it within 10% of every GEMM
    # solver (DiT-XL/2 and ConvNeXt channels-first weight gradients, bench/results),
    # and on the CPU where its fit measured it as fast as a GEMM (device_rates.CPU).
    wrong = {
        label: solver
        for label, solver in picks.items()
        if solver in not_gemm
        and not (
            solver == "vendor"
            and (
                vendor_measured_competitive(problems[label], tolerance=0.10)
                if device_type == "cuda"
                else vendor_efficiency(problems[label], rates) >= 1.0
            )
        )
    }
    assert not wrong, wrong
    assert len(picks) == len(SUITE) * 2 * 3


def test_tiny_problems_go_to_the_vendor_where_host_time_dominates():
    # Two output pixels of a 4x4 patch: every solver's device time is a few
    # microseconds, so the call costs its launches, and the vendor issues one.
    tiny = ConvProblem.from_sizes(2, 3, 8, (8, 8), 4, stride=4, dtype=torch.bfloat16,
                                  device_type="cuda")  # fmt: skip
    solvers = [s for s in SOLVERS if s.id in ("patch", "vendor")]
    assert dispatch.decide(tiny, solvers, rates=H200).solver == "vendor"
    assert dispatch.decide(tiny, solvers, rates=CPU).solver == "vendor"
    vit = ConvProblem.from_sizes(256, 3, 768, (224, 224), 16, stride=16, dtype=torch.bfloat16,
                                 device_type="cuda")  # fmt: skip
    assert dispatch.decide(vit, solvers, rates=H200).solver == "patch"
    patch = get_solver("patch")
    # On a GPU the host runs ahead: a call costs the larger of the two times.
    assert patch.call_ms(tiny, H200) == pytest.approx(patch.host_ms(tiny, H200))
    assert patch.call_ms(vit, H200) == pytest.approx(patch.estimate_ms(vit, H200))
    # On a CPU the host does the work: the two add up.
    assert patch.call_ms(tiny, CPU) == pytest.approx(
        patch.host_ms(tiny, CPU) + patch.estimate_ms(tiny, CPU)
    )


def test_unaligned_reduction_costs_more_on_the_h200_only():
    # Compute-bound on an H200 (Kred about 1000), so the GEMM's time dominates the estimate.
    def problem(c):
        return ConvProblem.from_sizes(64, c, 1024, (32, 32), 2, stride=2, dtype=torch.bfloat16)

    aligned, unaligned = problem(256), problem(255)
    patch = get_solver("patch")
    assert patch.gemm_is_aligned(aligned) and not patch.gemm_is_aligned(unaligned)

    def per_flop(problem, rates):
        return patch.estimate_ms(problem, rates) / problem.flops()

    assert per_flop(unaligned, H200) > 1.5 * per_flop(aligned, H200)
    assert per_flop(unaligned, CPU) == pytest.approx(per_flop(aligned, CPU), rel=0.05)


# ---- distributed: no call communicates --------------------------------------------------

# Every collective and point-to-point call of torch.distributed that could carry a choice.
_COLLECTIVES = (
    "all_gather", "all_gather_object", "all_reduce", "all_to_all", "barrier", "broadcast",
    "broadcast_object_list", "gather", "gather_object", "irecv", "isend", "recv", "reduce",
    "scatter", "scatter_object_list", "send",
)  # fmt: skip


@pytest.mark.parametrize("mode", [m.value for m in FindMode])
def test_no_call_communicates_in_a_distributed_run(mode, monkeypatch):
    # A process group of two ranks as selection sees it, where any collective fails:
    # a convolution, explain() or module.solvers() on one rank alone must not issue one.
    dist = torch.distributed
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)

    def collective(*args, **kwargs):
        raise AssertionError("a collective was issued")

    for name in _COLLECTIVES:
        monkeypatch.setattr(dist, name, collective)
    torch.manual_seed(0)
    module = torch.nn.Conv2d(3, 8, 2, stride=2)
    gemmconv.convert(module)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    with gemmconv.find_mode(mode):
        module(x).sum().backward()
        assert set(module.solvers()) == {d.value for d in DIRECTIONS}
        assert set(gemmconv.explain(torch.randn(3, 3, 6, 6), module.weight, stride=3)) == {
            d.value for d in DIRECTIONS
        }
        sources = {choice.source for choice in dispatch._cache.values()}
    assert not any(s.startswith("rank") for s in sources), sources
    reference = torch.nn.functional.conv2d(x, module.weight, module.bias, stride=2)
    torch.testing.assert_close(module(x), reference)


def _rank_one_of_two(monkeypatch, rank0_choices: list) -> None:
    """torch.distributed as rank 1 of two, rank 0 having made ``rank0_choices``."""
    dist = torch.distributed
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)

    def all_gather_object(out, obj, group=None):
        out[:] = [(rank0_choices, {}), obj]

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)


def test_sync_choices_adopts_the_lowest_ranks_choice_for_every_problem(monkeypatch):
    mine, theirs = _gemm_sized_patch_problem(), _patch_problem()
    state = dispatch.selection_state()
    with gemmconv.find_mode("database"):
        own = dispatch.choose(mine)
    other = next(sid for sid in sorted(_applicable(mine)) if sid != own.solver)
    rank0 = [
        ((mine, state), dataclasses.replace(own, solver=other, source="find", reason="r0")),
        ((theirs, state), dispatch.Choice("vendor", {}, {}, "r0", "database", "find")),
    ]
    memo = dispatch.dependent_cache()
    memo["plan"] = own.solver
    _rank_one_of_two(monkeypatch, rank0)
    assert gemmconv.sync_choices() == 2
    adopted = dispatch._cache[(mine, state)]
    assert (adopted.solver, adopted.source, adopted.reason) == (other, "rank 0", "rank 0: r0")
    assert dispatch._cache[(theirs, state)].solver == "vendor"  # never met here, now known
    assert memo == {}  # what was derived from the replaced choice is derived again
    with gemmconv.find_mode("database"):
        assert dispatch.choose(theirs).source == "rank 0"
    # A second sync changes nothing.
    assert gemmconv.sync_choices() == 0


def test_sync_choices_keeps_its_own_choice_where_rank_zeros_does_not_apply(monkeypatch, caplog):
    general = ConvProblem.from_sizes(2, 3, 8, (8, 8), 3, padding=1)
    assert "patch" not in _applicable(general)
    state = dispatch.selection_state()
    with gemmconv.find_mode("database"):
        own = dispatch.choose(general)
    _rank_one_of_two(monkeypatch, [((general, state), dataclasses.replace(own, solver="patch"))])
    with caplog.at_level(logging.WARNING, "gemmconv.dispatch"):
        assert gemmconv.sync_choices() == 0
    assert dispatch._cache[(general, state)] == own
    assert "rank 0 chose patch, which does not apply on rank 1" in caplog.text


def test_the_tf32_flag_is_part_of_the_selection_state(monkeypatch):
    fp32 = ConvProblem.from_sizes(4, 3, 8, (8, 8), 4, stride=4, device_type="cuda")
    bf16 = dataclasses.replace(fp32, dtype=torch.bfloat16)
    decided = []
    original = dispatch._decide_in_mode
    monkeypatch.setattr(dispatch, "_decide_in_mode", lambda *a: decided.append(a) or original(*a))
    saved = torch.backends.cudnn.allow_tf32
    try:
        states, keys = [], []
        for flag in (True, False, True):
            torch.backends.cudnn.allow_tf32 = flag
            states.append(dispatch.selection_state())
            keys.append(dispatch.database_key(fp32))
            with gemmconv.find_mode("immediate"):
                dispatch.choose(fp32)
            assert dispatch.database_key(bf16) == bf16.key()  # only fp32's math mode varies
    finally:
        torch.backends.cudnn.allow_tf32 = saved
    assert [s.allow_tf32 for s in states] == [True, False, True]
    assert keys == [f"{fp32.key()}-tf32", f"{fp32.key()}-ieee", f"{fp32.key()}-tf32"]
    assert len(decided) == 2  # one choice per flag value, the third call a cache hit


def _estimated(problem: ConvProblem, rates) -> str:
    return dispatch.decide(problem, list(SOLVERS), rates=rates).solver


def test_the_vendors_few_sample_patch_forward_is_priced_by_its_reduction():
    # cuDNN's forward kernel walked ViT-B/16's 768-element reduction in 80 us at batch
    # 1 and Qwen2-VL's 1176 in 117 for one patch (H100, small_batch_h100.txt): the
    # floor-based price alone said a few us and sent both to cuDNN.
    vendor = get_solver("vendor")
    vit_b1 = ConvProblem.from_sizes(1, 3, 768, (224, 224), 16, stride=16,
                                    dtype=torch.bfloat16, device_type="cuda")  # fmt: skip
    qwen_b1 = ConvProblem.from_sizes(1, 3, 1280, (2, 14, 14), (2, 14, 14), stride=(2, 14, 14),
                                     dtype=torch.bfloat16, device_type="cuda")  # fmt: skip
    floor_priced = dataclasses.replace(H200, vendor_patch_forward_us_per_reduction=0.0)
    for problem, kernel_us in ((vit_b1, 80), (qwen_b1, 117)):
        assert vendor.estimate_ms(problem, H200) * 1000 == pytest.approx(kernel_us, rel=0.1)
        assert vendor.estimate_ms(problem, floor_priced) * 1000 < 30
        assert _estimated(problem, H200) != "vendor"
        # Only the forward has the least time; the backward directions keep their factors.
        for direction in (Direction.BACKWARD_DATA, Direction.BACKWARD_WEIGHTS):
            backward = problem.with_direction(direction)
            assert vendor.estimate_ms(backward, H200) == vendor.estimate_ms(backward, floor_priced)
    # A full batch is priced by its factor, far above the least time.
    vit_b256 = dataclasses.replace(vit_b1, n=256)
    assert vendor.estimate_ms(vit_b256, H200) == vendor.estimate_ms(vit_b256, floor_priced)
    # The CPU table has no least time: oneDNN's is priced as before.
    assert CPU.vendor_patch_forward_us_per_reduction == 0.0


def test_im2col_pays_its_copies_and_views_on_the_host():
    # ViT-B/16's channels-first forward at batch 32: im2col issued 100 us of host work
    # (two copies, its GEMM, a dozen views) where it was priced at one op, and was
    # chosen over patch_implicit, whose call ran 44 us against its 117 on an H100.
    vit_b32 = ConvProblem.from_sizes(32, 3, 768, (224, 224), 16, stride=16,
                                     dtype=torch.bfloat16, device_type="cuda")  # fmt: skip
    im2col = get_solver("im2col")
    assert im2col.host_ms(vit_b32, H200) * 1000 >= 85
    assert _estimated(vit_b32, H200) == "patch_implicit"
    # Each direction counts its own: the bias's addition, backward-data's zero fill and
    # per-tap accumulations.
    with_bias = dataclasses.replace(vit_b32, has_bias=True)
    assert im2col.host_launches(with_bias) == im2col.host_launches(vit_b32) + 1
    data = vit_b32.with_direction(Direction.BACKWARD_DATA)
    assert im2col.host_launches(data) == im2col.host_launches(vit_b32) + 256 + 1
