"""The two sides of the training benchmark (:mod:`benchmarks.embark.bench_training`) and the
worker process that steps one of them on command.

* ``ours``: the default :class:`embark.training.Trainer` (one process) or a
  :class:`embark.sharding.ShardedDLRM` under the same trainer (world > 1, our planner's plan);
* ``torchrec``: TorchRec's ``DistributedModelParallel`` over an ``EmbeddingBagCollection``
  whose tables all use FBGEMM's fused CPU kernel (``compute_kernels=["fused"]``), the
  embedding optimizer applied inside backward (``apply_optimizer_in_backward``), TorchRec's
  planner's plan, and OUR DLRM's dense part (a plain module) fed by the pooled bags. The
  dense part is trained by ``torch.optim.Adagrad`` with the same learning rate as ours.

Both sides start from the weights ``build_model(workload, seed)`` draws (the table rows are
drawn into TorchRec's shards in the same generator order) and step through the same global
batches, each rank on its :func:`~embark.data.batch.local_batch`, so their losses agree at
step 0 (up to the order of float sums) and, with the same optimizer, for the first steps.

A side is one world of processes (``python -m benchmarks.embark.training_sides DIR SIDE
RANK WORLD``, gloo through a file in ``DIR``), so its peak RSS is its own. The driver
commands it through files, which lets it interleave the two worlds' repetitions::

    DIR/config.json               the case (workload, scale, batch, plans, optimizer, ...)
    DIR/ready.SIDE.RANK.json      a rank built its model (setup seconds, RSS)
    DIR/cmd.SIDE.N.json           command N: {"steps": k, "first": i} or {"stop": true}
    DIR/res.SIDE.N.RANK.json      per-step seconds and losses of command N on that rank
    DIR/done.SIDE.RANK.json       peak RSS at exit
    DIR/error.SIDE.RANK.txt       the traceback of a rank that failed
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from embark.data.batch import Batch, local_batch
from embark.data.jagged import JaggedBatch
from embark.models.dlrm import DLRM, DotInteraction
from embark.models.tables import EmbeddingTables
from embark.models.workloads import Workload, get_workload
from embark.training.config import TrainConfig

SIDES = ("ours", "torchrec")
EMBEDDING_OPTIMIZERS = ("adagrad", "rowwise_adagrad", "sgd")
DENSE_GRAD = "dense-grad"  # ours without the fused path: nn.EmbeddingBag + torch.optim
POLL_S = 0.005  # command-file poll interval of an idle side


def case_workload(cfg: dict[str, Any]) -> Workload:
    """The case's workload: ``cfg["workload_doc"]`` (a ``Workload.to_dict``) when given, else
    ``cfg["workload"]``; rows divided by ``cfg["scale"]``."""
    doc = cfg.get("workload_doc")
    w = Workload.from_dict(doc) if doc is not None else get_workload(cfg["workload"])
    return w.scaled(cfg["scale"]) if cfg["scale"] > 1 else w


# ------------------------------------------------------------------------------ batches
def make_batches(workload: Workload, batch_size: int, n: int, seed: int) -> list[Batch]:
    """Global batches ``0 .. n-1`` (batch ``i`` depends on ``(seed, i)`` alone): per table,
    bags of exactly ``hotness`` ids drawn from Zipf(``workload.zipf_alpha``) over the rows and
    put through a fixed permutation of the rows (hashed ids: the hot rows are spread over a
    table's row shards); dense features ``log1p`` of log-normal counts ``(B, D) float32``;
    labels Bernoulli(0.3) ``(B,) float32``. Equal on every rank and both sides."""
    perm_rng = np.random.default_rng([seed, 12345])
    samplers = []
    for t in workload.tables:
        p = np.arange(1, t.num_rows + 1, dtype=np.float64) ** -workload.zipf_alpha
        cdf = np.cumsum(p)
        cdf /= cdf[-1]
        samplers.append((t, cdf, perm_rng.permutation(t.num_rows)))
    names = [t.name for t in workload.tables]
    out = []
    for i in range(n):
        rng = np.random.default_rng([seed, i])
        ids = []
        for t, cdf, perm in samplers:
            draw = np.searchsorted(cdf, rng.random(batch_size * t.hotness), side="right")
            bag = perm[np.minimum(draw, t.num_rows - 1)]
            ids.append(torch.from_numpy(bag).view(batch_size, t.hotness))
        counts = rng.lognormal(1.0, 1.0, size=(batch_size, workload.dense_features))
        dense = torch.from_numpy(np.log1p(counts)).float()
        labels = torch.from_numpy(rng.random(batch_size) < 0.3).float()
        out.append(Batch(dense, JaggedBatch.from_dense_bags(names, ids), labels))
    return out


# ------------------------------------------------------------------------ initialisation
TableFill = Callable[[str, float, torch.Generator], None]


@torch.no_grad()
def dense_part_like_build_model(workload: Workload, seed: int, fill: TableFill) -> DLRM:
    """Our DLRM's dense part with exactly the weights ``build_model(workload, seed)`` gives it,
    its ``embeddings`` left empty: the tables' draws (``U(-b, b)``, ``b = sqrt(1/rows)``, in
    the same generator order as :func:`embark.models.dlrm.init_weights_`) go to ``fill(table
    name, b, generator)``, which must draw exactly a ``(rows, dim)`` tensor's worth."""
    with torch.device("meta"):
        model = DLRM(workload)
    for name, child in model.named_children():
        if name != "embeddings":
            child.to_empty(device="cpu")
    if isinstance(model.interaction, DotInteraction):
        n = len(workload.tables) + 1
        model.interaction.rows, model.interaction.cols = torch.triu_indices(n, n, 1)
    gen = torch.Generator().manual_seed(seed)
    table_of = {id(m): n for n, m in model.embeddings.items()}
    for _, m in model.named_modules():
        if isinstance(m, nn.Linear):
            fan_out, fan_in = m.weight.shape
            m.weight.normal_(0.0, math.sqrt(2.0 / (fan_in + fan_out)), generator=gen)
            if m.bias is not None:
                m.bias.normal_(0.0, math.sqrt(1.0 / fan_out), generator=gen)
        elif isinstance(m, nn.EmbeddingBag):
            fill(table_of[id(m)], math.sqrt(1.0 / m.num_embeddings), gen)
    model.embeddings = EmbeddingTables(())
    return model


