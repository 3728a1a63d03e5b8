"""ShardedEmbeddingCollection on real gloo process groups (world sizes 2 and 4).

Spawning torch processes costs seconds on a small machine, so each world size is spawned
once (a module-scoped fixture): every worker runs every case, writes its findings to a JSON
file, and the tests below only read them. Run a worker by hand with
``python tests/embark/sharding/test_collection.py --worker RANK WORLD INIT_FILE OUT_DIR``.

Numerics are exact by construction for fp32: integer-valued weights, bags of at most 4 ids
(``mean`` tables: 0, 1, 2 or 4, since EmbeddingBag's mean backward multiplies by ``1/len``)
and upstream gradients that are multiples of 12, so sums, ``mean`` divisions and their
gradients are exact in any order and ``torch.equal`` holds. The 16-bit wire cases use
non-integer weights and a tolerance.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.embark.gloo_world import reference_step, spawn_reports, worker_main
from tests.tolerances import tol

WORLDS = (2, 4)
GPN = 2
MAX_BAG = 4
NUM_BATCHES = 3  # per case, through one collection
# 16-bit payloads, non-integer weights: max |got - want| / max(1, max |want|) allowed
TOL = {"fp16": tol("wire", torch.float16)["atol"], "bf16": tol("wire", torch.bfloat16)["atol"]}
GRAD_WIRE = {"fp16": "bf16"}  # embark.sharding.comm.grad_wire


# ------------------------------------------------------------------------------ plans
def _splits(n: int, parts: int, salt: int) -> list[int]:
    """Uneven boundaries ``0 = b0 < b1 < ... < b_parts = n``."""
    cuts = sorted({1 + (salt * 7 + 5 * i * i + 3 * i) % (n - 1) for i in range(1, parts)})
    while len(cuts) < parts - 1:  # collisions: fall back to even cuts
        cuts = [n * i // parts for i in range(1, parts)]
    return [0, *cuts, n]


def _row_shards(ranks: list[int], n: int, c0: int, c1: int, salt: int) -> list[dict[str, int]]:
    b = _splits(n, len(ranks), salt)
    return [
        {"rank": r, "row_start": b[i], "row_end": b[i + 1], "col_start": c0, "col_end": c1}
        for i, r in enumerate(ranks)
    ]


def _table_entry(
    name: str,
    stype: str,
    cluster: str,
    world: int,
    rows: int,
    dim: int,
    salt: int,
    comm: str = "fp32",
) -> dict[str, Any]:
    nodes = world // GPN
    if stype == "data_parallel":
        shards = [
            {"rank": r, "row_start": 0, "row_end": rows, "col_start": 0, "col_end": dim}
            for r in range(world)
        ]
    elif stype == "table_wise":
        shards = _row_shards([salt % world], rows, 0, dim, salt)
    elif stype == "column_wise":
        owners = list(range(world)) if world == 2 else [1, 2, 3]
        cuts = _splits(dim, len(owners), salt)
        shards = [
            {
                "rank": r,
                "row_start": 0,
                "row_end": rows,
                "col_start": cuts[i],
                "col_end": cuts[i + 1],
            }
            for i, r in enumerate(owners)
        ]
    elif stype == "row_wise":
        shards = _row_shards(list(range(world)), rows, 0, dim, salt)
    elif stype == "table_row_wise":
        node = salt % nodes
        shards = _row_shards([node * GPN + g for g in range(GPN)], rows, 0, dim, salt)
    else:  # 3d; a rank holds one shard of a table, so world 2 allows only column blocks
        half = dim // 2
        if world == 2:
            shards = _row_shards([1], rows, 0, half, 0) + _row_shards([0], rows, half, dim, 0)
        elif salt % 2:  # 2 × 2 grid, the two column blocks split their rows differently
            shards = _row_shards([0, 1], rows, 0, half, salt) + _row_shards(
                [3, 2], rows, half, dim, salt + 1
            )
        else:  # 3 row shards beside 1 whole column block
            shards = _row_shards([2, 0, 1], rows, 0, half, salt) + _row_shards(
                [3], rows, half, dim, 0
            )
    return {
        "name": name,
        "num_rows": rows,
        "dim": dim,
        "sharding_type": stype,
        "cluster": cluster,
        "comm_dtype": comm,
        "shards": shards,
    }


SHARDED = ("table_wise", "column_wise", "row_wise", "table_row_wise", "3d")


def main_case(world: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every sharding type × cluster × combiner in fp32, DP, and two 16-bit tables."""
    tables, entries = [], []
    salt = 0
    specs = [
        (st, cl, comb, "fp32")
        for st in SHARDED
        for cl in ("reduction", "unique")
        for comb in ("sum", "mean")
    ]
    specs += [("data_parallel", "data_parallel", c, "fp32") for c in ("sum", "mean")]
    specs += [
        ("row_wise", "reduction", "mean", "fp16"),
        ("3d", "unique", "sum", "bf16"),
        ("data_parallel", "data_parallel", "sum", "bf16"),
    ]
    for st, cl, comb, comm in specs:
        salt += 1
        name = f"{st}-{cl}-{comb}-{comm}"
        rows, dim = 11 + 3 * salt, 6 + 2 * (salt % 2)
        tables.append({"name": name, "num_rows": rows, "dim": dim, "hotness": 2, "combiner": comb})
        entries.append(_table_entry(name, st, cl, world, rows, dim, salt, comm))
    return tables, {"world_size": world, "gpus_per_node": GPN, "tables": entries}


