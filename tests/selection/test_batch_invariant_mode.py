"""The batch-invariance switch as selection sees it: how it is set (context manager,
setter, environment), that it is part of every cache key and of the find database's
keys, that the default selection is unchanged, and what explain() and the warning say
where a forward cannot be made invariant."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import gemmconv
from gemmconv.core import invariance
from gemmconv.core.memory_format import Layout
from gemmconv.core.problem import ConvProblem, Direction
from gemmconv.selection import dispatch, finddb

PATCH = ConvProblem.from_sizes(8, 3, 16, (8, 8), 4, 4)  # a patch embed: invariant on the CPU
GENERAL = ConvProblem.from_sizes(8, 3, 16, (8, 8), 3, 1, padding=1)  # a 3x3: never


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """The warn-once set is the process's: another test on this worker that met the
    same geometry first would silence a test's expected warning."""
    monkeypatch.setattr(dispatch, "_warned_variant", set())


def test_off_by_default_and_set_three_ways(monkeypatch):
    assert not invariance.batch_invariant_enabled()
    monkeypatch.setenv("GEMMCONV_BATCH_INVARIANT", "1")
    assert invariance.batch_invariant_enabled()
    gemmconv.set_batch_invariant(False)  # the setter wins over the environment
    assert not invariance.batch_invariant_enabled()
    with gemmconv.batch_invariant() as on:  # and the block over the setter
        assert on is True and invariance.batch_invariant_enabled()
    assert not invariance.batch_invariant_enabled()
    gemmconv.set_batch_invariant(None)  # back to the environment
    assert invariance.batch_invariant_enabled()
    monkeypatch.setenv("GEMMCONV_BATCH_INVARIANT", "off")
    assert not invariance.batch_invariant_enabled()


def test_blocks_nest_and_restore_on_exceptions():
    gemmconv.set_batch_invariant(True)
    with gemmconv.batch_invariant(False):
        assert not invariance.batch_invariant_enabled()
        with pytest.raises(KeyError):
            with gemmconv.batch_invariant(True):
                assert invariance.batch_invariant_enabled()
                raise KeyError("inside")
        assert not invariance.batch_invariant_enabled()
    assert invariance.batch_invariant_enabled()
    gemmconv.set_batch_invariant(None)
    assert not invariance.batch_invariant_enabled()


def test_process_wide_across_threads():
    """Like the find mode: a thread (the autograd engine's) sees the block's setting."""
    import threading

    seen = []
    with gemmconv.batch_invariant():
        thread = threading.Thread(target=lambda: seen.append(invariance.batch_invariant_enabled()))
        thread.start()
        thread.join()
    assert seen == [True]


def test_bad_settings_are_refused(monkeypatch):
    with pytest.raises(TypeError, match=r"enabled='yes': expected True or False"):
        gemmconv.set_batch_invariant("yes")
    with pytest.raises(TypeError, match="enabled=1"):
        with gemmconv.batch_invariant(1):
            pass
    monkeypatch.setenv("GEMMCONV_BATCH_INVARIANT", "maybe")
    with pytest.raises(ValueError, match=r"GEMMCONV_BATCH_INVARIANT='maybe': expected one of"):
        dispatch.selection_state()


def test_part_of_the_selection_key_and_state(monkeypatch):
    default_key = dispatch.selection_key()
    with gemmconv.batch_invariant():
        assert dispatch.selection_key() != default_key
        assert dispatch.selection_state().batch_invariant
    gemmconv.set_batch_invariant(True)
    assert dispatch.selection_key() != default_key
    gemmconv.set_batch_invariant(None)
    assert dispatch.selection_key() == default_key
    monkeypatch.setenv("GEMMCONV_BATCH_INVARIANT", "1")
    assert dispatch.selection_key() != default_key


def test_default_choice_unchanged_and_cached_apart():
    """The switch never changes what the default selection picks, and the two choices
    are cached under their own states."""
    problem = PATCH  # torch's convolution by default on the CPU, a GEMM under the switch
    before = dispatch.choose(problem)
    with gemmconv.batch_invariant():
        inside = dispatch.choose(problem)
    assert before.solver == dispatch.estimate(problem).solver
    assert inside.solver != before.solver
    assert dispatch.choose(problem) is before
    assert not gemmconv.get_solver(inside.solver).invariance_reasons(problem)
    dispatch.clear_cache()
    assert dispatch.choose(problem) == before
    # Backward directions are chosen as without the switch.
    for direction in (Direction.BACKWARD_DATA, Direction.BACKWARD_WEIGHTS):
        plain = dispatch.choose(problem.with_direction(direction)).solver
        with gemmconv.batch_invariant():
            assert dispatch.choose(problem.with_direction(direction)).solver == plain


def test_database_rows_are_kept_apart():
    plain = dispatch.database_key(PATCH)
    with gemmconv.batch_invariant():
        assert dispatch.database_key(PATCH) == f"{plain}-invariant"
        backward = PATCH.with_direction(Direction.BACKWARD_DATA)
        assert not dispatch.database_key(backward).endswith("-invariant")


