"""The recipe's dense training warm-up (``--warmup-steps``) at the default seed."""

from __future__ import annotations

import torch

from embark.data import SyntheticCTR
from embark.models.dlrm import build_model
from embark.models.workloads import get_workload
from embark.training.trainer import TrainConfig, Trainer
from recipes.prune_dlrm import PruneDLRMConfig


def _dead_bottom_units(data: SyntheticCTR, cfg: PruneDLRMConfig, warmup_steps: int) -> float:
    """The fraction of the bottom MLP's outputs that are zero on a whole eval batch after 10
    steps of the recipe's dense training."""
    model = build_model(data.workload, seed=cfg.seed)
    train_cfg = TrainConfig(lr=cfg.lr, seed=cfg.seed, warmup_steps=warmup_steps)
    Trainer(model, train_cfg).fit(data.batches(10), 10, progress=False)
    with torch.no_grad():
        out = model.bottom_mlp(data.batch(0, split="eval").dense)
    return float((out.amax(dim=0) <= 0).float().mean())


def test_the_default_warm_up_keeps_the_bottom_mlp_alive_at_seed_0():
    """Without a warm-up, Adagrad's first full-lr steps (each weight moves ~lr whatever its
    gradient) leave every unit of the bottom MLP's last ReLU dead at the default seed (tiny,
    batch 256, lr 0.05), and the dense features unused for the rest of the run; the recipe's
    warm-up keeps most of them alive."""
    cfg = PruneDLRMConfig()
    assert cfg.warmup_steps == 100
    data = SyntheticCTR(get_workload(cfg.workload), batch_size=cfg.batch_size, seed=cfg.seed)
    assert _dead_bottom_units(data, cfg, 0) == 1.0
    assert _dead_bottom_units(data, cfg, cfg.warmup_steps) < 0.5
