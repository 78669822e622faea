"""Converted models under DistributedDataParallel and FSDP2 (fully_shard), two CPU
processes over gloo: a few SGD steps on half a batch each give the weights one process
gets on the whole batch."""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import gemmconv
from gemmconv.measuring.verify import rms_range, tolerance

WORLD = 2
STEPS = 3
BATCH = 8
LR = 0.1


class TinyViT(torch.nn.Module):
    """A patch embed (16x16/16 in miniature: 4x4/4), a token mixer and a linear head."""

    def __init__(self):
        super().__init__()
        self.patch_embed = torch.nn.Conv2d(3, 16, kernel_size=4, stride=4)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)
        )
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        tokens = self.patch_embed(x).flatten(2).transpose(1, 2)
        tokens = tokens + self.mlp(tokens)
        return self.head(tokens.mean(1))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = TinyViT()
    report = gemmconv.convert(model)
    assert report.swapped_names == ["patch_embed"]
    return model


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.rand(BATCH, 3, 8, 8, generator=g) * 2 - 1, torch.rand(BATCH, 4, generator=g)


def _train(model, x, y, steps=STEPS):
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def _worker(rank: int, port: int, modes: list[str], out_dir: str) -> None:
    """Train once per mode in the same process group, rank 0 saving the full weights."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        x, y = _data()
        shard = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
        for mode in modes:
            model = _model()
            if mode == "ddp":
                _train(torch.nn.parallel.DistributedDataParallel(model), x[shard], y[shard])
                state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            else:
                from torch.distributed.device_mesh import init_device_mesh
                from torch.distributed.fsdp import fully_shard

                # A CPU mesh: without one fully_shard takes the accelerator where there
                # is one, moving the model there and the inputs with it.
                mesh = init_device_mesh("cpu", (WORLD,))
                fully_shard(model.patch_embed, mesh=mesh)
                fully_shard(model, mesh=mesh)
                _train(model, x[shard], y[shard])
                state = {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}
            # Wrapping may subclass the module (FSDP2 does); it must still be gemmconv's.
            assert isinstance(model.patch_embed, gemmconv.nn.Conv2d), type(model.patch_embed)
            if rank == 0:
                torch.save(state, os.path.join(out_dir, f"{mode}.pt"))
    finally:
        dist.destroy_process_group()
    # gloo's threads can abort the interpreter's teardown ("terminate called without an
    # active exception", SIGABRT, seen in about one CI run in three) after all the work
    # is done; leave without that teardown, the results being saved and closed.
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fsdp2_available() -> str | None:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no torch.distributed.fsdp.fully_shard"
    return None


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, dict[str, torch.Tensor]]:
    """Weights after distributed training, per mode; one spawn serves every test."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    modes = ["ddp"] if _fsdp2_available() else ["ddp", "fsdp2"]
    out_dir = tmp_path_factory.mktemp("distributed")
    mp.spawn(_worker, args=(_free_port(), modes, str(out_dir)), nprocs=WORLD, join=True)
    return {mode: torch.load(out_dir / f"{mode}.pt") for mode in modes}


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_processes_train_like_one(mode, trained):
    if mode == "fsdp2" and (reason := _fsdp2_available()):
        pytest.skip(reason)
    distributed = trained[mode]
    model = _model()
    x, y = _data()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    _train(model, x, y)
    tol = tolerance(torch.float32, "cpu")
    for key, value in model.state_dict().items():
        assert not torch.equal(value, initial[key]), f"{key} did not train"
        assert rms_range(distributed[key], value) <= tol, key


# ---- no implicit collective: patterns where ranks run different convolutions ----------
#
# Each scenario runs in two fresh gloo processes with a hard deadline, so that a
# convolution waiting for a collective the other rank never issues fails the test
# instead of blocking the suite.

SCENARIO_TIMEOUT_S = 60


def _torch_twin() -> torch.nn.Module:
    """The TinyViT of _model(), with the same weights, unconverted."""
    torch.manual_seed(0)
    return TinyViT()


def _gather(value: object) -> list:
    gathered: list = [None] * WORLD
    dist.all_gather_object(gathered, value)
    return gathered


def _choices() -> dict[str, str]:
    """This rank's decided solver per problem key."""
    from gemmconv.selection import dispatch

    return {problem.key(): choice.solver for (problem, _), choice in dispatch._cache.items()}