HIER_DIM = 6


def hier_case(world: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One table-row-wise REDUCTION table on node 0 (ranks 0 and 1)."""
    t = {"name": "trw", "num_rows": 20, "dim": HIER_DIM, "hotness": 2, "combiner": "sum"}
    e = _table_entry("trw", "table_row_wise", "reduction", world, 20, HIER_DIM, 2)
    return [t], {"world_size": world, "gpus_per_node": GPN, "tables": [e]}


def lonely_case(world: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One table-wise table on the last rank: every other rank owns nothing."""
    t = {"name": "lonely", "num_rows": 9, "dim": 5, "hotness": 2, "combiner": "sum"}
    e = _table_entry("lonely", "table_wise", "unique", world, 9, 5, world - 1)
    return [t], {"world_size": world, "gpus_per_node": GPN, "tables": [e]}


# ------------------------------------------------------------------------------ worker
def _batches(
    tables: list[Any], world: int, seed: int, inexact: frozenset[str] = frozenset()
) -> tuple[Any, ...]:
    """Local batches of every rank and upstream gradients (integer × 12 except for the
    ``inexact`` tables)."""
    import torch

    from embark.data.jagged import JaggedBatch

    g = torch.Generator().manual_seed(seed)
    sizes = [4, 6] if world == 2 else [5, 3, 0, 4]
    batches, grads = [], []
    for b in sizes:
        per_key, gk = {}, {}
        for t in tables:
            lengths = torch.randint(0, MAX_BAG + 1, (b,), generator=g, dtype=torch.int32)
            if t.combiner == "mean":
                # EmbeddingBag's mean backward multiplies by 1/len: exact for powers of two
                lengths = torch.where(lengths == 3, 4, lengths).to(torch.int32)
            # a few hot ids, so duplicates inside bags and across ranks are common
            hot = torch.randint(0, t.num_rows, (3,), generator=g)
            ids = torch.randint(0, t.num_rows, (int(lengths.sum()),), generator=g)
            pick = torch.rand(ids.shape, generator=g) < 0.5
            ids[pick] = hot[torch.randint(0, 3, (int(pick.sum()),), generator=g)]
            per_key[t.name] = (ids, lengths)
            up = torch.randint(-3, 4, (b, t.dim), generator=g).float() * 12
            gk[t.name] = up if t.name not in inexact else torch.randn(b, t.dim, generator=g)
        batches.append(JaggedBatch.from_per_key(per_key))
        grads.append(gk)
    return batches, grads


def _run_case(
    name: str,
    tables_d: list[Any],
    plan_d: dict[str, Any],
    rank: int,
    world: int,
    comm_dtype: str | None = None,
    hierarchical: bool = False,
    pipelined: bool = False,
) -> dict[str, Any]:
    import torch

    from embark.sharding import ShardedEmbeddingCollection
    from embark.types import ShardingPlan, TableConfig

    tables = [TableConfig.from_dict(t) for t in tables_d]
    plan = ShardingPlan.from_dict(plan_d)
    wire = {t.name: comm_dtype or plan[t.name].comm_dtype.value for t in tables}
    g = torch.Generator().manual_seed(1234)
    full = {}
    for t in tables:
        if wire[t.name] == "fp32":
            full[t.name] = torch.randint(-8, 9, (t.num_rows, t.dim), generator=g).float()
        else:
            full[t.name] = torch.randn(t.num_rows, t.dim, generator=g)
    m = ShardedEmbeddingCollection(
        tables, plan, rank, comm_dtype=comm_dtype, hierarchical=hierarchical
    )
    m.load_full_weights(full)
    result: dict[str, Any] = {t.name: {"fwd": True, "grad": True, "err": 0.0} for t in tables}

    def compare(t: Any, a: Any, b: Any, tol: float) -> tuple[bool, float]:
        if not a.numel():
            return a.shape == b.shape, 0.0
        a, b = a.detach(), b.detach()
        err = float((a - b).abs().max() / b.abs().max().clamp(min=1))
        if wire[t.name] == "fp32":
            return torch.equal(a, b), err
        return a.shape == b.shape and err <= tol, err

    inexact = frozenset(n for n, w in wire.items() if w != "fp32")
    data = [
        _batches(tables, world, seed=100 * it + 7, inexact=inexact) for it in range(NUM_BATCHES)
    ]
    local = [batches[rank] for batches, _ in data]
    # lazily: batch i+1 is pooled (pipelined: its keys sent) after batch i's backward
    outs = m.pipeline(local) if pipelined else (m(b) for b in local)
    for (batches, ups), out in zip(data, outs):
        ref_w, ref_out = reference_step(full, tables, batches, ups, rank)
        m.zero_grad(set_to_none=True)
        loss = sum((out[t.name] * ups[rank][t.name]).sum() for t in tables)
        loss.backward()  # type: ignore[union-attr]
        m.reduce_dp_gradients()
        for t in tables:
            res = result[t.name]
            ok, err = compare(t, out[t.name], ref_out[t.name], TOL.get(wire[t.name], 0.0))
            res["fwd"] &= ok and out[t.name].dtype == torch.float32
            res["err"] = max(res["err"], err)
            s = m.local_shards.get(t.name)
            if s is None:
                continue
            p = m.weights[t.name]
            got = p.grad if p.grad is not None else torch.zeros_like(p)
            want = ref_w[t.name].grad[s.row_start : s.row_end, s.col_start : s.col_end]
            ok, err = compare(t, got, want, TOL.get(GRAD_WIRE.get(wire[t.name], wire[t.name]), 0.0))
            res["grad"] &= ok
            res["err"] = max(res["err"], err)
    back = m.full_weights(dst=None)
    for t in tables:
        result[t.name]["full_weights"] = torch.equal(back[t.name], full[t.name])
    result["_stats"] = {f"{p}/{lv}": n for (p, lv), n in m.stats.bytes.items()}
    return result


def _catch(fn: Any) -> str:
    try:
        fn()
    except ValueError as e:
        return f"ValueError: {e}"
    except Exception as e:  # reported, and the test fails on the type
        return f"{type(e).__name__}: {e}"
    return "no error"


def _run_errors(rank: int, world: int) -> dict[str, str]:
    import torch

    from embark.data.jagged import JaggedBatch
    from embark.sharding import ShardedEmbeddingCollection
    from embark.types import ShardingPlan, TableConfig

    tables_d, plan_d = main_case(world)
    tables = [TableConfig.from_dict(t) for t in tables_d]
    out: dict[str, str] = {}
    wrong = ShardingPlan.from_dict(main_case(2 * world)[1])
    plan = ShardingPlan.from_dict(plan_d)
    out["wrong_world"] = _catch(lambda: ShardedEmbeddingCollection(tables, wrong, rank))
    out["rank_outside"] = _catch(lambda: ShardedEmbeddingCollection(tables, plan, world + 1))
    extra = [*tables, TableConfig("extra", 5, 4)]
    out["missing_table"] = _catch(lambda: ShardedEmbeddingCollection(extra, plan, rank))
    m = ShardedEmbeddingCollection(tables, plan, rank)
    batches, _ = _batches(tables, world, seed=3)
    bad_name = tables[4].name
    bad_id = tables[4].num_rows + 5

    def with_bad_id(batch: JaggedBatch) -> JaggedBatch:
        per = batch.per_key()
        per[bad_name] = (
            torch.tensor([0, bad_id]),
            torch.tensor([2] + [0] * (batch.batch_size - 1), dtype=torch.int32),
        )
        return JaggedBatch.from_per_key(per)

    mine = batches[rank]
    last = world - 1  # rank 2 of world 4 has an empty batch; use the last rank (B > 0)
    out["bad_id"] = _catch(lambda: m(with_bad_id(mine) if rank == last else mine))
    per = mine.per_key()
    per.pop(tables[0].name)
    out["missing_key"] = _catch(lambda: m(JaggedBatch.from_per_key(per) if rank == 0 else mine))
    # nothing hangs and nothing is out of step after the errors: a normal forward works
    out["after_errors"] = _catch(lambda: m(mine))
    return out


def worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    report: dict[str, Any] = {}
    try:
        t, p = main_case(world)
        report["main"] = _run_case("main", t, p, rank, world)
        report["override_bf16"] = _run_case("override_bf16", t, p, rank, world, comm_dtype="bf16")
        report["main_hierarchical"] = _run_case("main", t, p, rank, world, hierarchical=True)
        report["main_pipelined"] = _run_case("main", t, p, rank, world, pipelined=True)
        t, p = lonely_case(world)
        report["lonely"] = _run_case("lonely", t, p, rank, world)
        t, p = hier_case(world)
        report["trw_flat"] = _run_case("trw_flat", t, p, rank, world)
        report["trw_hierarchical"] = _run_case(
            "trw_hierarchical", t, p, rank, world, hierarchical=True
        )
        report["errors"] = _run_errors(rank, world)
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
        dist.destroy_process_group()


# ------------------------------------------------------------------------------ tests
@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def reports(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, list[dict[str, Any]]]:
    world = request.param
    d = tmp_path_factory.mktemp(f"sharding{world}")
    return world, spawn_reports(__file__, world, d)


@pytest.mark.parametrize(
    "case",
    [
        "main",
        "override_bf16",
        "main_hierarchical",
        "main_pipelined",
        "lonely",
        "trw_flat",
        "trw_hierarchical",
    ],
)
def test_matches_single_process_embedding_bag(reports: Any, case: str) -> None:
    """Forward equals nn.EmbeddingBag on the full table for each rank's local batch; shard
    gradients equal the slices of the single-process gradient of the global loss; the full
    tables come back from full_weights."""
    world, reps = reports
    bad = []
    for r, rep in enumerate(reps):
        for table, res in rep[case].items():
            if table.startswith("_"):
                continue
            if not (res["fwd"] and res["grad"] and res["full_weights"]):
                bad.append(f"rank {r} {table}: {res}")
    assert not bad, f"world {world}, case {case}:\n" + "\n".join(bad)


def test_main_case_covers_every_layout(reports: Any) -> None:
    world, reps = reports
    tables = {t for t in reps[0]["main"] if not t.startswith("_")}
    for st in SHARDED:
        for cl in ("reduction", "unique"):
            for comb in ("sum", "mean"):
                assert f"{st}-{cl}-{comb}-fp32" in tables
    assert {
        "data_parallel-data_parallel-sum-fp32",
        "data_parallel-data_parallel-mean-fp32",
    } <= tables
    phases = {k.split("/")[0] for k in reps[0]["main"]["_stats"]}
    assert {"header", "keys", "vectors", "vector_grads", "dp_grads"} <= phases


def test_hierarchical_reduction_bytes(reports: Any) -> None:
    """A table row-split over node 0's two ranks: flat, both owners send each node-1 sample's
    partial across; hierarchical, node 0 reduces first and sends it once (half the inter-node
    bytes) at the price of more intra-node bytes. Figures summed over ranks and batches."""
    world, reps = reports
    sizes = [4, 6] if world == 2 else [5, 3, 0, 4]
    row = HIER_DIM * 4  # fp32 bytes of one pooled row

    def total(case: str, key: str) -> int:
        return sum(rep[case]["_stats"].get(key, 0) for rep in reps)

    if world == 2:  # one node: hierarchical is the flat exchange
        assert total("trw_hierarchical", "vectors/intra") == total("trw_flat", "vectors/intra")
        assert total("trw_flat", "vectors/inter") == 0
        return
    remote = sum(sizes[GPN:])  # samples on node 1
    for phase in ("vectors", "vector_grads"):
        n = NUM_BATCHES
        assert total("trw_flat", f"{phase}/inter") == n * 2 * remote * row
        assert total("trw_hierarchical", f"{phase}/inter") == n * remote * row
        assert total("trw_flat", f"{phase}/intra") == n * (sizes[0] + sizes[1]) * row
        assert total("trw_hierarchical", f"{phase}/intra") == n * sum(sizes) * row


def test_errors_are_raised_on_every_rank(reports: Any) -> None:
    world, reps = reports
    bad = main_case(world)[0][4]
    for r, rep in enumerate(reps):
        e = rep["errors"]
        assert (
            e["wrong_world"].startswith("ValueError")
            and f"world size {2 * world}" in e["wrong_world"]
        )
        assert (
            e["rank_outside"].startswith("ValueError") and f"rank {world + 1}" in e["rank_outside"]
        )
        assert "PlanError" in e["missing_table"] or e["missing_table"].startswith("ValueError")
        assert "'extra'" in e["missing_table"] and "missing from the plan" in e["missing_table"]
        # every rank names the rank, the table and the id that only the last rank looked up
        assert e["bad_id"].startswith("ValueError"), (r, e["bad_id"])
        assert f"rank {world - 1}:" in e["bad_id"] and f"table {bad['name']!r}" in e["bad_id"]
        assert f"but id {bad['num_rows'] + 5} was looked up" in e["bad_id"]
        assert e["missing_key"].startswith("ValueError") and "rank 0" in e["missing_key"]
        assert e["after_errors"] == "no error", (r, e["after_errors"])


if __name__ == "__main__":
    worker_main(worker, "test_collection.py")