# ----------------------------------------------------------------------------------- ours
def fused_fields_present() -> bool:
    """Whether this checkout's :class:`TrainConfig` selects the embedding path
    (``embedding_optimizer`` / ``embedding_kernel``)."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return {"embedding_optimizer", "embedding_kernel"} <= names


class OursSide:
    """Our default trainer: one process, or :class:`~embark.sharding.ShardedDLRM` on the
    default process group with our planner's plan (``cfg["plans"]["ours"]``)."""

    def __init__(self, cfg: dict[str, Any], rank: int, world: int) -> None:
        from embark.models.dlrm import build_model
        from embark.training.trainer import Trainer

        w = case_workload(cfg)
        opt = cfg["embedding_optimizer"]
        kwargs: dict[str, Any] = {"lr": cfg["lr"], "adagrad_eps": cfg["eps"], "seed": cfg["seed"]}
        if fused_fields_present():
            kwargs["embedding_optimizer"] = opt
            kwargs["embedding_kernel"] = cfg["embedding_kernel"]
            self.embedding_kernel = str(cfg["embedding_kernel"])
        elif opt != "adagrad":
            raise ValueError(
                f"ours: --embedding-optimizer {opt} needs TrainConfig.embedding_optimizer, "
                "which this checkout lacks (its tables train with the dense optimizer)"
            )
        else:
            self.embedding_kernel = DENSE_GRAD
        if world > 1:
            from embark.sharding.model import ShardedDLRM
            from embark.types import ShardingPlan

            plan = ShardingPlan.from_dict(cfg["plans"]["ours"])
            sharded = ShardedDLRM.build(w, plan, rank, seed=cfg["seed"])  # only its shards
            self.trainer = Trainer(sharded, TrainConfig(**kwargs))
        else:
            self.trainer = Trainer(build_model(w, seed=cfg["seed"]), TrainConfig(**kwargs))
        if self.embedding_kernel != DENSE_GRAD:
            self.embedding_kernel = _resolved_kernel(self.trainer.cfg)
        self.rank, self.world = rank, world

    def step(self, batch: Batch) -> float:
        """One training step on this rank's slice of the global ``batch``; the global loss."""
        return self.trainer.train_step(local_batch(batch, self.rank, self.world))


def _resolved_kernel(cfg: Any) -> str:
    """The kernel the fused path runs for ``cfg.embedding_kernel`` (``auto`` resolved by
    ``embark.training.fused.resolve_kernel`` where that exists), as a string."""
    import importlib

    kernel: Any = cfg.embedding_kernel
    try:
        fused: Any = importlib.import_module("embark.training.fused")
        kernel = fused.resolve_kernel(kernel)
    except (ImportError, AttributeError):
        pass
    return str(getattr(kernel, "value", kernel))