def _rank0_evaluation(rank: int) -> dict:
    """The usual ``if rank == 0: evaluate(model)`` on a shape only rank 0 sees."""
    model = torch.nn.parallel.DistributedDataParallel(_model())
    x, y = _data()
    _train(model, x[rank::WORLD], y[rank::WORLD], steps=1)
    result = {}
    if rank == 0:
        module = model.module.eval()
        images = torch.randn(5, 3, 12, 12)
        twin = _torch_twin()
        twin.load_state_dict(module.state_dict())
        with torch.no_grad():
            result["error"] = (module(images) - twin(images)).abs().max().item()
    dist.barrier()
    return result


def _explain_on_one_rank(rank: int) -> dict:
    """explain() and module.solvers() on rank 1 only, for problems rank 0 never meets."""
    model = _model()
    result = {}
    if rank == 1:
        images = torch.randn(3, 3, 16, 16)
        for mode in ("database", "find"):
            with gemmconv.find_mode(mode):
                solvers = model.patch_embed.solvers(images)
                explained = gemmconv.explain(images, model.patch_embed.weight, stride=4)
            result[mode] = sorted(solvers) == sorted(explained)
    dist.barrier()
    return result


def _uneven_last_batch(rank: int) -> dict:
    """DDP where rank 1's last batch is smaller: a problem only rank 1 meets."""
    model = torch.nn.parallel.DistributedDataParallel(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = _data()
    for step in range(STEPS):
        size = 3 if (rank == 1 and step == STEPS - 1) else 4
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x[:size]), y[:size]).backward()
        optimizer.step()
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {"params": params, "choices": _choices()}


def _shapes_per_rank(rank: int) -> dict:
    """Each rank convolves shapes of its own (with gradients), and one shape both do."""
    g = torch.Generator().manual_seed(rank)
    sizes = [(2, 8), (1, 12)] if rank == 0 else [(3, 10), (2, 6), (1, 14)]
    errors = []
    for n, side in [*sizes, (2, 16)]:
        x = torch.randn(n, 3, side, side, generator=g, requires_grad=True)
        w = torch.randn(8, 3, 2, 2, generator=g, requires_grad=True)
        y = gemmconv.conv2d(x, w, stride=2)
        gx, gw = torch.autograd.grad(y.square().sum(), (x, w))
        ref = torch.nn.functional.conv2d(x, w, stride=2)
        rx, rw = torch.autograd.grad(ref.square().sum(), (x, w))
        errors.append(max((a - b).abs().max().item() for a, b in ((y, ref), (gx, rx), (gw, rw))))
    dist.barrier()
    return {"errors": errors, "choices": _choices()}


def _ddp_training_in_find_mode(rank: int) -> dict:
    """DDP with find on: each rank finds for itself; DDP's gradients agree all the same."""
    model = torch.nn.parallel.DistributedDataParallel(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = _data()
    grads = []
    with gemmconv.find_mode("find"):
        for _ in range(STEPS):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x[rank::WORLD]), y[rank::WORLD]).backward()
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
            optimizer.step()
    return {"grads": grads, "sources": sorted({c.source for c in _cache_choices()})}


def _cache_choices() -> list:
    from gemmconv.selection import dispatch

    return list(dispatch._cache.values())


def _sync_choices_in_find_mode(rank: int) -> dict:
    """Find on every rank, rank 1's timings coming out otherwise (each candidate is
    correct, so a rank may run any): sync_choices() leaves one solver per problem."""
    import dataclasses

    from gemmconv.roads import eager
    from gemmconv.selection import dispatch

    if rank == 1:
        original = dispatch._decide_by_find

        def another_winner(problem, estimated, store):
            found = original(problem, estimated, store)
            others = [s for s in found.times_ms if s != found.solver]
            return dataclasses.replace(found, solver=others[0]) if others else found

        dispatch._decide_by_find = another_winner
    model = _model()
    images = torch.randn(4, 3, 8, 8, requires_grad=True)
    only_rank0 = torch.randn(2, 3, 12, 12)
    with gemmconv.find_mode("find"):
        model(images).sum().backward()
        if rank == 0:
            model(only_rank0)
        before = _choices()
        adopted = gemmconv.sync_choices()
        after = _choices()
        decided = len(dispatch._cache)
        # After the sync, the eager road runs the adopted solver, and rank 1 meets rank
        # 0's shape without deciding it again.
        twin = _torch_twin()
        out, ref = model(images), twin(images)
        model(only_rank0)
        forward_plans = {
            call.plan.problem.key(): call.plan.solver.id
            for call in eager._calls.values()
            if call is not None
        }
    return {
        "before": before,
        "after": after,
        "adopted": adopted,
        "new_decisions": len(dispatch._cache) - decided,
        "plans": forward_plans,
        "sources": {p.key(): c.source for (p, _), c in dispatch._cache.items()},
        "error": (out - ref).abs().max().item(),
    }


