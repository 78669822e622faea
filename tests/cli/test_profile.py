"""``gemmconv profile MODEL``: timm, Hugging Face (from a config, no download) and
factory-file models on the CPU; the table, --json on stdout and to a file, the progress
bar, and every bad MODEL as one line with exit status 2."""

from __future__ import annotations

import json
import math
import sys
import textwrap

import pytest

from gemmconv.cli import commands as cli

from conftest import RecordingBar

FAST = ("--steps", "1", "--warmup", "0", "--device", "cpu")
VIT = ("timm:vit_tiny_patch16_224", "-o", "img_size=32", "-o", "depth=1", "--batch", "2")
SIGLIP = (
    "hf:SiglipVisionConfig", "-o", "hidden_size=32", "-o", "num_hidden_layers=1", "-o",
    "image_size=32", "-o", "patch_size=16", "-o", "intermediate_size=64", "-o",
    "num_attention_heads=2",
)  # fmt: skip


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _positive(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def _assert_timed(data: dict) -> None:
    for row in data["convs"]:
        for mode in ("forward", "forward_backward"):
            assert _positive(row["torch_ms"][mode]) and _positive(row["gemmconv_ms"][mode])
    for step in ("forward", "train_step"):
        assert _positive(data[step]["torch_ms"]) and _positive(data[step]["gemmconv_ms"])


def test_a_timm_model_as_json(capsys):
    pytest.importorskip("timm")
    code, out, err = run(capsys, "profile", *VIT, *FAST, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["model"] == "timm:vit_tiny_patch16_224"
    assert data["overrides"] == {"img_size": 32, "depth": 1}
    assert data["inputs"] == ["2x3x32x32"] and data["device"].startswith("cpu")
    assert data["dtype"] == "fp32" and data["steps"] == 1
    (row,) = data["convs"]
    assert row["name"] == "patch_embed.proj" and row["reducible"]
    assert row["problem_class"] == "patch" and row["input_shape"] == [2, 3, 32, 32]
    assert set(row["solvers"]) == {"forward", "backward_data", "backward_weights"}
    _assert_timed(data)


def test_a_hugging_face_model_from_its_config_as_a_table(capsys):
    pytest.importorskip("transformers")
    code, out, err = run(capsys, "profile", *SIGLIP, "--batch", "2", *FAST)
    assert code == 0, err
    assert out.startswith("hf:SiglipVisionConfig, input 2x3x32x32\n")
    assert "embeddings.patch_embedding" in out and "patch" in out
    assert "whole model (median of 1 steps" in out and "training step" in out


def test_a_hugging_face_model_class_with_json_to_a_file(capsys, tmp_path):
    pytest.importorskip("transformers")
    path = tmp_path / "profile.json"
    args = [a if a != "hf:SiglipVisionConfig" else "hf:SiglipVisionModel" for a in SIGLIP]
    code, out, err = run(capsys, "profile", *args, "--batch", "1", *FAST, f"--json={path}")
    assert code == 0, err
    assert "embeddings.patch_embedding" in out  # the table still shows
    data = json.loads(path.read_text())
    assert [row["name"] for row in data["convs"]] == ["embeddings.patch_embedding"]
    assert data["inputs"] == ["1x3x32x32"]
    _assert_timed(data)


_FACTORIES = """
    import torch

    def with_inputs(width=4):
        model = torch.nn.Sequential(torch.nn.Conv1d(2, width, 4, stride=4))
        return model, torch.randn(1, 2, 16)

    def bare():
        return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1))

    def no_convs():
        return torch.nn.Linear(4, 4), (torch.randn(2, 4),)

    def fails():
        raise ValueError("no weights here")

    def not_a_model():
        return 42
"""


@pytest.fixture
def factories(tmp_path):
    path = tmp_path / "models.py"
    path.write_text(textwrap.dedent(_FACTORIES))
    return path


def test_a_factory_with_inputs_and_overrides(capsys, factories):
    code, out, err = run(
        capsys, "profile", f"{factories}:with_inputs", "-o", "width=8", *FAST, "--json"
    )
    assert code == 0, err
    data = json.loads(out)
    assert data["inputs"] == ["1x2x16"]
    (row,) = data["convs"]
    assert row["name"] == "0" and row["weight_shape"] == [8, 2, 4] and row["reducible"]


def test_a_factory_model_and_an_input_shape(capsys, factories):
    code, out, err = run(capsys, "profile", f"{factories}:bare", "--input", "2x3x4x4", *FAST)
    assert code == 0, err
    assert "input 2x3x4x4" in out and "pointwise" in out


def test_a_model_without_convolutions_says_so_and_exits_0(capsys, factories):
    code, out, err = run(capsys, "profile", f"{factories}:no_convs", *FAST)
    assert code == 0, err
    assert out == "no torch.nn.Conv1d/2d/3d ran in the forward: nothing for gemmconv to convert\n"


def test_the_progress_bar_ends_at_its_total(capsys, monkeypatch, factories):
    bars = RecordingBar.patch(monkeypatch, cli)
    code, _, err = run(capsys, "profile", f"{factories}:with_inputs", *FAST)
    assert code == 0, err
    (bar,) = bars
    assert bar.n == bar.total > 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["foo:bar"], "MODEL 'foo:bar': expected timm:NAME, hf:CONFIG_OR_MODEL_CLASS or"),
        (["resnet18"], "MODEL 'resnet18': expected timm:NAME"),
        (["timm:no_such_model"], "timm.create_model failed: RuntimeError: Unknown model"),
        (["hf:NoSuchConfig"], "has no 'NoSuchConfig'; expected a transformers config class"),
        (["missing.py:make"], "MODEL 'missing.py:make': no file 'missing.py'"),
        (["{f}:fails"], "fails() raised ValueError: no weights here"),
        (["{f}:absent"], "has no callable 'absent'"),
        (["{f}:not_a_model"], "not_a_model() returned int; expected a torch.nn.Module"),
        (["{f}:bare"], "its input shape is not known; give --input"),
        (["{f}:bare", "--input", "2x3xfour"], "'2x3xfour': expected sizes >= 1 joined by x"),
        (["{f}:with_inputs", "--batch", "2"], "--batch 2: the factory of"),
        (["{f}:bare", "-o", "1=2"], "-o/--override '1=2': expected KEY=VALUE"),
        (["{f}:bare", "--steps", "0"], "--steps 0: expected a value >= 1"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, factories, argv, message):
    if argv[0].startswith(("timm:", "hf:")):
        pytest.importorskip(argv[0].partition(":")[0].replace("hf", "transformers"))
    argv = [a.replace("{f}", str(factories)) for a in argv]
    code, out, err = run(capsys, "profile", *FAST, *argv)  # argv's flags win
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("gemmconv profile: error: "), err
    assert message in err


@pytest.mark.parametrize("prefix, module", [("timm", "timm"), ("hf", "transformers")])
def test_a_missing_extra_is_named(capsys, monkeypatch, prefix, module):
    monkeypatch.setitem(sys.modules, module, None)  # import raises ModuleNotFoundError
    code, out, err = run(capsys, "profile", f"{prefix}:Anything", *FAST)
    assert code == 2 and err.count("\n") == 1
    assert f"needs {module}, which is not installed" in err and "[models]" in err
