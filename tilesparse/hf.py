"""Saving and restoring compressed models in Hugging Face / sentence-transformers folders.

A compressed model's state dict holds tensors only (a :class:`TileSparseLinear` keeps its
shape and tile in a ``(3,) int64`` extra-state tensor), so ``save_pretrained`` and
``SentenceTransformer.save`` write it as ``safetensors`` unchanged: under each compressed
layer's prefix the keys ``col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr, bias,
_extra_state`` stand where a dense layer has ``weight, bias``. Loading the folder back with
``from_pretrained`` / ``SentenceTransformer(path)`` builds the dense architecture (the
compressed layers' ``weight`` is reported missing and left at its initial value); then
:func:`load_compressed` puts the condensed layers in place::

    model = SentenceTransformer(path)          # dense architecture, FFN weights missing
    tilesparse.load_compressed(model, path)    # the saved TileSparseLinear layers, equal outputs

A folder's key prefixes are those of the saved module (``encoder.layer.0...`` for a
``BertModel``); in the model passed they may sit under a parent (``0.auto_model.encoder...``
in a ``SentenceTransformer``): each saved prefix names the one module whose name is the prefix
or ends with ``"." + prefix``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tilesparse.backend import Backend
from tilesparse.linear import TileSparseLinear

__all__ = ["load_compressed", "read_state"]

_MARK = "col_idx"  # a key ending in ".col_idx" marks a compressed layer's prefix
_EXTRA = "_extra_state"


def read_state(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a saved model: a ``.safetensors`` / ``.bin`` / ``.pt`` file, or a folder
    (every ``*.safetensors`` in it, else every ``pytorch_model*.bin``).

    Raises:
        FileNotFoundError: when ``path`` is missing or a folder holds no weight file.
    """
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.safetensors")) or sorted(p.glob("pytorch_model*.bin"))
        if not files:
            raise FileNotFoundError(f"{p}: no *.safetensors or pytorch_model*.bin file")
    elif p.is_file():
        files = [p]
    else:
        raise FileNotFoundError(f"{p}: no such file or folder")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        if f.suffix == ".safetensors":
            from safetensors.torch import load_file

            state.update(load_file(str(f), device="cpu"))
        else:
            state.update(torch.load(f, map_location="cpu", weights_only=True))
    return state


def _resolve(model: nn.Module, prefix: str, names: list[str]) -> str:
    """The one module name of ``model`` that is ``prefix`` or ends with ``"." + prefix``."""
    hits = [n for n in names if n == prefix or n.endswith("." + prefix)]
    if len(hits) != 1:
        what = "no module" if not hits else f"{len(hits)} modules ({hits})"
        raise ValueError(
            f"load_compressed: the saved compressed layer {prefix!r} matches {what} of the model"
        )
    return hits[0]


def _build(
    fqn: str, old: nn.Module, sub: dict[str, torch.Tensor], backend: Backend | str
) -> TileSparseLinear:
    """A :class:`TileSparseLinear` loaded from ``sub`` (one layer's keys, prefix stripped) in
    place of ``old`` (an ``nn.Linear`` or a ``TileSparseLinear`` of the same shape)."""
    extra = sub.get(_EXTRA)
    if not isinstance(extra, torch.Tensor) or tuple(extra.shape) != (3,):
        raise ValueError(
            f"load_compressed: {fqn!r} has no (3,) {_EXTRA} tensor [in, out, tile] in the saved state"
        )
    k, n, tile = (int(v) for v in extra.tolist())
    shape = (getattr(old, "in_features", None), getattr(old, "out_features", None))
    if not isinstance(old, nn.Linear | TileSparseLinear) or shape != (k, n):
        raise ValueError(
            f"load_compressed: the saved {fqn!r} is a {k}x{n} (in x out) compressed linear, the "
            f"model's is {type(old).__name__} {shape}"
        )
    for key, t in sorted(sub.items()):
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise ValueError(
                f"load_compressed: {fqn!r}: saved {key!r} holds {bad} non-finite value(s) "
                f"(NaN or inf) of {t.numel()}; expected finite weights"
            )
    ref = next(iter(old.parameters()), sub["values"])
    new = TileSparseLinear(
        k, n, tile=max(1, tile), bias="bias" in sub, backend=backend, dtype=sub["values"].dtype
    )
    try:
        new.load_state_dict(sub, strict=True)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"load_compressed: {fqn!r}: {e}") from None
    return new.to(ref.device)


def load_compressed(
    model: nn.Module, path: str | Path, backend: Backend | str = "auto"
) -> nn.Module:
    """Put the compressed layers saved at ``path`` into ``model``, in place.

    Every saved :class:`TileSparseLinear` (a key prefix with ``col_idx``) replaces the
    same-named ``nn.Linear`` (or ``TileSparseLinear``) of ``model``. All layers are read and
    checked before any is replaced: a failure leaves the model unchanged.

    Args:
        model: the dense architecture, e.g. ``SentenceTransformer(path)`` or
            ``AutoModel.from_pretrained(path)``.
        path: the saved folder or weight file (see :func:`read_state`).
        backend: the :func:`tilesparse.ops.tw_linear` backend of the restored layers.

    Returns:
        ``model``.

    Raises:
        ValueError: when the path holds no compressed layer, a saved layer matches no module
            or several, its shape or state is not the model's layer's, or a saved tensor holds
            a NaN or inf (naming the layer and tensor).
        FileNotFoundError: see :func:`read_state`.
    """
    state = read_state(path)
    prefixes = sorted(k[: -len(_MARK)] for k in state if k.endswith("." + _MARK) or k == _MARK)
    if not prefixes:
        raise ValueError(f"load_compressed: {path} holds no compressed (TileSparseLinear) layer")
    names = [n for n, _ in model.named_modules()]
    new: dict[str, TileSparseLinear] = {}
    for prefix in prefixes:
        fqn = _resolve(model, prefix.removesuffix("."), names)
        sub = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        sub = {k: v for k, v in sub.items() if "." not in k}  # this layer's own keys
        new[fqn] = _build(fqn, model.get_submodule(fqn), sub, backend)
    for fqn, module in new.items():
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, module)
    return model
