"""What every benchmark JSON row carries: git sha, machine, versions, threads."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parent.parent


def scrub_paths(obj: Any) -> Any:
    """``obj`` with every absolute path string made machine-independent: relative to the
    checkout when it lies inside it, else just its file name (no machine's paths in results)."""
    if isinstance(obj, dict):
        return {k: scrub_paths(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [scrub_paths(v) for v in obj]
    if isinstance(obj, str) and obj.startswith("/") and "\n" not in obj and len(obj) < 4096:
        p = Path(obj)
        try:
            return str(p.resolve().relative_to(REPO_ROOT))
        except (ValueError, OSError):
            return p.name
    return obj


def git_sha() -> str:
    """The checkout's HEAD sha (``"unknown"`` outside a git checkout)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def git_changed(cwd: str | Path | None = None) -> list[str] | None:
    """Tracked files that differ from HEAD, besides ``benchmarks/results/`` (whose JSON a run
    rewrites): a non-empty list means the figures are of uncommitted code, which ``git_sha``
    alone would mislabel. ``None`` outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd or REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    paths = [line[3:].split(" -> ")[-1] for line in out.stdout.splitlines() if len(line) > 3]
    return sorted(p for p in paths if not p.startswith("benchmarks/results/"))


def machine() -> dict[str, Any]:
    """Machine and library facts for a benchmark row."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    return {
        "git_sha": git_sha(),
        "git_changed": git_changed(),
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "loadavg_1m": load,
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def write_json(path: str | Path, rows: list[dict[str, Any]], **extra: Any) -> Path:
    """Write ``{"meta": machine(), **extra, "rows": rows}`` to ``path`` (folders created);
    absolute paths in ``extra`` and ``rows`` are scrubbed (:func:`scrub_paths`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"meta": machine(), **scrub_paths(extra), "rows": scrub_paths(rows)}
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    tmp.replace(path)
    return path
