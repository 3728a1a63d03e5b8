"""tilesparse: tile-wise (TW) sparsity for ``nn.Linear`` layers — importance scores, patterns,
schedules with fine-tuning, and the condensed :class:`TileSparseLinear` that runs on fast
kernels.

>>> import torch, tilesparse
>>> model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
>>> pruner = tilesparse.prune_(model, tilesparse.TileSparseConfig(sparsity=0.75, tile=32))
>>> round(pruner.overall_sparsity(), 2)
0.75
>>> model = pruner.compress()
>>> type(model[0]).__name__
'TileSparseLinear'

Where things are: ``config`` (frozen configs, JSON/YAML), ``patterns`` (masks from scores),
``importance``, ``calibrate`` (input statistics through hooks, split into fit and held-out
samples, and the least-squares reconstruction), ``refit`` (the per-layer choice of mask,
refit and damping on held-out samples behind ``prune_(..., calibration=...)``), ``obs``
(optimal brain surgeon from the inputs' Gram: :func:`sparsegpt`, EW, and :func:`tile_obs`, TW
rows only), ``schedule``,
``pruner`` (:class:`TileSparsePruner`), ``oneshot`` (:func:`prune_`), ``callback`` (the pruner
as a trainer callback), ``distill`` (:func:`distill_`: fine-tuning toward the dense model
without labels), ``format`` (the condensed layout, :class:`TWLayout`), ``linear``
(:class:`TileSparseLinear`), ``hf`` (:func:`load_compressed`: compressed layers back from a
``save_pretrained`` folder), ``memory`` (bytes as stored), ``ops`` (the ``tilesparse::tw_linear``
op, :func:`tw_linear`, its :class:`Backend`, and ``auto``'s measured choice:
:func:`auto_decision`, :func:`calibrate_auto`), and
``kernels`` (the op's CPU kernel and its CUDA glue to ``cutlass_kernels``, imported only when a
CUDA tensor arrives). Importing the package needs no GPU, no nvcc and no nvidia-cutlass.
"""

from __future__ import annotations

from tilesparse.backend import Backend
from tilesparse.calibrate import CalibrationError, LayerReconstruction
from tilesparse.callback import PruningCallback
from tilesparse.chain import TWChain, chain_, to_chain
from tilesparse.config import (
    CubicSchedule,
    Importance,
    MultiStageSchedule,
    OneShotSchedule,
    Pattern,
    ScheduleConfig,
    TileSparseConfig,
    fitting_tile,
)
from tilesparse.distill import DistillLoss, DistillReport, distill_
from tilesparse.format import TWLayout, condense, reference_matmul
from tilesparse.hf import load_compressed
from tilesparse.linear import TileSparseLinear
from tilesparse.memory import LayerMemory, ModelMemory, layer_memory, model_memory
from tilesparse.obs import sparsegpt, tile_obs
from tilesparse.oneshot import prune_
from tilesparse.ops import auto_decision, calibrate_auto, tw_linear
from tilesparse.patterns import (
    bw_mask,
    bw_masks,
    ew_mask,
    ew_masks,
    ew_per_output_mask,
    is_tile_wise,
    nm_mask,
    render_mask,
    split_budget,
    tew_mask,
    tew_masks,
    tw_mask,
    tw_masks,
    tw_rows_mask,
    tw_rows_masks,
)
from tilesparse.pruner import TileSparsePruner
from tilesparse.schedule import end_step, stages_for

__all__ = [
    "ScheduleConfig",
    "end_step",
    "stages_for",
    "Backend",
    "CalibrationError",
    "CubicSchedule",
    "DistillLoss",
    "DistillReport",
    "Importance",
    "LayerMemory",
    "LayerReconstruction",
    "ModelMemory",
    "MultiStageSchedule",
    "OneShotSchedule",
    "Pattern",
    "PruningCallback",
    "TWChain",
    "TWLayout",
    "TileSparseConfig",
    "fitting_tile",
    "TileSparseLinear",
    "TileSparsePruner",
    "auto_decision",
    "bw_mask",
    "bw_masks",
    "calibrate_auto",
    "chain_",
    "condense",
    "distill_",
    "ew_mask",
    "ew_masks",
    "ew_per_output_mask",
    "sparsegpt",
    "tile_obs",
    "is_tile_wise",
    "layer_memory",
    "load_compressed",
    "model_memory",
    "nm_mask",
    "prune_",
    "reference_matmul",
    "render_mask",
    "split_budget",
    "tew_mask",
    "tew_masks",
    "to_chain",
    "tw_linear",
    "tw_mask",
    "tw_masks",
    "tw_rows_mask",
    "tw_rows_masks",
]
