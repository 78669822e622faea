"""The end-to-end benchmark (gemmconv bench --models): the quick CPU run goes through
every eager scenario and variant and writes the issue's schema; the CUDA-only scenarios
are reported as not run, never as passed; a variant whose output disagrees with
torch's fails the run; the verdicts follow from the times; flags are checked."""

from __future__ import annotations

import json

import pytest
import torch

import gemmconv.bench.models as bench_models
import gemmconv.bench.scenarios as e2e
from gemmconv.bench.linear_patch_embed import LinearPatchEmbed
from gemmconv.bench.models import main, verdicts
from gemmconv.bench.scenarios import SCENARIOS, VARIANTS, qwen_grid, scenarios

pytest.importorskip("timm")
pytest.importorskip("transformers")

ISSUE_SCENARIOS = {
    "vit_b16_train_b256", "vit_b16_infer_b1", "vit_b16_infer_b32", "vit_b16_infer_b256",
    "qwen2vl_patch_embed_fwd", "qwen2vl_patch_embed_fwd_bwd", "convnext_tiny_train_b128_cl",
    "vit_b16_train_b256_compiled", "vit_b16_infer_b8_cudagraphs", "qwen2vl_vision_infer_8192",
}  # fmt: skip
EAGER = [s.name for s in SCENARIOS if not s.cuda_only]
# What a quick run calls them: the tiny model's batch, never the full one.
QUICK = {s.name: s.shown_name(True) for s in SCENARIOS}
# Each scenario's multiple of the run's --steps (the patch embeds take more).
STEPS_MULTIPLE = {QUICK[s.name]: s.steps_multiple for s in SCENARIOS}
CUDA_ONLY = {"vit_b16_train_b256_compiled", "vit_b16_infer_b8_cudagraphs"}


def test_scenarios_are_the_issues():
    assert {s.name for s in SCENARIOS} == ISSUE_SCENARIOS
    assert {s.name for s in SCENARIOS if s.cuda_only} == CUDA_ONLY
    assert VARIANTS == ("torch", "converted", "converted_channels_last", "linear")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e")
    code = main(["--models", "--device", "cpu", "--quick", "--steps", "1", "--warmup", "1",
                 "--out", str(out)])  # fmt: skip
    return code, json.loads((out / "cpu_e2e.json").read_text()), (out / "cpu_e2e.md").read_text()


def test_quick_cpu_run_steps_every_eager_scenario_and_variant(quick_run):
    code, data, _ = quick_run
    assert code == 0
    assert data["device"] == "cpu" and data["quick"] and data["torch"] == torch.__version__
    assert data["errors"] == [] and data["not_applicable"] == []
    rows = {(r["scenario"], r["variant"]): r for r in data["rows"]}
    assert set(rows) == {(QUICK[s], v) for s in EAGER for v in VARIANTS}
    for (scenario, variant), r in rows.items():
        assert r["ms"] > 0 and r["steps"] == STEPS_MULTIPLE[scenario], (scenario, variant)
        assert r["agrees_with_torch"] is True, (scenario, variant, r["rms_vs_torch"])
        # Every variant but torch changed the patch convolution(s) of its model.
        assert bool(r["changed_modules"]) == (variant != "torch"), (scenario, variant)
    assert rows[("tiny_qwen2vl_vision_infer_32", "linear")]["changed_modules"] == [
        "patch_embed.proj"
    ]
    assert rows[("tiny_vit_b16_infer_b1", "converted")]["batch"] == 1
    assert rows[("tiny_vit_b16_train_b2", "converted")]["batch"] == 2


def test_quick_names_say_the_batch_they_run():
    assert QUICK["vit_b16_train_b256"] == "tiny_vit_b16_train_b2"
    assert QUICK["convnext_tiny_train_b128_cl"] == "tiny_convnext_tiny_train_b2_cl"
    assert QUICK["qwen2vl_patch_embed_fwd"] == "tiny_qwen2vl_patch_embed_fwd_64"
    for s in SCENARIOS:
        tokens = QUICK[s.name].split("_")
        assert tokens[0] == "tiny" and (f"b{s.quick_batch}" in tokens or str(s.quick_batch)
                                        in tokens), s.name  # fmt: skip
        if s.batch != s.quick_batch:
            assert f"b{s.batch}" not in tokens and str(s.batch) not in tokens, s.name
    # A quick run takes a scenario by either name; a full run by its full name only.
    assert scenarios(["tiny_vit_b16_train_b2"], quick=True) == scenarios(["vit_b16_train_b256"])
    with pytest.raises(ValueError, match="tiny_vit_b16_train_b2"):
        scenarios(["tiny_vit_b16_train_b2"])