def test_a_stored_variant_pick_is_not_used():
    """A row naming a solver that is not invariant (here under the invariant key
    itself, as a hand-edited or foreign database could hold) is a miss."""
    with gemmconv.batch_invariant():
        record = finddb.Record(dispatch.database_key(PATCH), finddb.identity_for("cpu"),
                               "vendor", {}, 0.001, 0)  # fmt: skip
        finddb.get_db().store(record)
        choice = dispatch.choose(PATCH)
    assert choice.solver != "vendor" and choice.source == "estimate"


def test_non_invariant_solvers_are_listed_with_why():
    with gemmconv.batch_invariant():
        choice = dispatch.choose(PATCH)
    assert choice.solver in ("patch", "point_output")
    assert choice.rejected["vendor"][0].startswith("not batch-invariant: torch's convolution")
    assert choice.rejected["im2col"][0].startswith("not batch-invariant")


def test_explain_and_warn_once_where_it_cannot():
    x = torch.randn(8, 3, 8, 8)
    w = torch.randn(16, 3, 3, 3)
    with gemmconv.batch_invariant():
        with pytest.warns(UserWarning, match=r"cannot be made batch-invariant: no batch-invariant"):
            explained = gemmconv.explain(x, w, padding=1)
        assert "NOT batch-invariant" in explained["forward"].reason
        assert any("NOT batch-invariant" in note for note in explained.notes)
        assert "NOT batch-invariant" in repr(explained)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once a problem, whatever its batch size
            gemmconv.conv2d(x, w, padding=1)
            gemmconv.conv2d(x[:3], w, padding=1)
        module = gemmconv.nn.Conv2d(3, 16, 3, padding=1)
        assert any("NOT batch-invariant" in n for n in module.solvers(x).notes)
    assert "batch" not in repr(gemmconv.explain(x, w, padding=1))


def test_explain_says_invariant_where_it_is():
    x = torch.randn(8, 3, 8, 8)
    w = torch.randn(16, 3, 4, 4)
    with gemmconv.batch_invariant():
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            explained = gemmconv.explain(x, w, stride=4)
    assert explained.notes[0].startswith("batch_invariant is on: the forward (patch) is batch-inv")


def test_fp64_on_the_cpu_is_reported():
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    w = torch.randn(16, 3, 4, 4, dtype=torch.float64)
    with gemmconv.batch_invariant(), pytest.warns(UserWarning, match="fp64 rows"):
        assert "NOT batch-invariant" in gemmconv.explain(x, w, stride=4)["forward"].reason


def test_a_forced_variant_solver_warns(monkeypatch):
    monkeypatch.setenv("GEMMCONV_SOLVER", "vendor")
    with gemmconv.batch_invariant(), pytest.warns(UserWarning, match="vendor is forced"):
        choice = dispatch.choose(PATCH)
    assert choice.solver == "vendor" and "NOT batch-invariant" in choice.reason


def test_find_mode_times_only_invariant_solvers():
    with gemmconv.batch_invariant(), gemmconv.find_mode("find"):
        choice = dispatch.choose(PATCH)
    assert set(choice.times_ms) <= {"patch", "point_output", "pointwise", "strided_pointwise"}
    assert choice.times_ms, choice
    stored = finddb.get_db().lookup(f"{PATCH.key()}-invariant", finddb.identity_for("cpu"))
    assert stored is not None and stored.solver == choice.solver
    assert finddb.get_db().lookup(PATCH.key(), finddb.identity_for("cpu")) is None


def test_general_problem_falls_back_to_the_default_choice():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with gemmconv.batch_invariant():
            inside = dispatch.choose(GENERAL).solver
    assert inside == dispatch.choose(GENERAL).solver


# ---- CUDA: one family of invariant solvers per geometry, whatever the batch ---------

CUDA_GEOMETRIES = {
    # label: (C, K, spatial, kernel, stride, layout, dtype, the family that serves it)
    "vit_cf": (3, 768, (224, 224), 16, 16, "channels_first", torch.bfloat16, "implicit"),
    "vit_cl": (3, 768, (224, 224), 16, 16, "channels_last", torch.bfloat16, "implicit"),
    "clip_unaligned": (3, 1024, (336, 336), 14, 14, "channels_first", torch.bfloat16, "implicit"),
    "point_output": (3, 1280, (14, 14), 14, 14, "channels_last", torch.bfloat16, "implicit"),
    "sd3_fp32": (16, 1536, (64, 64), 2, 2, "channels_first", torch.float32, "columns"),
    "point_fp64": (3, 64, (8, 8), 8, 8, "channels_first", torch.float64, "columns"),
    "resnet_1x1_cf": (256, 64, (56, 56), 1, 1, "channels_first", torch.bfloat16, "pointwise"),
    "resnet_1x1_cl": (256, 64, (56, 56), 1, 1, "channels_last", torch.bfloat16, "implicit"),
    "one_pixel_1x1": (64, 32, (1, 1), 1, 1, "channels_first", torch.float16, "pointwise"),
    "strided_1x1": (64, 128, (56, 56), 1, 2, "channels_last", torch.bfloat16, "strided"),
}
FAMILIES = {
    "columns": {"patch", "point_output", "patch_triton"},
    "pointwise": {"pointwise"},
    "strided": {"strided_pointwise"},
    "implicit": {"patch_implicit"},
}
# 1, 7 and 64 samples, and one batch whose column matrix or output passes 2^31 elements.
CUDA_BATCHES = (1, 7, 64, 1 << 16)


