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
from dataclasses import dataclass

from embark.cli import int_at_least, output_file
from embark.models.workloads import PRESETS as WORKLOADS
from embark.outputs import write_text_atomic
from embark.planner.planner import STRATEGIES
from embark.planner.report import PlanRequest, plan_and_rate
from embark.topology import PRESETS as TOPOLOGIES
from embark.types import CommDtype
from knobs import add_knobs, from_namespace, knob

log = logging.getLogger("embark.plan")


@dataclass(frozen=True)
class PlanKnobs:
    """The knobs of ``python -m embark.plan`` (shown in ``--help``)."""

    workload: str = knob("tiny", "workload preset", choices=tuple(WORKLOADS), required=True)
    topology: str = knob("dgx-h100", "topology preset", choices=tuple(TOPOLOGIES))
    nodes: int = knob(1, "nodes (>= 1)", parse=int_at_least(1))
    batch_size: int = knob(65536, "global batch (all ranks, >= world size)", parse=int_at_least(1))
    strategy: str = knob("auto", f"{'|'.join(STRATEGIES)} or a plan file (JSON/YAML)")
    constraints: str | None = knob(None, "per-table constraints file (JSON/YAML)")
    comm_dtype: CommDtype = knob(CommDtype.FP32, "dtype of the vectors on the wire")
    rounds: int = knob(20, "greedy split rounds (>= 0)", parse=int_at_least(0))
    out: str | None = knob(
        None, "write the JSON result to this file (replaced atomically)", parse=output_file
    )
    quiet: bool = knob(False, "do not print the stats table")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m embark.plan", description=__doc__.split("\n")[0])
    add_knobs(p, PlanKnobs)
    return p


def _request(cfg: PlanKnobs) -> PlanRequest:
    """The planning part of the command line (``--out`` and ``--quiet`` stay here)."""
    return PlanRequest(
        workload=cfg.workload,
        topology=cfg.topology,
        nodes=cfg.nodes,
        batch_size=cfg.batch_size,
        strategy=cfg.strategy,
        constraints=cfg.constraints,
        comm_dtype=cfg.comm_dtype,
        rounds=cfg.rounds,
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = from_namespace(PlanKnobs, _parser().parse_args(argv))
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
