"""A rank of the emulated-cluster test (``tests/embark/sharding/test_cluster.py``), started by
torchrun inside a node's network namespace: ``python cluster_worker.py OUT_DIR``.

Trains the tiny workload on the hand-written plan of every sharding type twice, step by step
(``Trainer.train_step``) and pipelined (:class:`~embark.sharding.SparseDistPipeline`), and
writes each run's gathered model (``{run}-rank{r}.safetensors``) and a report
(``rank{r}.json``: losses, this process's network-namespace inode, its gloo interface).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

STEPS = 4
GLOBAL_BATCH = 30
MODEL_SEED, DATA_SEED = 3, 7
TRAIN = {"optimizer": "adagrad", "lr": 0.05, "embedding_lr": 0.1, "initial_accumulator_value": 0.01}


def main(out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    from embark import ShardedDLRM, ShardingPlan, TrainConfig, Trainer, local_batch
    from embark.data import SyntheticCTR
    from embark.models.workloads import get_workload
    from embark.sharding import SparseDistPipeline
    from tests.embark.sharding.plans import tiny_plan

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        workload = get_workload("tiny")
        plan = ShardingPlan.from_dict(tiny_plan(world))
        batches = list(SyntheticCTR(workload, GLOBAL_BATCH, seed=DATA_SEED).batches(STEPS))
        mine = [local_batch(b, rank, world) for b in batches]
        report: dict[str, object] = {
            "netns": os.stat("/proc/self/ns/net").st_ino,
            "ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
            "master_addr": os.environ.get("MASTER_ADDR"),
        }
        for run in ("plain", "pipelined"):
            trainer = Trainer(
                ShardedDLRM.build(workload, plan, rank, seed=MODEL_SEED), TrainConfig(**TRAIN)
            )
            if run == "plain":
                losses = [trainer.train_step(b) for b in mine]
            else:
                pipe = SparseDistPipeline(trainer)
                losses = list(pipe.train(mine))
                report["prefetched"] = pipe.prefetched
            state = trainer.model.full_state_dict(dst=None)
            save_file(state, str(Path(out_dir, f"{run}-rank{rank}.safetensors")))
            report[run] = losses
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
