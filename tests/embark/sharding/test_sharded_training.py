"""Sharded data-parallel training equals single-process training on the global batch.

Each world size (2 and 4) is spawned once (a module-scoped fixture, as in test_collection.py):
every worker trains each case for ``STEPS`` steps on its slice of the same global batches and
writes its gathered model (``full_state_dict``) and losses; the tests compare them with the
one :class:`~embark.training.trainer.Trainer` of a single-process model on the whole global
batches. Run a worker by hand with
``python tests/embark/sharding/test_sharded_training.py --worker RANK WORLD INIT_FILE OUT_DIR``.

Checkpoints: ranks 0-1 (world 4: a 2-rank subgroup) train RESUME_AT steps on the world-2
plan and save; every rank resumes on its own world's plan (world 4: resharded), and the
single-process Trainer resumes the same files; all end equal to the uninterrupted run.

The global batch (30) does not divide by 4, so world 4 also checks uneven local batches.
Float sums are reordered (all-to-all partial sums, all-reduce), so values agree within
``tol("sharded_train")``, not bit for bit; dense parts and DP replicas must be bit-identical
across ranks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.embark.gloo_world import spawn_world, worker_main
from tests.embark.sharding.collective_spy import CollectiveSpy
from tests.embark.sharding.plans import GPN, tiny_plan, uniform_plan
from tests.tolerances import tol

WORLDS = (2, 4)
STEPS = 5
GLOBAL_BATCH = 30
RESUME_AT = 3  # checkpoint after this many steps
MODEL_SEED, DATA_SEED = 3, 7
ATOL = tol("sharded_train")  # fp32, 5 steps
WIRE_ATOL = tol("sharded_train_16bit_wire")  # 16-bit wires, 5 steps
# Adagrad's step lr·g/sqrt(Σg²) is scale-free: an element whose first gradients are tiny and
# come from cancelling sums (g ~ 1e-7 ± 1e-10 of reordering) moves by lr·(relative error of g),
# up to ~7e-5 here with initial_accumulator_value 0 — on 1 element in ~5000, while SGD agrees to
# 3e-8. A starting sum of 0.01 bounds the denominator (>= 0.1) and makes the check well posed.
CASES: dict[str, dict[str, Any]] = {
    "adagrad": {
        "optimizer": "adagrad",
        "lr": 0.05,
        "embedding_lr": 0.1,
        "initial_accumulator_value": 0.01,
    },
    "sgd_momentum": {"optimizer": "sgd", "lr": 0.05, "embedding_lr": 0.2, "momentum": 0.9},
}


# 16-bit wires: the fp32 cases' configs with every table's vectors (or one in three each of
# fp32/fp16/bf16: several wire dtypes packed in one exchange) travelling in 16 bits; gradients
# of fp16 payloads travel as bf16 (comm.grad_wire).
WIRE_CASES: dict[str, tuple[str, str]] = {
    "adagrad_fp16_wire": ("adagrad", "fp16"),
    "sgd_momentum_bf16_wire": ("sgd_momentum", "bf16"),
    "adagrad_mixed_wire": ("adagrad", "mixed"),
}


# ------------------------------------------------------------------------------ worker
def worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    from embark import ShardedDLRM, ShardingPlan, TrainConfig, Trainer, local_batch
    from embark.data import SyntheticCTR
    from embark.models.dlrm import build_model
    from embark.models.workloads import get_workload

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        workload = get_workload("tiny")
        plan = ShardingPlan.from_dict(tiny_plan(world))
        data = SyntheticCTR(workload, GLOBAL_BATCH, seed=DATA_SEED)
        batches = list(data.batches(STEPS))
        report: dict[str, Any] = {}
        for case, cfg in CASES.items():
            model = ShardedDLRM.build(workload, plan, rank, seed=MODEL_SEED)  # its shards only
            trainer = Trainer(model, TrainConfig(**cfg))
            losses = [trainer.train_step(local_batch(b, rank, world)) for b in batches]
            state = model.full_state_dict(dst=None)
            save_file(state, str(Path(out_dir, f"{case}-rank{rank}.safetensors")))
            report[case] = {
                "losses": losses,
                "step": trainer.step,
                "hierarchical": model.hierarchical_grad_reduce(),
            }
        for case, (cfg_name, wire) in WIRE_CASES.items():
            plan_d = tiny_plan(world)
            if wire == "mixed":  # several wire dtypes in one exchange
                for i, t in enumerate(plan_d["tables"]):
                    t["comm_dtype"] = ("fp32", "fp16", "bf16")[i % 3]
            model = ShardedDLRM(
                build_model(workload, seed=MODEL_SEED),
                ShardingPlan.from_dict(plan_d),
                rank,
                comm_dtype=None if wire == "mixed" else wire,
            )
            trainer = Trainer(model, TrainConfig(**CASES[cfg_name]))
            losses = [trainer.train_step(local_batch(b, rank, world)) for b in batches]
            save_file(
                model.full_state_dict(dst=None),
                str(Path(out_dir, f"{case}-rank{rank}.safetensors")),
            )
            report[case] = {"losses": losses, "step": trainer.step}
        report["resume"] = _resume(rank, world, out_dir, batches)
        report["groups"] = _groups_on_a_rank_without_tables(rank, world, out_dir, batches)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


def _resume(rank: int, world: int, out_dir: str, batches: list[Any]) -> dict[str, Any]:
    """Train RESUME_AT steps on ranks 0-1 (world 2: the default group, world 4: a 2-rank
    subgroup), checkpoint to ``<out_dir>/ckpt``, then every rank of the world resumes from it
    with its own plan and trains the remaining steps."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    from embark import (
        ShardedDLRM,
        ShardingPlan,
        TrainConfig,
        Trainer,
        load_sharded_checkpoint,
        local_batch,
        save_sharded_checkpoint,
    )
    from embark.models.dlrm import build_model
    from embark.models.workloads import get_workload
    from embark.sharding import to_single_process

    group = None if world == 2 else dist.new_group([0, 1])  # every rank creates the group
    ckpt = Path(out_dir, "ckpt")
    if rank < 2:
        model = ShardedDLRM(
            build_model(get_workload("tiny"), seed=MODEL_SEED),
            ShardingPlan.from_dict(tiny_plan(2)),
            rank,
            group,
        )
        first = Trainer(model, TrainConfig(**CASES["adagrad"]))
        for b in batches[:RESUME_AT]:
            first.train_step(local_batch(b, rank, 2))
        with CollectiveSpy() as spy:
            save_sharded_checkpoint(first, ckpt)
        saved = {"float_numel": spy.float_numel, "bytes": spy.bytes, "calls": spy.calls}
        gathered = to_single_process(first, dst=0)  # the gather oracle, not the save path
        if gathered is not None:
            gathered.save_checkpoint(Path(out_dir, "ckpt_gathered"))
    dist.barrier()
    reloaded = _reload(rank, world, out_dir, ckpt)
    trainer = load_sharded_checkpoint(ckpt, ShardingPlan.from_dict(tiny_plan(world)), rank)
    start = trainer.step
    losses = [trainer.train_step(local_batch(b, rank, world)) for b in batches[start:]]
    save_file(
        trainer.model.full_state_dict(dst=None),
        str(Path(out_dir, f"resume-rank{rank}.safetensors")),
    )
    save_sharded_checkpoint(trainer, Path(out_dir, "ckpt_end"))  # this world's plan, every rank
    out = {"start": start, "losses": losses, "step": trainer.step, "reloaded": reloaded}
    return out | ({"save": saved} if rank < 2 else {})


