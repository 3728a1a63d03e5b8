"""Modules that load their own state, in a checkpoint load's checks.

A module whose tensor sizes follow what it loads (a condensed sparse layer: the number of
kept weights is the saved mask's) overrides ``nn.Module._load_from_state_dict``; comparing
its tensors' shapes with the model's would refuse every checkpoint of another mask. Such a
module's tensors are checked by loading them into a copy of the module (one layer, small)
before the model is written, so a tensor it refuses is an error while the model is still
untouched. This is generic: ``embark`` does not know the modules' classes.

A table stored in a row format (``embark.quant.QuantizedEmbeddingBag``) saves a
``row_format`` tensor beside its rows: its dtype's name in ASCII, zero-padded. A table of
one storage loaded into a model whose table has another is named with both storages
(:func:`storage_mismatches`) rather than as a list of missing and unexpected names; two row
formats are refused by the table itself (it loads its own state, in the dry run).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

ROW_FORMAT = "row_format"


def _storage(tensors: Mapping[str, torch.Tensor], prefix: str) -> str | None:
    """How the module at ``prefix`` stores its table in ``tensors``: ``"int8 rows"`` (its
    ``row_format``), ``"float32 weight"``, or ``None`` (neither)."""
    tag = tensors.get(prefix + ROW_FORMAT)
    if tag is not None:
        raw = bytes(tag.flatten().tolist()).rstrip(b"\0") if tag.dtype == torch.uint8 else b"?"
        return f"{raw.decode('ascii', 'replace')} rows"
    weight = tensors.get(prefix + "weight")
    if weight is not None:
        return f"{str(weight.dtype).removeprefix('torch.')} weight"
    return None


def storage_mismatches(
    saved: Mapping[str, torch.Tensor], own: Mapping[str, torch.Tensor]
) -> list[str]:
    """``"'<module>': the checkpoint holds <storage>, the model has <storage>"`` for each
    module whose table is stored one way in ``saved`` and another in ``own`` (state dicts),
    where one of them is in a row format."""
    differing = set(saved) ^ set(own)
    prefixes = sorted({k.rpartition(".")[0] + "." for k in differing if "." in k})
    out = []
    for prefix in prefixes:
        a, b = _storage(saved, prefix), _storage(own, prefix)
        if a is not None and b is not None and a != b and "rows" in (a + b):
            out.append(f"{prefix[:-1]!r}: the checkpoint holds {a}, the model has {b}")
    return out


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