# ------------------------------------------------------------------------------- torchrec
class _TorchRecDLRM(nn.Module):
    """TorchRec's EmbeddingBagCollection feeding our DLRM's dense part."""

    def __init__(self, ebc: nn.Module, dense: DLRM) -> None:
        super().__init__()
        self.ebc = ebc
        self.dense = dense

    def forward(self, x: torch.Tensor, kjt: Any) -> torch.Tensor:
        pooled = self.ebc(kjt).to_dict()  # KeyedTensor → {table: (B, dim)}
        return self.dense.dense_forward(x, [pooled[n] for n in self.dense.table_names])


def torchrec_plan_constraints(workload: Workload, world: int) -> dict[str, Any]:
    """Every table on FBGEMM's fused kernel; table-wise in one process (the issue's peer)."""
    from torchrec.distributed.planner import ParameterConstraints

    types = ["table_wise"] if world == 1 else None
    return {
        t.name: ParameterConstraints(
            sharding_types=types, compute_kernels=["fused"], pooling_factors=[float(t.hotness)]
        )
        for t in workload.tables
    }


def _in_backward_optimizer(name: str) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    if name == "adagrad":
        return torch.optim.Adagrad, {}
    if name == "rowwise_adagrad":
        return RowWiseAdagrad, {}
    if name == "sgd":
        return torch.optim.SGD, {}
    raise ValueError(f"embedding optimizer must be one of {EMBEDDING_OPTIMIZERS}, got {name!r}")


class TorchRecSide:
    """TorchRec DMP + FBGEMM fused CPU kernels (module docstring), TorchRec's planner's plan
    for ``cfg["torchrec_topology"]`` (``world_size``, ``local_world_size``)."""

    def __init__(self, cfg: dict[str, Any], rank: int, world: int) -> None:
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.distributed.planner import EmbeddingShardingPlanner
        from torchrec.distributed.planner import Topology as TRTopology
        from torchrec.distributed.types import ShardingEnv
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.embedding_modules import EmbeddingBagCollection
        from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
        from torchrec.optim.keyed import KeyedOptimizerWrapper
        from torchrec.optim.optimizers import in_backward_optimizer_filter

        w = case_workload(cfg)
        self.workload, self.rank, self.world = w, rank, world
        self.embedding_kernel = "fbgemm-fused"
        ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name=t.name,
                    embedding_dim=t.dim,
                    num_embeddings=t.num_rows,
                    feature_names=[t.name],
                )
                for t in w.tables
            ],
            device=torch.device("meta"),
        )
        opt_cls, extra = _in_backward_optimizer(cfg["embedding_optimizer"])
        opt_kw = {"lr": cfg["lr"], **extra}
        if opt_cls is not torch.optim.SGD:
            opt_kw["eps"] = cfg["eps"]
        apply_optimizer_in_backward(opt_cls, ebc.parameters(), opt_kw)
        dense = dense_part_like_build_model(w, cfg["seed"], _skip_fill)  # placeholder weights
        model = _TorchRecDLRM(ebc, dense)
        self._dense = dense  # DMP shards the ebc in place and may wrap the model in DDP
        tt = cfg["torchrec_topology"]
        planner = EmbeddingShardingPlanner(
            topology=TRTopology(
                world_size=world, local_world_size=tt["local_world_size"], compute_device="cpu"
            ),
            batch_size=cfg["batch_size"] // world,
            constraints=torchrec_plan_constraints(w, world),
        )
        sharder = EmbeddingBagCollectionSharder()
        pg = dist.group.WORLD
        assert pg is not None  # the worker initialised the default group
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = planner.collective_plan(model, [sharder], pg)
            self.dmp = DistributedModelParallel(
                model,
                env=ShardingEnv.from_process_group(pg),
                device=torch.device("cpu"),
                plan=plan,
                sharders=[sharder],
            )
        self.layouts = _torchrec_layouts(plan)
        self._load_initial_weights(cfg["seed"])
        dense_params = dict(in_backward_optimizer_filter(self.dmp.named_parameters()))
        self.dense_opt = KeyedOptimizerWrapper(
            dense_params, lambda ps: torch.optim.Adagrad(ps, lr=cfg["lr"], eps=cfg["eps"])
        )

    @torch.no_grad()
    def _load_initial_weights(self, seed: int) -> None:
        """``build_model(workload, seed)``'s weights: table rows into this rank's shards
        (in place when it holds the whole table), the dense part into the replica."""
        state = self.dmp.state_dict()
        shards: dict[str, list[tuple[tuple[int, int], torch.Tensor]]] = {}
        for t in self.workload.tables:
            v = state.get(f"ebc.embedding_bags.{t.name}.weight")
            if v is None:
                shards[t.name] = []
            elif isinstance(v, torch.Tensor) and not hasattr(v, "local_shards"):
                shards[t.name] = [((0, 0), v)]
            else:
                shards[t.name] = [
                    ((s.metadata.shard_offsets[0], s.metadata.shard_offsets[1]), s.tensor)
                    for s in v.local_shards()
                ]
        rows = {t.name: (t.num_rows, t.dim) for t in self.workload.tables}

        def fill(name: str, bound: float, gen: torch.Generator) -> None:
            mine = shards[name]
            if len(mine) == 1 and tuple(mine[0][1].shape) == rows[name]:
                mine[0][1].uniform_(-bound, bound, generator=gen)
                return
            full = torch.empty(rows[name]).uniform_(-bound, bound, generator=gen)
            for (r0, c0), dst in mine:
                dst.copy_(full[r0 : r0 + dst.shape[0], c0 : c0 + dst.shape[1]])

        dense = dense_part_like_build_model(self.workload, seed, fill)
        self._dense.load_state_dict(dense.state_dict())

    def step(self, batch: Batch) -> float:
        """One step on this rank's slice; the global loss (mean over ranks' mean losses)."""
        b = local_batch(batch, self.rank, self.world)
        self.dmp.train()
        logits = self.dmp(b.dense, b.sparse.to_kjt())
        loss = F.binary_cross_entropy_with_logits(logits, b.labels)
        self.dense_opt.zero_grad()
        loss.backward()
        self.dense_opt.step()
        value = loss.detach().clone()
        if self.world > 1:
            dist.all_reduce(value)
            value /= self.world
        return float(value)