def _reload(rank: int, world: int, out_dir: str, ckpt: Path) -> dict[str, Any]:
    """Load the 2-rank checkpoint on this world's tiny plan and on all-table-wise and
    all-row-wise plans, and write each as gathered (``reloaded-<plan>``) for the test to
    compare exactly; load a copy with one altered shard file (the error every rank raised)."""
    import shutil

    import torch.distributed as dist

    from embark import ShardingPlan, load_sharded_checkpoint
    from embark.sharding import to_single_process

    plans = {
        "tiny": tiny_plan(world),
        "table_wise": uniform_plan(world, "table_wise"),
        "row_wise": uniform_plan(world, "row_wise"),
    }
    for name, plan in plans.items():
        loaded = load_sharded_checkpoint(ckpt, ShardingPlan.from_dict(plan), rank)
        single = to_single_process(loaded, dst=0)
        if single is not None:
            single.save_checkpoint(Path(out_dir, f"reloaded-{name}"))
    bad = Path(out_dir, "ckpt_bad")
    if rank == 0:
        shutil.copytree(ckpt, bad)
        shard = bad / "shards-1.safetensors"
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0xFF
        shard.write_bytes(bytes(data))
    dist.barrier()
    try:
        load_sharded_checkpoint(bad, ShardingPlan.from_dict(tiny_plan(world)), rank)
        error = ""
    except ValueError as e:
        error = str(e)
    return {"bad_error": error}


