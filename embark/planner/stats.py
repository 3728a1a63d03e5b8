"""The stats table of a simulated plan (plain text, one row per rank, then totals)."""

from __future__ import annotations

from embark.planner.types import SimResult
from embark.types import ShardingPlan


def top_tables(result: SimResult, n: int = 5) -> list[tuple[str, float]]:
    """The ``n`` tables with the largest stand-alone simulated time (ms), costliest first."""
    return sorted(result.table_ms.items(), key=lambda kv: (-kv[1], kv[0]))[:n]


def format_stats(
    plan: ShardingPlan, result: SimResult, baselines: dict[str, float | None] | None = None
) -> str:
    """Per rank: memory, lookup time, communication time, tables/shards; then totals,
    imbalance, the 5 costliest tables and the baselines' step times."""
    lines = [
        f"{'rank':>5} {'node':>4} {'mem GB':>8} {'cap GB':>7} {'lookup ms':>10} {'comm ms':>9} "
        f"{'tables':>6} {'shards':>6}"
    ]
    for g in result.per_gpu:
        lines.append(
            f"{g.rank:>5} {g.rank // plan.gpus_per_node:>4} {g.memory_bytes / 1e9:>8.2f} "
            f"{g.memory_cap_bytes / 1e9:>7.1f} {g.lookup_ms:>10.3f} {g.comm_ms:>9.3f} "
            f"{g.num_tables:>6} {g.num_shards:>6}"
        )
    mem = [g.memory_bytes for g in result.per_gpu]
    lines.append("")
    lines.append(
        f"step {result.step_ms:.3f} ms pipelined ({result.step_ms_no_overlap:.3f} ms without overlap); "
        f"embedding {result.embedding_ms:.3f} ms, dense {result.dense_ms:.3f} ms"
    )
    lines.append(
        "phases (slowest rank): " + ", ".join(f"{k} {v:.3f}" for k, v in result.phases_ms.items())
    )
    lines.append(
        f"memory total {sum(mem) / 1e9:.1f} GB, max {max(mem) / 1e9:.2f} GB per rank; "
        f"imbalance (max/mean rank time) {result.imbalance:.3f}; fits memory: {result.fits_memory}"
    )
    kinds: dict[str, int] = {}
    for ts in plan.tables:
        kinds[ts.sharding_type.value + "/" + ts.cluster.value] = (
            kinds.get(ts.sharding_type.value + "/" + ts.cluster.value, 0) + 1
        )
    lines.append("layouts: " + ", ".join(f"{k} ×{v}" for k, v in sorted(kinds.items())))
    lines.append(
        "costliest tables: " + ", ".join(f"{n} {ms:.3f} ms" for n, ms in top_tables(result))
    )
    if baselines:
        lines.append(
            "baselines: "
            + ", ".join(
                f"{k} {v:.3f} ms ({v / result.step_ms:.2f}× ours)"
                if v is not None
                else f"{k} does not fit"
                for k, v in baselines.items()
            )
        )
    return "\n".join(lines)