def _skip_fill(name: str, bound: float, gen: torch.Generator) -> None:
    """A table fill for placeholder weights: nothing drawn (overwritten later)."""


def _torchrec_layouts(plan: Any) -> dict[str, int]:
    """``{"sharding_type/compute_kernel": tables}`` of a TorchRec plan."""
    out: dict[str, int] = {}
    for params in plan.plan.values():
        for ps in params.values():
            k = f"{ps.sharding_type}/{ps.compute_kernel}"
            out[k] = out.get(k, 0) + 1
    return out


# --------------------------------------------------------------------------------- worker
def peak_rss_mb() -> float:
    """This process's peak resident set size in MB (``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6


def _write(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)


def _wait_command(d: Path, side: str, n: int) -> dict[str, Any]:
    path = d / f"cmd.{side}.{n}.json"
    while not path.exists():
        time.sleep(POLL_S)
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def _serve(
    d: Path, side: str, rank: int, runner: OursSide | TorchRecSide, batches: list[Batch]
) -> None:
    """Run commands until ``stop``: each ``{"steps": k, "first": i}`` runs steps ``i..i+k-1``
    on batches ``i mod len(batches)``, a barrier before each step's clock starts."""
    n = 0
    while True:
        cmd = _wait_command(d, side, n)
        if cmd.get("stop"):
            return
        seconds, losses = [], []
        for i in range(cmd["first"], cmd["first"] + cmd["steps"]):
            dist.barrier()
            t0 = time.perf_counter()
            losses.append(runner.step(batches[i % len(batches)]))
            seconds.append(time.perf_counter() - t0)
        _write(d / f"res.{side}.{n}.{rank}.json", {"seconds": seconds, "losses": losses})
        n += 1


def worker(d: Path, side: str, rank: int, world: int) -> None:
    """One rank of one side's world (module docstring)."""
    cfg = json.loads((d / "config.json").read_text())
    t0 = time.perf_counter()
    batches = make_batches(case_workload(cfg), cfg["batch_size"], cfg["num_batches"], cfg["seed"])
    dist.init_process_group(
        "gloo", init_method=f"file://{d / f'init.{side}'}", rank=rank, world_size=world
    )
    try:
        runner = OursSide(cfg, rank, world) if side == "ours" else TorchRecSide(cfg, rank, world)
        ready = {
            "setup_s": time.perf_counter() - t0,
            "rss_setup_mb": peak_rss_mb(),
            "embedding_kernel": runner.embedding_kernel,
            "torch_threads": torch.get_num_threads(),
        }
        if isinstance(runner, TorchRecSide):
            ready["layouts"] = runner.layouts
        _write(d / f"ready.{side}.{rank}.json", ready)
        _serve(d, side, rank, runner, batches)
        _write(d / f"done.{side}.{rank}.json", {"peak_rss_mb": peak_rss_mb()})
    finally:
        dist.destroy_process_group()


def main(argv: list[str]) -> int:
    d, side, rank, world = Path(argv[0]), argv[1], int(argv[2]), int(argv[3])
    if os.environ.get("BENCH_TRAINING_THREADS"):
        torch.set_num_threads(int(os.environ["BENCH_TRAINING_THREADS"]))
    try:
        worker(d, side, rank, world)
    except BaseException:
        (d / f"error.{side}.{rank}.txt").write_text(traceback.format_exc())
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