def _groups_on_a_rank_without_tables(
    rank: int, world: int, out_dir: str, batches: list[Any]
) -> dict[str, Any]:
    """Every table table-wise on the last rank, so the others hold no embedding parameter
    (their optimizer has only the ``dense`` group): train 2 steps, checkpoint, resume, and
    resume a single-process checkpoint; the learning rate of each group, by name."""
    import torch.distributed as dist

    from embark import (
        ShardedDLRM,
        ShardingPlan,
        TrainConfig,
        Trainer,
        load_sharded_checkpoint,
        local_batch,
        save_sharded_checkpoint,
    )
    from embark.models.dlrm import build_model
    from embark.models.workloads import get_workload

    workload = get_workload("tiny")
    plan = ShardingPlan.from_dict(
        {
            "world_size": world,
            "gpus_per_node": GPN,
            "tables": [
                {
                    "name": t.name,
                    "num_rows": t.num_rows,
                    "dim": t.dim,
                    "sharding_type": "table_wise",
                    "cluster": "reduction",
                    "shards": [
                        {
                            "rank": world - 1,
                            "row_start": 0,
                            "row_end": t.num_rows,
                            "col_start": 0,
                            "col_end": t.dim,
                        }
                    ],
                }
                for t in workload.tables
            ],
        }
    )
    cfg = TrainConfig(optimizer="adagrad", lr=0.02, embedding_lr=0.1)
    trainer = Trainer(ShardedDLRM.build(workload, plan, rank, seed=MODEL_SEED), cfg)
    for b in batches[:2]:
        trainer.train_step(local_batch(b, rank, world))
    ckpt = Path(out_dir, "ckpt_no_tables")
    save_sharded_checkpoint(trainer, ckpt)
    single = Path(out_dir, "ckpt_single")
    if rank == 0:
        Trainer(build_model(workload, seed=MODEL_SEED), cfg).save_checkpoint(single)
    dist.barrier()

    def lrs(t: Any) -> dict[str, float]:
        out = {g["name"]: g["lr"] for g in t.optimizer.param_groups}
        if t.embedding_updates.weights:  # the fused tables' update, when the rank holds one
            out["embeddings"] = t.embedding_updates.optimizer.lr
        return out

    return {
        "live": lrs(trainer),
        "resumed": lrs(load_sharded_checkpoint(ckpt, plan, rank)),
        "from_single": lrs(load_sharded_checkpoint(single, plan, rank)),
        "saved": {
            g["name"]: g["lr"]
            for g in json.loads((ckpt / "state.json").read_text())["param_groups"]
        },
    }


# ------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, Path]:
    world = request.param
    d = tmp_path_factory.mktemp(f"sharded_train{world}")
    spawn_world(__file__, world, d, timeout_s=240)
    return world, d


