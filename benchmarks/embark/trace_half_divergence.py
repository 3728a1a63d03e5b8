"""Where a diverging run of :mod:`benchmarks.embark.bench_half_auc_seeds` first goes wrong:
step by step, the loss, any non-finite entry of any model tensor (FP16 tables included) and
the three tensors of largest magnitude.

    python -m benchmarks.embark.trace_half_divergence --workload dlrm_dcnv2 \\
        --side fp16-stochastic --seed 2 --steps 36

One line per step on stdout; it stops at the first step with a non-finite tensor, or where the
trainer refuses a step whose loss is not finite (:class:`TrainingDiverged`).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from benchmarks.embark.bench_half_auc_seeds import PRESETS, SIDES, _cfg
from embark.data import SyntheticCTR
from embark.models import build_model, get_workload
from embark.training.trainer import Trainer, TrainingDiverged


def _scan(model: torch.nn.Module) -> list[tuple[str, int, float]]:
    """``(name, non-finite count, max |finite value|)`` of every floating tensor."""
    out = []
    for name, t in model.state_dict().items():
        if t.is_floating_point():
            bad = int((~t.isfinite()).sum())
            out.append((name, bad, float(t.float().abs().nan_to_num(0, 0, 0).max())))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(PRESETS), default="dlrm_dcnv2")
    p.add_argument("--side", choices=list(SIDES), default="fp16-stochastic")
    p.add_argument("--seed", type=int, default=2)
    p.add_argument("--steps", type=int, default=36)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    preset = PRESETS[args.workload]
    workload = get_workload(preset.workload or args.workload)
    if preset.scale > 1:
        workload = workload.scaled(preset.scale)
    data = SyntheticCTR(workload, batch_size=preset.batch_size, seed=args.seed)
    model = build_model(workload, seed=args.seed)
    trainer = Trainer(model, _cfg(preset, args.side, args.seed))
    for step, batch in enumerate(data.batches(args.steps), 1):
        try:
            loss = trainer.train_step(batch)
        except TrainingDiverged as err:
            print(f"step {step}: {err}")
            return 1
        scan = _scan(model)
        bad = [(n, c) for n, c, _ in scan if c]
        top = ", ".join(f"{n} {m:.3g}" for n, _, m in sorted(scan, key=lambda x: -x[2])[:3])
        print(f"step {step}: loss {loss:.4f}; non-finite {bad or 'none'}; largest |w|: {top}")
        if bad:
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
