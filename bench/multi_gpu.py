"""A ViT trained under DDP and FSDP2, one process per device: the wall clock of a
training step with torch, gemmconv and the reshape + linear rewrite, and the checks of
gemmconv's distributed claims, from one run.

    # two GPUs over NCCL: timm ViT-B/16, batch 256 per GPU (PYTHONPATH=src from the repo)
    torchrun --standalone --nproc-per-node 2 bench/multi_gpu.py
    # two CPU processes over gloo, a tiny ViT (what the CPU test runs)
    torchrun --standalone --nproc-per-node 2 bench/multi_gpu.py --backend gloo \
        --model vit_tiny_patch16_224 --image-size 32 --depth 1 --batch 2 \
        --steps 4 --timed 2 --hash-after 2 --out /tmp/distributed

Variants, each trained from the same initial weights on the same data:

- ``torch``: the timm model as it is;
- ``converted``: ``gemmconv.convert(model)``, torch's output layout;
- ``converted_channels_last``: ``gemmconv.convert(model, memory_format=torch.channels_last)``
  (token-major output), reported as not available where ``convert`` has no such argument;
- ``linear``: the patch embed rewritten as reshape + F.linear
  (gemmconv.bench.linear_patch_embed, the end-to-end benchmark's rewrite).

Each runs under DDP and under FSDP2 (``fully_shard`` on every block, then the root).
A step is zero_grad, forward under bf16 autocast, cross-entropy, backward, a fused
AdamW step and a device synchronisation; its time is the slowest rank's, and a row's
time is the median of the last ``--timed`` steps. Selection runs in hybrid mode on an
empty find database made for the run (the default under cudnn.benchmark, which is on).

No convolution communicates: in hybrid mode each rank finds for itself on its first
step, and after that step every rank calls ``gemmconv.sync_choices()``, which gives all
of them the first rank's choices.

Checks, each stored with its numbers and printed (multi_gpu_checks.py says how each
is judged): every rank ends with the same solver per problem; DDP parameters are
bitwise equal across ranks after ``--hash-after`` steps; the converted models' loss
curves follow torch's within bf16 noise; with find on and an empty database, every
rank runs its own finds, no rank's first step waits for more than one find, and the
ranks then read the same solvers from the shared find database.

Rank 0 writes ``<out>/<name>.json`` and ``.md`` after every run, so a run cut short
keeps its rows; ``--out`` defaults to ./gemmconv-bench, and the committed runs in
bench/results are written only when ``--out`` names that folder. The exit status is 1
when a check fails.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import gc
import hashlib
import inspect
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from multi_gpu_checks import find_not_blocking, loss_curves, params_equal, same_solvers
from multi_gpu_report import add_ratios, verdict, write_results

import gemmconv
from gemmconv.bench.linear_patch_embed import replace_patch_convs
from gemmconv.bench.report import default_stem
from gemmconv.bench.suite import environment
from gemmconv.selection import dispatch

VARIANTS = ("torch", "linear", "converted", "converted_channels_last")
CONVERTED = ["converted", "converted_channels_last"]
WRAPPERS = ("ddp", "fsdp2")
LEARNING_RATE = 3e-4
DATA_BATCHES = 4  # a small pool the model can start to fit, so the loss curve moves
# NVLink multicast stays off: nothing here needs it, and NCCL or torch creating a
# multicast object fails on machines that do not allow one. A value already set is kept.
NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


class VariantNotAvailable(Exception):
    """This installation cannot build the variant; the row says why."""


# ---- the processes --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class World:
    rank: int
    size: int
    device: torch.device

    def gather(self, value: object) -> list:
        """``value`` from every rank, in rank order, on every rank."""
        gathered: list = [None] * self.size
        dist.all_gather_object(gathered, value)
        return gathered

    def from_rank0(self, value: object) -> object:
        """Rank 0's ``value``, on every rank."""
        message = [value]
        dist.broadcast_object_list(message, src=0)
        return message[0]

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def join_world(backend: str, timeout_s: float) -> World:
    needed = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    missing = [v for v in needed if v not in os.environ]
    if missing:
        raise SystemExit(
            f"{', '.join(missing)} not set: run this script under torchrun, e.g. "
            "torchrun --standalone --nproc-per-node 2 bench/multi_gpu.py"
        )
    for name, value in NO_MULTICAST_ENV.items():
        os.environ.setdefault(name, value)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if local_rank >= torch.cuda.device_count():
            raise SystemExit(
                f"--backend nccl: local rank {local_rank} has no CUDA device "
                f"({torch.cuda.device_count()} visible); expected one GPU per process"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return World(dist.get_rank(), dist.get_world_size(), device)


def use_empty_database(world: World) -> str:
    """Point every rank's $GEMMCONV_DB at one new, empty file (on rank 0's file system,
    which the ranks of one host share); returns its folder, for rank 0 to remove."""
    folder = tempfile.mkdtemp(prefix="gemmconv-distributed-") if world.rank == 0 else None
    folder = world.from_rank0(folder)
    os.environ["GEMMCONV_DB"] = os.path.join(folder, "find.sqlite")
    return folder


# ---- what each rank decided -----------------------------------------------------------


class DecisionLog(logging.Handler):
    """The solver decisions gemmconv.selection.dispatch logs, one per problem the first time it
    is seen: the record's arguments are the problem key, the mode and the Choice.
    ``during`` names the part of the run they belong to."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.decisions: list[dict] = []
        self.during = ""

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args
        if isinstance(args, tuple) and len(args) == 3 and isinstance(args[2], gemmconv.Choice):
            key, mode, choice = args
            self.decisions.append(
                {
                    "problem": key,
                    "mode": mode,
                    "solver": choice.solver,
                    "source": choice.source,
                    "during": self.during,
                }
            )

    def since(self, start: int) -> list[dict]:
        return self.decisions[start:]


def attach_decision_log() -> DecisionLog:
    handler = DecisionLog()
    logger = logging.getLogger("gemmconv.dispatch")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    return handler


# ---- models and variants --------------------------------------------------------------


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    import timm

    kwargs = {"pretrained": False, "img_size": args.image_size}
    if args.depth is not None:
        kwargs["depth"] = args.depth
    return timm.create_model(args.model, **kwargs)


def convert_accepts_memory_format() -> bool:
    return "memory_format" in inspect.signature(gemmconv.convert).parameters


def apply_variant(variant: str, model: torch.nn.Module, wrapper: str) -> str:
    """Turn ``model`` into ``variant`` in place; returns what was done, for the row."""
    if variant == "torch":
        return "timm model unchanged"
    if variant == "linear":
        names = replace_patch_convs(model)
        if not names:
            raise VariantNotAvailable(f"{type(model).__name__} has no patch convolution")
        return f"{', '.join(names)} -> reshape + F.linear"
    if variant == "converted":
        return _swapped(gemmconv.convert(model))
    if not convert_accepts_memory_format():
        raise VariantNotAvailable(
            f"gemmconv {gemmconv.__version__}: convert() has no memory_format argument"
        )
    if wrapper == "fsdp2":
        # fully_shard refuses parameters that are not contiguous (NotImplementedError),
        # and a channels-last weight is not.
        raise VariantNotAvailable("FSDP2 shards contiguous parameters only; a channels-last "
                                  "weight is refused by fully_shard")  # fmt: skip
    return _swapped(gemmconv.convert(model, memory_format=torch.channels_last))


def _swapped(report: gemmconv.ConversionReport) -> str:
    if not report.swapped:
        raise VariantNotAvailable(f"convert() swapped nothing: {report}")
    return "swapped " + ", ".join(f"{s.name} -> {s.problem_class}" for s in report.swapped)


def fully_shard_function():
    """FSDP2's fully_shard: public since torch 2.6, under _composable before."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import fully_shard
        except ImportError:
            raise VariantNotAvailable(
                f"torch {torch.__version__} has no FSDP2 fully_shard"
            ) from None
    return fully_shard


def wrap(wrapper: str, model: torch.nn.Module, world: World) -> torch.nn.Module:
    if wrapper == "ddp":
        device_ids = [world.device.index] if world.device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard = fully_shard_function()
    # The world's own device: without a mesh fully_shard takes the accelerator where
    # there is one, whatever the backend (gloo's CPU processes on a GPU machine, which
    # then asked for a GPU per rank).
    mesh = init_device_mesh(world.device.type, (world.size,))
    for block in getattr(model, "blocks", ()):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def parameter_digest(model: torch.nn.Module) -> str:
    """sha256 over every parameter's name and bytes (DDP's module unwrapped)."""
    module = getattr(model, "module", model)
    digest = hashlib.sha256()
    for name, param in module.named_parameters():
        digest.update(name.encode())
        digest.update(param.detach().cpu().contiguous().flatten().view(torch.uint8).numpy())
    return digest.hexdigest()


def make_data(args: argparse.Namespace, world: World, classes: int) -> list[tuple]:
    """Each rank's own fixed batches (DDP's point: the ranks see different data)."""
    generator = torch.Generator(device=world.device).manual_seed(args.seed + 1 + world.rank)
    batches = []
    for _ in range(DATA_BATCHES):
        shape = (args.batch, 3, args.image_size, args.image_size)
        images = torch.randn(shape, generator=generator, device=world.device)
        labels = torch.randint(0, classes, (args.batch,), generator=generator, device=world.device)
        batches.append((images, labels))
    return batches


# ---- training -------------------------------------------------------------------------


@dataclasses.dataclass
class RankRun:
    """What one rank measured in one run."""

    seconds: list[float]
    losses: list[float]
    digest: str | None
    peak_memory_gib: float | None


def prepare(
    wrapper: str, variant: str, initial: torch.nn.Module, world: World
) -> tuple[torch.nn.Module, torch.optim.Optimizer, str]:
    model = copy.deepcopy(initial).to(world.device)
    note = apply_variant(variant, model, wrapper)
    model = wrap(wrapper, model, world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, fused=True)
    return model, optimizer, note


def train_step(model, optimizer, batch, world: World) -> tuple[float, float]:
    """One step, as a training loop runs it; returns (seconds, loss)."""
    images, labels = batch
    dist.barrier()  # every rank starts together, so a rank's time is its own step's
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(world.device.type, dtype=torch.bfloat16):
        loss = F.cross_entropy(model(images), labels)
    loss.backward()
    optimizer.step()
    world.synchronize()
    return time.perf_counter() - start, loss.item()


def train(model, optimizer, data, steps: int, hash_after: int | None, world: World) -> RankRun:
    if world.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(world.device)
    seconds, losses, digest = [], [], None
    for step in range(steps):
        took, loss = train_step(model, optimizer, data[step % len(data)], world)
        seconds.append(took)
        losses.append(loss)
        if step == 0:
            # Every rank found for itself in the first step; from here on all run the
            # first rank's choices (a collective, at a point every rank reaches).
            gemmconv.sync_choices()
        if hash_after is not None and step + 1 == hash_after:
            digest = parameter_digest(model)
    peak = None
    if world.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(world.device) / 2**30
    return RankRun(seconds, losses, digest, peak)


def free_memory() -> None:
    """Give back what a finished run held (its model and optimizer are gone by now)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_row(args, wrapper: str, variant: str, initial, data, world: World) -> dict:
    """One (wrapper, variant) run on every rank; the row, complete on every rank."""
    row = {"wrapper": wrapper, "variant": variant}
    try:
        model, optimizer, note = prepare(wrapper, variant, initial, world)
    except VariantNotAvailable as e:
        return {**row, "status": "not available", "note": str(e), "ms": None}
    hash_after = args.hash_after if wrapper == "ddp" else None
    mine = train(model, optimizer, data, args.steps, hash_after, world)
    del model, optimizer
    free_memory()
    ranks = world.gather(mine)
    per_step = [max(r.seconds[i] for r in ranks) for i in range(args.steps)]
    timed = per_step[-args.timed :]
    return {
        **row,
        "status": "ok",
        "note": note,
        "ms": 1e3 * statistics.median(timed),
        "ms_per_rank": [1e3 * statistics.median(r.seconds[-args.timed :]) for r in ranks],
        "ms_min": 1e3 * min(timed),
        "ms_max": 1e3 * max(timed),
        "first_step_s": [r.seconds[0] for r in ranks],
        "peak_memory_gib": [r.peak_memory_gib for r in ranks],
        "losses": [statistics.fmean(r.losses[i] for r in ranks) for i in range(args.steps)],
        "sha256_per_rank": [r.digest for r in ranks] if hash_after is not None else None,
    }


def measure_first_steps(initial, data, decisions: DecisionLog, world: World) -> dict:
    """Time to first step of the converted model under DDP with find on: after a
    warm-up step (DDP's and the optimizer's first-step work done), the choice cache is
    cleared and $GEMMCONV_DB pointed at a new empty file; then a step in which every
    rank finds, a step re-deciding from what the ranks just stored in that one file,
    and a steady step, with the decisions each made."""
    model, optimizer, _ = prepare("ddp", "converted", initial, world)
    train_step(model, optimizer, data[0], world)
    db_dir = use_empty_database(world)
    phases = {}
    for step, phase in enumerate(("find", "database", "steady"), start=1):
        if phase != "steady":
            dispatch.clear_cache()
        start = len(decisions.decisions)
        decisions.during = f"first step check: {phase}"
        # Find mode in the first step: in hybrid mode a rank could read a row another
        # rank had just stored instead of finding.
        with gemmconv.find_mode("find" if phase == "find" else "hybrid"):
            took, _ = train_step(model, optimizer, data[step % len(data)], world)
        made = decisions.since(start)
        phases[phase] = {
            "seconds": took,
            "sources": [d["source"] for d in made],
            "solvers": {d["problem"]: d["solver"] for d in made},
        }
        gemmconv.sync_choices()
    del model, optimizer
    free_memory()
    dist.barrier()
    if world.rank == 0:
        shutil.rmtree(db_dir, ignore_errors=True)
    return phases


# ---- the run --------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="vit_base_patch16_224", help="a timm ViT")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--depth", type=int, default=None, help="blocks (default: the model's)")
    parser.add_argument("--batch", type=int, default=256, help="per rank")
    parser.add_argument("--steps", type=int, default=50, help="steps per run")
    parser.add_argument("--timed", type=int, default=20, help="the last steps, timed")
    parser.add_argument("--hash-after", type=int, default=10, help="DDP parameters compared")
    parser.add_argument("--wrappers", default=",".join(WRAPPERS), help="ddp,fsdp2")
    parser.add_argument(
        "--backend",
        choices=("nccl", "gloo"),
        default="nccl" if torch.cuda.is_available() else "gloo",
        help="nccl: one GPU per process; gloo: CPU processes",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("gemmconv-bench"),
        help="a folder (the committed runs: bench/results, written only when named)",
    )
    parser.add_argument("--name", help="file stem (default <device>x<ranks>_distributed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=900.0, help="for every collective")
    args = parser.parse_args(argv)
    for flag, value in (("--batch", args.batch), ("--image-size", args.image_size)):
        if value < 1:
            parser.error(f"{flag}={value}: expected a positive integer")
    if args.depth is not None and args.depth < 1:
        parser.error(f"--depth={args.depth}: expected a positive integer")
    if not 1 <= args.timed < args.steps:
        parser.error(
            f"--timed={args.timed}: expected 1 <= timed < --steps ({args.steps}), "
            "so at least one step warms up"
        )
    if not 1 <= args.hash_after <= args.steps - args.timed:
        parser.error(
            f"--hash-after={args.hash_after}: expected 1 <= hash-after <= steps - timed "
            f"({args.steps - args.timed}), a warm-up step (hashing is not timed)"
        )
    wrappers = [w for w in args.wrappers.split(",") if w]
    unknown = sorted(set(wrappers) - set(WRAPPERS)) or ([] if wrappers else ["(none)"])
    if unknown:
        parser.error(f"--wrappers={args.wrappers!r}: unknown {unknown}; expected from {WRAPPERS}")
    args.wrappers = wrappers
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world = join_world(args.backend, args.timeout_s)
    try:
        return run(args, world)
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace, world: World) -> int:
    torch.backends.cudnn.benchmark = True
    gemmconv.set_find_mode("hybrid")
    db_dir = use_empty_database(world)
    decisions = attach_decision_log()
    torch.manual_seed(args.seed)
    initial = build_model(args)
    data = make_data(args, world, initial.num_classes)
    env = environment(world.device)
    env.update({name: os.environ.get(name) for name in NO_MULTICAST_ENV})
    name = args.name or f"{default_stem(env['device'])}x{world.size}_distributed"
    results = {"environment": env, "config": run_config(args, world), "rows": [], "checks": {}}

    def save() -> list[Path]:
        if world.rank != 0:
            return []
        add_ratios(results["rows"])
        return write_results(results, args.out, name)

    for wrapper in args.wrappers:
        for variant in VARIANTS:
            decisions.during = f"{wrapper}/{variant}"
            row = run_row(args, wrapper, variant, initial, data, world)
            results["rows"].append(row)
            if world.rank == 0:
                shown = f"{row['ms']:.2f} ms" if row["ms"] is not None else row["status"]
                print(f"{wrapper:5s} {variant:24s} {shown}  ({row['note']})", flush=True)
            save()
    checks = run_checks(args, results["rows"], initial, data, decisions, world)
    results["checks"] = checks
    paths = save()
    dist.barrier()
    if world.rank == 0:
        shutil.rmtree(db_dir, ignore_errors=True)
        for d in checks["same_solvers"]["decisions"]:
            each = zip(d["solvers"], d["sources"])
            ranks = ", ".join(f"rank {r}: {s} ({src})" for r, (s, src) in enumerate(each))
            print(f"{d['during']}: {d['problem']} [{d['mode']}] {ranks}")
        for check_name, check in checks.items():
            print(f"{check_name}: {verdict(check)}: {check['summary']}")
        for path in paths:
            print(f"wrote {path}")
    return 1 if any(c["pass"] is False for c in checks.values()) else 0


def run_config(args: argparse.Namespace, world: World) -> dict:
    return {
        "model": args.model,
        "image_size": args.image_size,
        "depth": args.depth,
        "batch_per_rank": args.batch,
        "world_size": world.size,
        "backend": args.backend,
        "steps": args.steps,
        "timed": args.timed,
        "hash_after": args.hash_after,
        "lr": LEARNING_RATE,
        "seed": args.seed,
        "find_mode": "hybrid",
        "wrappers": args.wrappers,
        "variants": list(VARIANTS),
    }


def run_checks(args, rows: list[dict], initial, data, decisions: DecisionLog, world: World):
    """The four checks, on every rank (the first-step one trains, so all ranks take part)."""
    done = [r for r in rows if r["status"] == "ok"]
    curves: dict[str, dict[str, list[float]]] = {}
    for r in done:
        curves.setdefault(r["wrapper"], {})[r["variant"]] = r["losses"]
    checks = {"loss_curve": loss_curves(curves, CONVERTED)}
    if "ddp" in args.wrappers:
        digests = {
            f"ddp/{r['variant']}": r["sha256_per_rank"] for r in done if r["wrapper"] == "ddp"
        }
        checks["params_equal"] = params_equal(digests, args.hash_after)
        first_steps = world.gather(measure_first_steps(initial, data, decisions, world))
        checks["find_not_blocking"] = find_not_blocking(first_steps)
    else:
        for check_name in ("params_equal", "find_not_blocking"):
            checks[check_name] = {"pass": None, "summary": "it needs --wrappers ddp"}
    checks["same_solvers"] = same_solvers(world.gather(decisions.decisions))
    return checks


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # gloo's threads can abort the interpreter's teardown ("terminate called without an
    # active exception") after all the work is done (tests/api/test_distributed.py sees the
    # same); leave without that teardown, the results being written and closed.
    os._exit(code)
