"""bench/multi_gpu.py: the distributed training benchmark and its checks.

The script runs end to end under torchrun with two gloo processes on the CPU (a tiny
ViT), and with two NCCL processes on two GPUs (the DDP part, `gpu`). Its checks and the
reshape + linear patch embed are tested on their own, each check also on data that
must fail it."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gemmconv
from gemmconv.bench.linear_patch_embed import LinearPatchEmbed

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
sys.path.insert(0, str(BENCH))

import multi_gpu  # noqa: E402
from multi_gpu_checks import (  # noqa: E402
    find_not_blocking,
    loss_curves,
    params_equal,
    same_solvers,
)

VARIANTS = ["torch", "linear", "converted", "converted_channels_last"]
TINY = [
    "--model", "vit_tiny_patch16_224", "--image-size", "32", "--depth", "1",
    "--batch", "2", "--steps", "4", "--timed", "2", "--hash-after", "2",
]  # fmt: skip


def run_script(args: list[str], out: Path, extra_env: dict[str, str], timeout: float):
    """torchrun with two processes on bench/multi_gpu.py, this tree's gemmconv imported."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEMMCONV_")}
    env.update(PYTHONPATH=str(REPO / "src"), **extra_env)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(BENCH / "multi_gpu.py"), *args, "--out", str(out), "--name", "run",
    ]  # fmt: skip
    result = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    return json.loads((out / "run.json").read_text()), (out / "run.md").read_text(), output


def assert_rows_and_checks(results: dict, wrappers: list[str], steps: int) -> None:
    rows = {(r["wrapper"], r["variant"]): r for r in results["rows"]}
    assert sorted(rows) == sorted((w, v) for w in wrappers for v in VARIANTS)
    accepts = "memory_format" in inspect.signature(gemmconv.convert).parameters
    for (wrapper, variant), row in rows.items():
        if variant == "converted_channels_last" and not accepts:
            assert row["status"] == "not available" and "memory_format" in row["note"], row
            continue
        if variant == "converted_channels_last" and wrapper == "fsdp2":
            assert row["status"] == "not available" and "contiguous" in row["note"], row
            continue
        assert row["status"] == "ok", row
        assert row["ms"] > 0 and len(row["first_step_s"]) == 2, row
        assert len(row["losses"]) == steps and all(torch.isfinite(torch.tensor(row["losses"])))
        if variant.startswith("converted"):
            assert "patch_embed.proj -> patch" in row["note"], row
        if wrapper == "ddp":
            assert len(set(row["sha256_per_rank"])) == 1, row
    checks = results["checks"]
    assert sorted(checks) == ["find_not_blocking", "loss_curve", "params_equal", "same_solvers"]
    for name, check in checks.items():
        assert check["pass"] is True, (name, check)
    # Every rank found for itself (empty database), then read the shared database.
    decisions = checks["same_solvers"]["decisions"]
    assert decisions and all(len(set(d["solvers"])) == 1 for d in decisions)
    for rank_sources in checks["find_not_blocking"]["sources"]["find"]:
        assert rank_sources and all(s == "find" for s in rank_sources)


def test_two_gloo_processes_run_the_script_end_to_end(tmp_path):
    results, report, output = run_script(
        [*TINY, "--backend", "gloo"], tmp_path, {"OMP_NUM_THREADS": "1"}, timeout=300
    )
    assert results["config"]["world_size"] == 2 and results["environment"]["device"] == "cpu"
    assert_rows_and_checks(results, ["ddp", "fsdp2"], steps=4)
    for name in results["checks"]:
        assert f"**{name}**: PASS" in report
    assert "rank 1: " in output  # each rank's choices, printed


def test_fsdp2_shards_over_a_mesh_of_the_worlds_device(monkeypatch):
    """fully_shard without a mesh takes the accelerator where one is present, whatever
    the process group's backend: gloo's CPU processes on a GPU machine asked for a GPU
    per rank. The script passes a mesh of its world's device to every call."""
    from torch.distributed import device_mesh

    meshes, sharded = [], []
    monkeypatch.setattr(
        device_mesh, "init_device_mesh", lambda kind, shape: meshes.append((kind, shape)) or kind
    )
    monkeypatch.setattr(
        multi_gpu,
        "fully_shard_function",
        lambda: lambda module, **kwargs: sharded.append((module, kwargs)),
    )
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
    for device in ("cpu", "cuda"):
        meshes.clear()
        sharded.clear()
        world = multi_gpu.World(0, 2, torch.device(device))
        assert multi_gpu.wrap("fsdp2", model, world) is model
        assert meshes == [(device, (2,))]
        assert sharded == [(m, {"mesh": device}) for m in (*model.blocks, model)]


