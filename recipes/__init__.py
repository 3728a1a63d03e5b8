"""recipes: runnable stories that compose the packages (they implement no library logic).

- ``python -m recipes.prune_dlrm``: train a DLRM-DCNv2, prune it tile-wise under a schedule
  with fine-tuning, report AUC and speed, export it and serve it (``make demo``).
- ``python -m recipes.train_dlrm``: train a DLRM with checkpoints and periodic evaluation.

Each recipe is a dataclass of knobs (shown with their defaults in ``--help``) and a
``main(cfg)``; :mod:`recipes.cli` turns the dataclass into a command line.
"""

__all__: list[str] = []