def test_cuda_only_scenarios_are_reported_not_run(quick_run):
    _, data, text = quick_run
    cuda_only = {QUICK[name] for name in CUDA_ONLY}
    assert {s["scenario"] for s in data["skipped"]} == cuda_only
    assert not cuda_only & {r["scenario"] for r in data["rows"]}
    assert not cuda_only & {v["scenario"] for v in data["verdicts"]}
    for name in cuda_only:
        assert f"- {name}: not run: needs CUDA" in text


def test_markdown_has_a_verdict_line_per_scenario(quick_run):
    _, data, text = quick_run
    assert "QUICK (tiny models, not a measurement)" in text
    assert {v["scenario"] for v in data["verdicts"]} == {QUICK[name] for name in EAGER}
    for name in map(QUICK.get, EAGER):
        (line,) = [line for line in text.splitlines() if line.startswith(f"| {name} |")]
        assert line.count("met") >= 2, line


def test_verdicts_follow_from_the_times():
    results = {"rows": [
        {"scenario": "vit_b16_train_b256", "variant": "torch", "ms": 100.0},
        {"scenario": "vit_b16_train_b256", "variant": "converted", "ms": 99.0},
        {"scenario": "vit_b16_train_b256", "variant": "converted_channels_last", "ms": 98.0},
        {"scenario": "vit_b16_train_b256", "variant": "linear", "ms": 97.0},
        {"scenario": "vit_b16_infer_b1", "variant": "torch", "ms": 10.0},
        {"scenario": "vit_b16_infer_b1", "variant": "converted", "ms": 10.05},
        {"scenario": "convnext_tiny_train_b128_cl", "variant": "torch", "ms": 50.0},
    ]}  # fmt: skip
    by_name = {v["scenario"]: v for v in verdicts(results)}
    train = by_name["vit_b16_train_b256"]
    assert train["best_converted"] == "converted_channels_last"
    assert train["vs_torch"] == pytest.approx(0.98) and train["torch_met"]
    assert train["vs_linear"] == pytest.approx(98 / 97) and not train["linear_met"]
    infer = by_name["vit_b16_infer_b1"]  # <= 1.01 x torch is enough here
    assert infer["torch_met"] and "vs_linear" not in infer
    assert "convnext_tiny_train_b128_cl" not in by_name  # no converted row: no verdict


def test_a_variant_that_disagrees_with_torch_fails_the_run(monkeypatch, tmp_path):
    class Doubled(LinearPatchEmbed):
        def forward(self, x):
            return super().forward(x) * 2

    def wrong_rewrite(model):
        model.proj = Doubled(model.proj)
        return ["proj"]

    monkeypatch.setattr(e2e, "replace_patch_convs", wrong_rewrite)
    argv = ["--device", "cpu", "--quick", "--scenarios", "qwen2vl_patch_embed_fwd", "--steps",
            "1", "--warmup", "1", "--out", str(tmp_path), "--name", "x"]  # fmt: skip
    code = main(argv)
    assert code == 1
    data = json.loads((tmp_path / "x.json").read_text())
    rows = {r["variant"]: r for r in data["rows"]}
    assert rows["linear"]["agrees_with_torch"] is False
    assert rows["converted"]["agrees_with_torch"] is True
    assert (
        "tiny_qwen2vl_patch_embed_fwd_64/linear: output DISAGREES"
        in (tmp_path / "x.md").read_text()
    )


def test_every_timed_step_follows_an_untimed_step_of_its_own_variant(monkeypatch):
    # A step right after another variant's pays for the switch (bench_models' docstring),
    # so each turn is an untimed step and a timed one of the same variant.
    calls, labels = [], iter(VARIANTS)
    real_make_step = bench_models.make_step

    def recording_make_step(*args):
        step, label = real_make_step(*args), next(labels)

        def recorded():
            calls.append(label)
            return step()

        return recorded

    monkeypatch.setattr(bench_models, "make_step", recording_make_step)
    (s,) = scenarios(["qwen2vl_patch_embed_fwd"])
    out = bench_models.run_scenario(s, torch.device("cpu"), quick=True, steps=1, warmup=1,
                                    log=lambda line: None)  # fmt: skip
    assert out["errors"] == [] and len(out["rows"]) == len(VARIANTS)
    warm_up, turns = calls[: len(VARIANTS)], calls[len(VARIANTS) :]
    assert warm_up == list(VARIANTS)
    pairs = list(zip(turns[::2], turns[1::2]))
    assert len(turns) == 2 * len(pairs) == 2 * len(VARIANTS) * s.steps_multiple
    assert all(first == second for first, second in pairs), pairs
    for r in out["rows"]:
        assert r["steps"] == s.steps_multiple == sum(p[0] == r["variant"] for p in pairs)


