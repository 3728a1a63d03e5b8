"""Plan the sharding of a workload and rate it: ``python -m embark.plan``.

    python -m embark.plan --workload t200 --topology dgx-h100 --nodes 8 --batch-size 65536 \\
        [--strategy auto|greedy|trw|rw|tw|dp|PLAN.json|PLAN.yaml] [--constraints FILE] \\
        [--comm-dtype fp32|fp16|bf16] [--out plan.json]

Prints the stats table and writes ``{"plan", "simulated_step_ms", "per_gpu", "baselines",
...}`` as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from embark.models.workloads import PRESETS as WORKLOADS
from embark.models.workloads import get_workload
from embark.planner.baselines import BASELINES
from embark.planner.cost import CostModel
from embark.planner.manual import load_constraints, load_plan
from embark.planner.planner import STRATEGIES, plan_sharding
from embark.planner.simulator import check_memory, simulate
from embark.planner.stats import format_stats, top_tables
from embark.planner.types import PlannerError
from embark.topology import PRESETS as TOPOLOGIES
from embark.topology import get_topology
from embark.types import CommDtype, PlanError

log = logging.getLogger("embark.plan")


def float_at_least(low: float) -> Callable[[str], float]:
    """An argparse ``type`` for a finite number >= ``low``; anything else (nan, inf, less) is a
    usage error (exit 2)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a number >= {low:g}, got {text!r}"
            ) from None
        if not (math.isfinite(value) and value >= low):
            raise argparse.ArgumentTypeError(f"expected a finite number >= {low:g}, got {text}")
        return value

    return parse


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type`` for an integer >= ``low``; anything else is a usage error (exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an integer >= {low}, got {text!r}"
            ) from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m embark.plan", description=__doc__.split("\n")[0])
    p.add_argument("--workload", required=True, choices=WORKLOADS)
    p.add_argument("--topology", default="dgx-h100", choices=TOPOLOGIES)
    p.add_argument("--nodes", type=int_at_least(1), default=1)
    p.add_argument(
        "--batch-size",
        type=int_at_least(1),
        default=65536,
        help="global batch (all ranks, >= world size)",
    )
    p.add_argument(
        "--strategy", default="auto", help=f"{'|'.join(STRATEGIES)} or a plan file (JSON/YAML)"
    )
    p.add_argument("--constraints", default=None, help="per-table constraints file (JSON/YAML)")
    p.add_argument("--comm-dtype", default="fp32", choices=[d.value for d in CommDtype])
    p.add_argument("--rounds", type=int_at_least(0), default=20, help="greedy split rounds (>= 0)")
    p.add_argument("--out", default=None, help="write the JSON result here")
    p.add_argument("--quiet", action="store_true", help="do not print the stats table")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Plan (or load), simulate, rate the baselines; returns the JSON document."""
    workload = get_workload(args.workload)
    topology = get_topology(args.topology, args.nodes)
    model = CostModel(workload, topology, args.batch_size)
    cons = load_constraints(args.constraints, workload) if args.constraints else None
    t0 = time.perf_counter()
    if args.strategy in STRATEGIES:
        plan = plan_sharding(
            workload, topology, args.batch_size, args.strategy, cons, args.comm_dtype, args.rounds
        )
    else:
        plan = load_plan(args.strategy, workload, topology)
        check_memory(plan, model)
    planning_s = time.perf_counter() - t0
    result = simulate(plan, model)
    baselines: dict[str, float | None] = {}
    for name, fn in BASELINES.items():
        try:
            baselines[name] = simulate(fn(model, CommDtype(args.comm_dtype)), model).step_ms
        except PlannerError as e:
            log.info("baseline %s: %s", name, e)
            baselines[name] = None
    if not args.quiet:
        sys.stdout.write(format_stats(plan, result, baselines) + "\n")
    doc = {
        "workload": workload.name,
        "topology": topology.name,
        "nodes": topology.num_nodes,
        "world_size": topology.world_size,
        "batch_size": args.batch_size,
        "strategy": args.strategy,
        "comm_dtype": args.comm_dtype,
        "planning_s": planning_s,
        **result.to_dict(),
        "top_tables": [{"name": n, "ms": ms} for n, ms in top_tables(result)],
        "baselines": baselines,
        "plan": plan.to_dict(),
    }
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(out)
        log.info("wrote %s", out)
    return doc


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    try:
        run(args)
    except (PlanError, PlannerError, FileNotFoundError, ValueError) as e:
        # ValueError: the topology, cost model and constraints reject bad combinations
        # (cpu-local with 2 nodes, a batch smaller than the world, an unknown table).
        log.error("error: %s", e)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