@pytest.fixture(scope="module")
def reference() -> dict[str, tuple[dict[str, Any], list[float], Any]]:
    """The single-process Trainer on the whole global batches: (state_dict, losses, trainer)
    per case."""
    import torch

    from embark.data import SyntheticCTR
    from embark.models.dlrm import build_model
    from embark.models.workloads import get_workload
    from embark.training.trainer import TrainConfig, Trainer

    torch.set_num_threads(1)
    workload = get_workload("tiny")
    data = SyntheticCTR(workload, GLOBAL_BATCH, seed=DATA_SEED)
    out = {}
    for case, cfg in CASES.items():
        t = Trainer(build_model(workload, seed=MODEL_SEED), TrainConfig(**cfg))
        losses = [t.train_step(b) for b in data.batches(STEPS)]
        out[case] = ({k: v.detach().clone() for k, v in t.model.state_dict().items()}, losses, t)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_equals_single_process_trainer(runs: Any, reference: Any, case: str) -> None:
    """After STEPS steps every gathered table, every dense weight and every step's global
    loss equal the single-process Trainer's on the concatenated global batches."""
    import torch
    from safetensors.torch import load_file

    world, d = runs
    want, want_losses, _ = reference[case]
    for r in range(world):
        got = load_file(str(d / f"{case}-rank{r}.safetensors"))
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], **ATOL, msg=f"rank {r} {k}")
        rep = json.loads((d / f"rank{r}.json").read_text())[case]
        assert rep["step"] == STEPS
        # world 4 is 2 nodes x 2: the dense gradients are summed node by node
        assert rep["hierarchical"] == (world == 4)
        torch.testing.assert_close(torch.tensor(rep["losses"]), torch.tensor(want_losses), **ATOL)
    # training moved the weights (the comparison is not trivially of initial weights)
    from embark.models.dlrm import build_model
    from embark.models.workloads import get_workload

    init = build_model(get_workload("tiny"), seed=MODEL_SEED).state_dict()
    assert all(not torch.equal(init[k], want[k]) for k in want if k.endswith("weight"))


@pytest.mark.parametrize("case", list(WIRE_CASES))
def test_16bit_wires_train_like_fp32(runs: Any, reference: Any, case: str) -> None:
    """With vectors on a 16-bit wire the sharded run differs from the fp32 single-process one
    only by the wire's rounding: losses and every weight within WIRE_ATOL, and not equal (the
    rounding did happen, so the wire dtype was used)."""
    import torch
    from safetensors.torch import load_file

    world, d = runs
    want, want_losses, _ = reference[WIRE_CASES[case][0]]
    worst = 0.0
    for r in range(world):
        got = load_file(str(d / f"{case}-rank{r}.safetensors"))
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], **WIRE_ATOL, msg=f"rank {r} {k}")
            worst = max(worst, float((got[k] - want[k]).abs().max()))
        rep = json.loads((d / f"rank{r}.json").read_text())[case]
        assert rep["step"] == STEPS
        torch.testing.assert_close(
            torch.tensor(rep["losses"]), torch.tensor(want_losses), **WIRE_ATOL
        )
    least = ATOL["atol"]
    assert worst > least, f"{case}: no weight moved by more than {least}: was the 16-bit wire used?"


@pytest.mark.parametrize("case", [*CASES, *WIRE_CASES])
def test_replicas_stay_bit_identical(runs: Any, case: str) -> None:
    """The dense part and the DP tables are the same bits on every rank; sharded tables
    gathered on every rank agree too."""
    import torch
    from safetensors.torch import load_file

    world, d = runs
    states = [load_file(str(d / f"{case}-rank{r}.safetensors")) for r in range(world)]
    for r in range(1, world):
        for k in states[0]:
            assert torch.equal(states[r][k], states[0][k]), (r, k)


def test_optimizer_groups_match_by_name_on_a_rank_without_tables(runs: Any) -> None:
    """A rank that holds no table has no fused tables: checkpointing and resuming (also from
    a single-process checkpoint) keep the dense group's and the tables' learning rates."""
    world, d = runs
    for r in range(world):
        got = json.loads((d / f"rank{r}.json").read_text())["groups"]
        want = {"embeddings": 0.1, "dense": 0.02} if r == world - 1 else {"dense": 0.02}
        assert got["live"] == got["resumed"] == got["from_single"] == want, (r, got)
        # the dense optimizer's group; the tables' lr is the saved config's embedding_lr
        assert got["saved"] == {"dense": 0.02}, (r, got)


def test_checkpoint_from_world_2_resumes_resharded(runs: Any, reference: Any) -> None:
    """A checkpoint written by 2 ranks after RESUME_AT steps, resumed on this world's plan
    (world 2: same world; world 4: resharded), ends equal to the uninterrupted Trainer."""
    import torch
    from safetensors.torch import load_file

    world, d = runs
    want, want_losses, _ = reference["adagrad"]
    for r in range(world):
        rep = json.loads((d / f"rank{r}.json").read_text())["resume"]
        assert (rep["start"], rep["step"]) == (RESUME_AT, STEPS)
        torch.testing.assert_close(
            torch.tensor(rep["losses"]), torch.tensor(want_losses[RESUME_AT:]), **ATOL
        )
        got = load_file(str(d / f"resume-rank{r}.safetensors"))
        for k in want:
            torch.testing.assert_close(got[k], want[k], **ATOL, msg=f"rank {r} {k}")


