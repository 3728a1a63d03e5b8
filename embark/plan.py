"""Plan the sharding of a workload and rate it: ``python -m embark.plan``.

    python -m embark.plan --workload t200 --topology dgx-h100 --nodes 8 --batch-size 65536 \\
        [--strategy auto|greedy|trw|rw|tw|dp|PLAN.json|PLAN.yaml] [--constraints FILE] \\
        [--comm-dtype fp32|fp16|bf16] [--out plan.json]

Prints the stats table and writes ``{"plan", "simulated_step_ms", "per_gpu", "baselines",
...}`` as JSON to ``--out`` (:func:`embark.planner.report.plan_and_rate`). Exit status 2 on a
bad argument, plan, constraints file or combination.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from embark.cli import int_at_least, output_file
from embark.models.workloads import PRESETS as WORKLOADS
from embark.outputs import write_text_atomic
from embark.planner.planner import STRATEGIES
from embark.planner.report import PlanRequest, plan_and_rate
from embark.topology import PRESETS as TOPOLOGIES
from embark.types import CommDtype

log = logging.getLogger("embark.plan")


def _parser() -> argparse.ArgumentParser:
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
    p.add_argument(
        "--out",
        type=output_file,
        default=None,
        help="write the JSON result to this file (replaced atomically)",
    )
    p.add_argument("--quiet", action="store_true", help="do not print the stats table")
    return p


def _request(args: argparse.Namespace) -> PlanRequest:
    """The planning part of the command line (``--out`` and ``--quiet`` stay here)."""
    return PlanRequest(
        workload=args.workload,
        topology=args.topology,
        nodes=args.nodes,
        batch_size=args.batch_size,
        strategy=args.strategy,
        constraints=args.constraints,
        comm_dtype=CommDtype(args.comm_dtype),
        rounds=args.rounds,
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = _parser().parse_args(argv)
    try:
        report = plan_and_rate(_request(args))
    except (FileNotFoundError, ValueError) as e:  # PlanError is a ValueError
        # ValueError: the topology, cost model and constraints reject bad combinations
        # (cpu-local with 2 nodes, a batch smaller than the world, an unknown table).
        log.error("error: %s", e)
        return 2
    if not args.quiet:
        sys.stdout.write(report.stats_table() + "\n")
    if args.out:
        try:
            write_text_atomic(args.out, json.dumps(report.to_dict(), indent=1))
        except OSError as e:  # checked before planning; the folder changed since
            log.error("error: --out %r cannot be written: %s", args.out, e.strerror or e)
            return 2
        log.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
