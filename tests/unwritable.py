"""A folder in which nothing can be created, for tests of "cannot be written" errors.

Permission bits do not stop root (these tests may run as root in a container), so as root a
read-only system folder is used instead; each candidate is tried before it is returned.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

_ROOT_CANDIDATES = (Path("/sys"), Path("/proc/self/fdinfo"))


def _refuses_writes(folder: Path) -> bool:
    try:
        os.rmdir(tempfile.mkdtemp(dir=folder))
    except OSError:
        return True
    return False


def unwritable_folder(tmp_path: Path) -> Path:
    """An existing folder where creating a file or folder fails (skips the test when this
    machine has none)."""
    if os.geteuid() != 0:
        folder = tmp_path / "read-only"
        folder.mkdir()
        folder.chmod(0o555)
        if _refuses_writes(folder):
            return folder
    for folder in _ROOT_CANDIDATES:
        if folder.is_dir() and _refuses_writes(folder):
            return folder
    pytest.skip("no folder on this machine refuses writes (running as root, /sys writable)")