def test_checkpoint_from_world_2_resumes_in_one_process(runs: Any, reference: Any) -> None:
    """The same checkpoint in the single-process Trainer: weights and Adagrad sums after the
    remaining steps equal the uninterrupted run's."""
    import torch

    from embark.data import SyntheticCTR
    from embark.models.workloads import get_workload
    from embark.training.trainer import Trainer

    _, d = runs
    want, _, ref = reference["adagrad"]
    t = Trainer.load_checkpoint(d / "ckpt")
    assert t.step == RESUME_AT
    data = SyntheticCTR(get_workload("tiny"), GLOBAL_BATCH, seed=DATA_SEED)
    t.fit(data.batches(STEPS - RESUME_AT, start=RESUME_AT), STEPS - RESUME_AT, progress=False)
    got = t.model.state_dict()
    for k in want:
        torch.testing.assert_close(got[k], want[k], **ATOL, msg=k)
    mine = dict(t.model.named_parameters())
    for n, p in ref.model.named_parameters():
        if n.startswith("embeddings."):
            continue
        torch.testing.assert_close(
            t.optimizer.state[mine[n]]["sum"],
            ref.optimizer.state[p]["sum"],
            **ATOL,
            msg=n,
        )
        assert float(t.optimizer.state[mine[n]]["step"]) == STEPS
    got_rows, want_rows = t.embedding_updates.state_tensors(), ref.embedding_updates.state_tensors()
    assert got_rows.keys() == want_rows.keys() and len(got_rows) == len(get_workload("tiny").tables)
    for k in want_rows:
        torch.testing.assert_close(got_rows[k], want_rows[k], **ATOL, msg=k)


# ------------------------------------------------------------------ sharded checkpoints
def _files_equal(got: Path, want: Path) -> None:
    """Two single-process checkpoints hold the same tensors (bit for bit), step, generator,
    optimizer options and scalars."""
    import torch
    from safetensors.torch import load_file

    for f in ("model.safetensors", "optimizer.safetensors"):
        a, b = load_file(str(got / f)), load_file(str(want / f))
        assert a.keys() == b.keys(), (got, f, sorted(a.keys() ^ b.keys()))
        for k in b:
            assert torch.equal(a[k], b[k]), (got, f, k)
    sa, sb = (json.loads((p / "state.json").read_text()) for p in (got, want))
    for field in ("step", "rng", "param_groups", "optimizer_scalars", "train_config", "workload"):
        assert sa[field] == sb[field], (got, field)


def test_each_rank_saves_only_its_shards(runs: Any) -> None:
    """Ranks 0-1 of the world-2 plan each wrote exactly their shards (weights and Adagrad
    sums, every sharding type); rank 0 the dense part and the DP tables; the collectives of
    the save carried no floating-point tensor (no table rows) and a few KiB in all."""
    from safetensors.torch import load_file

    from embark.models.workloads import get_workload

    world, d = runs
    ckpt = d / "ckpt"
    state = json.loads((ckpt / "state.json").read_text())
    assert sorted(state["files"]) == [
        "model.safetensors",
        "optimizer.safetensors",
        "shards-0.safetensors",
        "shards-1.safetensors",
    ]
    plan = tiny_plan(2)
    for r in range(2):
        want: dict[str, list[int]] = {}
        for t in plan["tables"]:
            if t["sharding_type"] == "data_parallel":
                continue
            for sh in t["shards"]:
                if sh["rank"] != r:
                    continue
                shape = [sh["row_end"] - sh["row_start"], sh["col_end"] - sh["col_start"]]
                at = f"@{sh['row_start']},{sh['col_start']}"
                want[f"embeddings.{t['name']}.weight{at}"] = shape
                want[f"embeddings.{t['name']}.weight::sum{at}"] = shape
        got = load_file(str(ckpt / f"shards-{r}.safetensors"))
        assert {k: list(v.shape) for k, v in got.items()} == want, r
    tables = {k for k in load_file(str(ckpt / "model.safetensors")) if k.startswith("emb")}
    assert tables == {"embeddings.t3.weight", "embeddings.t5.weight"}  # the DP tables
    dp = {t["name"] for t in plan["tables"] if t["sharding_type"] == "data_parallel"}
    rows = sum(t.num_rows * t.dim * 4 for t in get_workload("tiny").tables if t.name not in dp)
    for r in range(2):  # file records and chunk indexes only: a small fraction of the rows
        save = json.loads((d / f"rank{r}.json").read_text())["resume"]["save"]
        assert save["calls"] > 0 and save["float_numel"] == 0, save
        assert save["bytes"] < rows / 20, (save, rows)


