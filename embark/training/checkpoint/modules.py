"""Modules that load their own state, in a checkpoint load's checks.

A module whose tensor sizes follow what it loads (a condensed sparse layer: the number of
kept weights is the saved mask's) overrides ``nn.Module._load_from_state_dict``; comparing
its tensors' shapes with the model's would refuse every checkpoint of another mask. Such a
module's tensors are checked by loading them into a copy of the module (one layer, small)
before the model is written, so a tensor it refuses is an error while the model is still
untouched. This is generic: ``embark`` does not know the modules' classes.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn


def self_loading_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``{fully qualified name: module}`` of the modules of ``model`` (not ``model`` itself)
    whose class overrides ``_load_from_state_dict``."""
    base = nn.Module._load_from_state_dict
    return {
        fqn: m
        for fqn, m in model.named_modules()
        if fqn and type(m)._load_from_state_dict is not base
    }


def dry_run_loads(
    tensors: Mapping[str, torch.Tensor], modules: Mapping[str, nn.Module], source: Path
) -> None:
    """Load each of ``modules``' tensors of ``tensors`` (a whole model's state dict) into a
    copy of the module, strictly.

    Args:
        source: the file ``tensors`` came from (for the message).

    Raises:
        ValueError: naming ``source``, the module and its class, with the module's message.
    """
    for fqn, m in modules.items():
        prefix = fqn + "."
        own = set(m.state_dict())
        sub = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        try:
            copy.deepcopy(m).load_state_dict({k: v for k, v in sub.items() if k in own})
        except (RuntimeError, ValueError) as err:
            raise ValueError(
                f"checkpoint file {str(source)!r}: module {fqn!r} ({type(m).__name__}) "
                f"refuses its tensors: {err}"
            ) from None