def _cuda_problem(label: str, n: int) -> ConvProblem:
    c, k, spatial, kernel, stride, layout, dtype, _ = CUDA_GEOMETRIES[label]
    return ConvProblem.from_sizes(n, c, k, spatial, kernel, stride, layout=Layout(layout),
                                  dtype=dtype, device_type="cuda", has_bias=True)  # fmt: skip


def _invariant_applicable(problem: ConvProblem) -> set[str]:
    return {
        s.id
        for s in gemmconv.solvers.SOLVERS
        if s.is_applicable(problem) and not s.invariance_reasons(problem)
    }


@pytest.mark.parametrize("label", CUDA_GEOMETRIES)
def test_cuda_one_family_for_every_batch(label):
    """On CUDA under the switch the solvers that may serve a forward are one family
    (the column and pointwise solvers' chunked cuBLAS GEMM, whose members multiply the
    same canonical matrix in the same chunks, or the implicit Triton GEMM), decided by
    the geometry, never by the batch size: the applicability limits that grow with the
    batch (2^31-element operands) do not remove the family, and the other family,
    whose bits differ, stands aside."""
    family = FAMILIES[CUDA_GEOMETRIES[label][-1]]
    # The implicit GEMM indexes in 32 bits: past 2^31 elements it is refused, and the
    # forward runs as without the switch, warned (test_cuda_implicit_family_past_int32).
    batches = CUDA_BATCHES[:-1] if family == FAMILIES["implicit"] else CUDA_BATCHES
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "cannot be made batch-invariant"
        with gemmconv.batch_invariant():
            for n in batches:
                problem = _cuda_problem(label, n)
                serving = _invariant_applicable(problem)
                assert serving and serving <= family, (n, serving)
                choice = dispatch.choose(problem)
                assert choice.solver in family, (n, choice)
                assert "NOT batch-invariant" not in choice.reason
                # The other family stands aside, by its invariance reason.
                other = "patch" if family == FAMILIES["implicit"] else "patch_implicit"
                if other == "patch" and all(r == 1 for r in problem.kernel):
                    other = "pointwise"
                assert other in choice.rejected, (n, choice.rejected)


def test_cuda_implicit_family_past_int32():
    """A half-precision patch problem whose operands pass 2^31 elements (65536 ViT
    images) has no batch-invariant solver on CUDA: the implicit GEMM's 32-bit indexing
    refuses it and the chunked family is not its form. It says so and warns once."""
    problem = _cuda_problem("vit_cf", 1 << 16)
    with gemmconv.batch_invariant():
        assert not _invariant_applicable(problem)
        with pytest.warns(UserWarning, match="cannot be"):
            choice = dispatch.choose(dataclasses.replace(problem, n=(1 << 16) + 1))
    assert "NOT batch-invariant" in choice.reason


def test_cuda_huge_batch_keeps_the_column_family():
    """At 65536 ViT images the column matrix has 9.9e9 elements: the Triton gather's
    solver is refused for it, patch (torch's gather) keeps the same product."""
    problem = _cuda_problem("vit_cl", 1 << 16)
    with gemmconv.batch_invariant():
        assert not gemmconv.get_solver("patch_triton").is_applicable(problem)
        assert gemmconv.get_solver("patch").is_applicable(problem)
    # Without the switch the 32-bit limit still holds for the whole column matrix.
    assert not gemmconv.get_solver("patch").is_applicable(problem)


def test_cuda_implicit_serves_where_cublas_is_refused(monkeypatch):
    """Under torch.use_deterministic_algorithms without CUBLAS_WORKSPACE_CONFIG every
    cuBLAS solver is refused, for every batch: the implicit Triton GEMM is then the
    invariant form of patch problems."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    torch.use_deterministic_algorithms(True)
    try:
        with gemmconv.batch_invariant():
            for n in (1, 7, 64):
                problem = _cuda_problem("vit_cf", n)
                assert _invariant_applicable(problem) == {"patch_implicit"}
                assert dispatch.choose(problem).solver == "patch_implicit"
    finally:
        torch.use_deterministic_algorithms(False)


def test_cuda_costs_change_under_the_switch_only():
    """The column solvers' cost on CUDA follows the invariant form (its rows and one
    transpose, no rows path; a launch per chunk) under the switch only."""
    problem = _cuda_problem("vit_cf", 256)  # 196 pixels a sample: the rows path by default
    solver = gemmconv.get_solver("patch_triton")
    assert solver.uses_rows_path(problem)
    default_launches = solver.gemm_launches(problem)
    with gemmconv.batch_invariant():
        assert not solver.uses_rows_path(problem)
        assert solver.gemm_launches(problem) > 1
    assert solver.uses_rows_path(problem) and solver.gemm_launches(problem) == default_launches