SCENARIOS = {
    "rank0_evaluation": _rank0_evaluation,
    "explain_on_one_rank": _explain_on_one_rank,
    "uneven_last_batch": _uneven_last_batch,
    "shapes_per_rank": _shapes_per_rank,
    "ddp_training_in_find_mode": _ddp_training_in_find_mode,
    "sync_choices_in_find_mode": _sync_choices_in_find_mode,
}


def _scenario_main(rank: int, name: str, init_file: str, out_dir: str) -> None:
    import datetime

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=SCENARIO_TIMEOUT_S),
    )
    try:
        result = SCENARIOS[name](rank)
        torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
        dist.barrier()  # both results saved before either process leaves
    finally:
        dist.destroy_process_group()
    os._exit(0)  # past gloo's teardown, as _worker


def run_ranks(name: str, tmp_path) -> list[dict]:
    """Scenario ``name`` on two gloo processes; fails if they take past the deadline."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    out_dir = tmp_path / name
    out_dir.mkdir()
    context = mp.start_processes(
        _scenario_main,
        args=(name, str(tmp_path / f"{name}.init"), str(out_dir)),
        nprocs=WORLD,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + SCENARIO_TIMEOUT_S
    try:
        while not context.join(timeout=max(deadline - time.monotonic(), 0.0)):
            if time.monotonic() >= deadline:
                pytest.fail(f"{name}: the two ranks did not finish in {SCENARIO_TIMEOUT_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return [torch.load(out_dir / f"{rank}.pt", weights_only=False) for rank in range(WORLD)]


def test_evaluation_on_rank_zero_only_does_not_hang(tmp_path):
    r0, r1 = run_ranks("rank0_evaluation", tmp_path)
    assert r0["error"] <= 1e-5 and r1 == {}


def test_explain_and_solvers_on_one_rank_do_not_hang(tmp_path):
    r0, r1 = run_ranks("explain_on_one_rank", tmp_path)
    assert r0 == {} and r1 == {"database": True, "find": True}


def test_uneven_last_batch_does_not_hang(tmp_path):
    r0, r1 = run_ranks("uneven_last_batch", tmp_path)
    assert torch.equal(r0["params"], r1["params"])  # DDP's promise holds
    only_rank1 = set(r1["choices"]) - set(r0["choices"])
    assert only_rank1 and all("-n3-" in key for key in only_rank1)
    # Database mode (the default): the problems both met have the same solver, with no
    # communication.
    common = set(r0["choices"]) & set(r1["choices"])
    assert common and all(r0["choices"][k] == r1["choices"][k] for k in common)


def test_different_shapes_per_rank_do_not_hang(tmp_path):
    r0, r1 = run_ranks("shapes_per_rank", tmp_path)
    assert max(r0["errors"] + r1["errors"]) <= 1e-3
    common = set(r0["choices"]) & set(r1["choices"])
    assert common and all(r0["choices"][k] == r1["choices"][k] for k in common)
    assert set(r0["choices"]) != set(r1["choices"])


def test_ddp_training_in_find_mode_keeps_gradients_equal(tmp_path):
    r0, r1 = run_ranks("ddp_training_in_find_mode", tmp_path)
    assert len(r0["grads"]) == STEPS
    for g0, g1 in zip(r0["grads"], r1["grads"]):
        assert torch.equal(g0, g1)
    assert r0["sources"] == r1["sources"] == ["find"]  # each rank found for itself


def test_sync_choices_makes_find_choices_identical(tmp_path):
    r0, r1 = run_ranks("sync_choices_in_find_mode", tmp_path)
    shared = set(r0["before"]) & set(r1["before"])
    assert any(r0["before"][k] != r1["before"][k] for k in shared)  # they differed
    assert r0["after"] == r0["before"] and r0["adopted"] == 0
    assert r1["after"] == r0["after"]  # rank 0's shape included, rank 1 never met it
    assert r1["adopted"] > 0 and r1["new_decisions"] == r0["new_decisions"] == 0
    assert r1["plans"] == r0["plans"] and r1["plans"]
    assert all(source == "rank 0" for source in r1["sources"].values() if source != "find")
    assert max(r0["error"], r1["error"]) <= 1e-5


def test_sync_choices_without_a_process_group_does_nothing():
    assert gemmconv.sync_choices() == 0
