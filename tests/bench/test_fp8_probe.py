"""bench/probes/fp8_embeds.py's command line, checked on the CPU (the probe itself
needs a GPU with fp8 tensor cores)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

PROBE = Path(__file__).resolve().parents[2] / "bench" / "probes" / "fp8_embeds.py"


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("fp8_embeds", PROBE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_arguments(probe, tmp_path):
    args = probe.parse_args(["--out", str(tmp_path), "--steps", "5", "--json", "t.json"])
    assert args.out == tmp_path and args.steps == 5 and args.reps == 30
    assert args.json == Path("t.json") and not args.skip_training


BAD = [[], ["--out", "d", "--steps", "0"], ["--out", "d", "--reps", "x"]]


@pytest.mark.parametrize("argv", BAD)
def test_bad_arguments_exit_with_usage(probe, argv, capsys):
    with pytest.raises(SystemExit) as exited:
        probe.parse_args(argv)
    assert exited.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_without_cuda_it_says_so(probe, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(probe.torch.cuda, "is_available", lambda: False)
    assert probe.main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_log_writes_each_line_as_it_comes(probe, tmp_path, capsys):
    log = probe.Log(tmp_path)
    log("first", {"a": 1})
    assert (tmp_path / "fp8_embeds.jsonl").read_text() == '{"a": 1}\n'
    assert "first" in capsys.readouterr().out


def test_synthetic_data_is_the_same_every_run(probe):
    first = [labels for _, labels in probe.synthetic_batches(2, 4)]
    second = [labels for _, labels in probe.synthetic_batches(2, 4)]
    assert all((a == b).all() for a, b in zip(first, second))