def test_bad_arguments_are_refused_by_name(capsys):
    for argv, message in [
        (["--steps", "4", "--timed", "4"], "--timed=4: expected 1 <= timed < --steps (4)"),
        (["--steps", "4", "--timed", "2", "--hash-after", "3"], "--hash-after=3: expected"),
        (["--wrappers", "ddp,zero3"], "--wrappers='ddp,zero3': unknown ['zero3']"),
        (["--batch", "0"], "--batch=0: expected a positive integer"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            multi_gpu.parse_args(argv)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


@pytest.mark.gpu
def test_two_gpus_run_the_ddp_part(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs two CUDA devices, found {torch.cuda.device_count()}")
    args = [
        "--backend", "nccl", "--wrappers", "ddp", "--batch", "32",
        "--steps", "12", "--timed", "2", "--hash-after", "10",
    ]  # fmt: skip
    no_multicast = {
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
    }
    results, _, _ = run_script(args, tmp_path, no_multicast, timeout=300)
    assert results["environment"]["device"] == torch.cuda.get_device_name(0)
    assert_rows_and_checks(results, ["ddp"], steps=12)


# ---- the checks on their own ----------------------------------------------------------


def _decision(solver: str, source: str, problem: str = "p-forward") -> dict:
    return {
        "problem": problem,
        "mode": "hybrid",
        "solver": solver,
        "source": source,
        "during": "ddp/converted",
    }


def test_same_solvers_fails_when_a_rank_ends_otherwise_or_nothing_was_decided():
    agree = [[_decision("patch", "find")], [_decision("patch", "find")]]
    assert same_solvers(agree)["pass"]
    # Ranks that found differently agree once rank 1 adopted rank 0's choice.
    rank1 = [_decision("im2col", "find"), _decision("patch", "rank 0")]
    synced = [[_decision("patch", "find")], rank1]
    result = same_solvers(synced)
    assert result["pass"] and result["decisions"][0]["sources"] == ["find", "rank 0"]
    differ = [[_decision("patch", "find")], [_decision("im2col", "find")]]
    result = same_solvers(differ)
    assert not result["pass"] and "rank(s) [1]" in result["summary"]
    assert result["decisions"][0]["solvers"] == ["patch", "im2col"]
    missing = [[_decision("patch", "find")], []]
    assert not same_solvers(missing)["pass"]
    assert not same_solvers([[], []])["pass"]


def test_params_equal_fails_on_different_digests():
    assert params_equal({"ddp/torch": ["a", "a"]}, 10)["pass"]
    result = params_equal({"ddp/torch": ["a", "a"], "ddp/converted": ["a", "b"]}, 10)
    assert not result["pass"] and "ddp/converted" in result["summary"]
    assert not params_equal({}, 10)["pass"]


def test_loss_curve_tolerance_is_the_rewrites_drift_or_a_few_bf16_roundings():
    torch_curve = [6.9, 6.5, 6.0]
    linear = [6.9, 6.55, 6.1]  # drifts 0.1 at most: 0.2 is allowed
    within = {"ddp": {"torch": torch_curve, "linear": linear, "converted": [6.9, 6.6, 6.15]}}
    assert loss_curves(within, ["converted"])["pass"]
    beyond = {"ddp": {"torch": torch_curve, "linear": linear, "converted": [6.9, 6.5, 6.25]}}
    result = loss_curves(beyond, ["converted"])
    assert not result["pass"] and result["comparisons"][0]["worst_step"] == 3
    # With no drift between the exact rewrites, 4 bf16 roundings of the loss remain.
    exact = {"ddp": {"torch": [6.0], "linear": [6.0], "converted": [6.0 * (1 + 2**-7)]}}
    assert loss_curves(exact, ["converted"])["pass"]
    exact["ddp"]["converted"] = [6.0 * (1 + 2**-5)]
    assert not loss_curves(exact, ["converted"])["pass"]
    nan = {"ddp": {"torch": [6.0], "linear": [6.0], "converted": [float("nan")]}}
    assert not loss_curves(nan, ["converted"])["pass"]
    assert not loss_curves({"ddp": {"torch": [6.0]}}, ["converted"])["pass"]


def _phases(
    find_s: float,
    sources: list[str],
    database_s: float = 0.1,
    steady_s: float = 0.1,
    stored: dict | None = None,
):
    return {
        "find": {"seconds": find_s, "sources": sources},
        "database": {
            "seconds": database_s,
            "sources": ["database"] * len(sources),
            "solvers": {"p-forward": "patch"} if stored is None else stored,
        },
        "steady": {"seconds": steady_s, "sources": []},
    }


def test_find_not_blocking_fails_when_a_rank_waits_does_not_find_or_reads_otherwise():
    root = _phases(2.1, ["find", "find"])  # a find costing 2 s
    ok = find_not_blocking([root, _phases(2.15, ["find", "find"])])
    assert ok["pass"], ok["summary"]
    assert ok["find_cost_s"] == pytest.approx([2.0, 2.05])
    waited = find_not_blocking([root, _phases(2.1, ["rank 0", "rank 0"])])
    assert not waited["pass"] and "rank 1's decisions" in waited["summary"]
    waited_twice = find_not_blocking([root, _phases(4.1, ["find", "find"])])
    assert not waited_twice["pass"] and "rank(s) [1]" in waited_twice["summary"]
    read_otherwise = find_not_blocking([root, _phases(2.1, ["find"], stored={"p": "im2col"})])
    assert not read_otherwise["pass"] and "different solvers" in read_otherwise["summary"]
    no_find = find_not_blocking([_phases(0.1, []), _phases(0.1, [])])
    assert not no_find["pass"]


# ---- the reshape + linear patch embed -------------------------------------------------


def test_the_linear_variant_rewrites_the_patch_embed_with_its_own_parameters():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=1)
    model.eval()
    proj = model.patch_embed.proj
    weight, bias = proj.weight, proj.bias
    x = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        expected = model(x)
    assert (
        multi_gpu.apply_variant("linear", model, "ddp") == "patch_embed.proj -> reshape + F.linear"
    )
    assert isinstance(model.patch_embed.proj, LinearPatchEmbed)
    assert model.patch_embed.proj.weight is weight and model.patch_embed.proj.bias is bias
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected)


def test_the_linear_variant_is_not_available_without_a_patch_convolution():
    with pytest.raises(multi_gpu.VariantNotAvailable, match="Linear has no patch convolution"):
        multi_gpu.apply_variant("linear", torch.nn.Linear(2, 2), "ddp")