@pytest.mark.parametrize("plan", ["tiny", "table_wise", "row_wise"])
def test_checkpoint_reshards_exactly(runs: Any, plan: str) -> None:
    """The 2-rank checkpoint loaded on this world's tiny plan (world 2: same plan; world 4:
    resharded) and on all-table-wise and all-row-wise plans holds, gathered, exactly the
    weights and optimizer state of the trainer that saved it."""
    _, d = runs
    _files_equal(d / f"reloaded-{plan}", d / "ckpt_gathered")


def test_checkpoint_reshards_to_one_process_exactly(runs: Any, tmp_path: Path) -> None:
    """The 2-rank checkpoint in the single-process Trainer and in a one-rank sharded trainer
    holds exactly the saving trainer's weights and optimizer state."""
    from embark import ShardingPlan, load_sharded_checkpoint
    from embark.sharding import to_single_process
    from embark.training.trainer import Trainer

    _, d = runs
    Trainer.load_checkpoint(d / "ckpt").save_checkpoint(tmp_path / "single")
    _files_equal(tmp_path / "single", d / "ckpt_gathered")
    plan = ShardingPlan.from_dict(uniform_plan(1, "table_wise"))
    one = to_single_process(load_sharded_checkpoint(d / "ckpt", plan, 0))
    assert one is not None
    one.save_checkpoint(tmp_path / "one_rank")
    _files_equal(tmp_path / "one_rank", d / "ckpt_gathered")


def test_sharded_checkpoints_convert_to_sparse_files(runs: Any, tmp_path: Path) -> None:
    """``convert_checkpoint`` reads a sharded checkpoint directly: the 2-rank save converts
    to exactly the files of its gathered single-process save, and the save by every rank of
    this world (2 or 4; row-, column-, table-row-wise and DP tables) to exactly the weights
    the trainer held."""
    import numpy as np
    from safetensors.torch import load_file

    from embark.models.workloads import get_workload
    from hps.storage import convert_checkpoint, read_table

    world, d = runs
    tables = get_workload("tiny").tables
    sharded = convert_checkpoint(d / "ckpt", tmp_path / "sharded")
    gathered = convert_checkpoint(d / "ckpt_gathered", tmp_path / "gathered")
    assert sorted(sharded) == sorted(t.name for t in tables)
    for t in tables:
        for f in ("key", "emb_vector"):
            assert (sharded[t.name] / f).read_bytes() == (gathered[t.name] / f).read_bytes()
    state = json.loads((d / "ckpt_end" / "state.json").read_text())
    assert sorted(f for f in state["files"] if f.startswith("shards-")) == [
        f"shards-{r}.safetensors" for r in range(world)
    ]
    held = load_file(str(d / "resume-rank0.safetensors"))
    end = convert_checkpoint(d / "ckpt_end", tmp_path / "end")
    for t in tables:
        keys, rows = read_table(end[t.name], t.dim)
        assert np.array_equal(keys, np.arange(t.num_rows))
        assert np.array_equal(rows, held[f"embeddings.{t.name}.weight"].numpy()), t.name


def test_corrupt_shard_file_is_refused_on_every_rank(runs: Any) -> None:
    """One altered shard file: every rank's load raises naming it (also ranks that do not
    read it), and so does the single-process load."""
    from embark.training.trainer import Trainer

    world, d = runs
    bad = d / "ckpt_bad" / "shards-1.safetensors"
    for r in range(world):
        err = json.loads((d / f"rank{r}.json").read_text())["resume"]["reloaded"]["bad_error"]
        assert str(bad) in err and "sha256" in err, (r, err)
    with pytest.raises(ValueError, match="shards-1.safetensors.*sha256"):
        Trainer.load_checkpoint(d / "ckpt_bad")


if __name__ == "__main__":
    worker_main(worker, "test_sharded_training.py")