def test_a_spent_time_budget_runs_nothing_and_says_so(tmp_path):
    code = main(["--device", "cpu", "--quick", "--scenarios", "vit_b16_infer_b1",
                 "--time-budget", "0", "--out", str(tmp_path), "--name", "x"])  # fmt: skip
    data = json.loads((tmp_path / "x.json").read_text())
    assert code == 0 and data["truncated"] and data["rows"] == []
    assert data["skipped"] == [
        {"scenario": "tiny_vit_b16_infer_b1", "reason": "time budget of 0 s spent"}
    ]


def test_a_quick_scenario_is_held_to_its_full_size_target():
    # tiny_vit_b16_train_b2 is vit_b16_train_b256 at a tiny size: it must beat torch.
    rows = [{"scenario": "tiny_vit_b16_train_b2", "variant": "torch", "ms": 10.0},
            {"scenario": "tiny_vit_b16_train_b2", "variant": "converted", "ms": 10.05}]  # fmt: skip
    (verdict,) = verdicts({"rows": rows})
    assert verdict["torch_target"] == "< 1 (faster)" and not verdict["torch_met"]


@pytest.mark.parametrize(("bound", "met"), [(0.0, False), (float("inf"), True)])
def test_the_last_line_says_whether_the_targets_are_met(monkeypatch, tmp_path, capsys, bound,
                                                        met):  # fmt: skip
    monkeypatch.setattr(bench_models, "NOT_SLOWER_THAN_TORCH", bound)
    argv = ["--device", "cpu", "--quick", "--scenarios", "vit_b16_infer_b1", "--variants",
            "torch,converted", "--steps", "1", "--warmup", "1", "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0  # without --check, a target not met is reported only
    last = capsys.readouterr().out.splitlines()[-1]
    assert main([*argv, "--check"]) == (0 if met else 1)
    note = "(a quick run: tiny sizes, not a measurement)"
    if met:
        assert last == f"targets: all 1 met {note}"
    else:
        assert last.startswith(f"targets: 1 of 1 NOT met {note}: tiny_vit_b16_infer_b1 best/torch ")
        assert last.endswith("(target <= 0.0)")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--scenarios", "vit"], "--scenarios: scenarios=['vit']: unknown"),
        (["--variants", "torch,fast"], "--variants torch,fast: expected a comma list"),
        (["--steps", "0"], "--steps 0: expected a value >= 1"),
        (["--device", "tpu"], "--device tpu: expected cpu or cuda"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_bad_flags_are_one_usage_line_naming_the_flag(argv, message, tmp_path, capsys):
    assert main(["--device", "cpu", "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gemmconv bench --models: error: ") and err.count("\n") == 1, err
    assert message in err


def test_qwen_grid_holds_the_patches_in_mergeable_halves():
    assert qwen_grid(8192) == (1, 64, 128)
    assert qwen_grid(32) == (1, 4, 8)
    with pytest.raises(ValueError, match="patches=30"):
        qwen_grid(30)
    assert [s.name for s in scenarios(["vit_b16_infer_b1"])] == ["vit_b16_infer_b1"]


@pytest.mark.gpu
def test_quick_run_on_cuda_with_a_compiled_scenario(tmp_path):
    chosen = ["vit_b16_train_b256", "vit_b16_infer_b1", "qwen2vl_patch_embed_fwd_bwd",
              "qwen2vl_vision_infer_8192", "vit_b16_train_b256_compiled"]  # fmt: skip
    code = main(["--device", "cuda", "--quick", "--scenarios", ",".join(chosen), "--steps", "3",
                 "--out", str(tmp_path), "--name", "gpu"])  # fmt: skip
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert code == 0, data["errors"]
    assert data["skipped"] == [] and data["errors"] == []
    rows = {(r["scenario"], r["variant"]): r for r in data["rows"]}
    assert set(rows) == {(QUICK[s], v) for s in chosen for v in VARIANTS}
    for (scenario, _), r in rows.items():
        assert r["agrees_with_torch"] and r["steps"] == 3 * STEPS_MULTIPLE[scenario]
