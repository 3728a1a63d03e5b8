"""Shared test fixtures.

In CI (``CI=true``) a missing service or tool is a failure, not a skip: use the ``require``
fixture for every such check.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

IN_CI = os.environ.get("CI", "").lower() == "true"


def _require(ok: bool, what: str) -> None:
    if ok:
        return
    if IN_CI:
        pytest.fail(f"{what} is missing, and CI=true: a missing service or tool is a failure")
    pytest.skip(f"{what} is not available on this machine")


@pytest.fixture
def require() -> Callable[[bool, str], None]:
    """``require(condition, "redis-server")``: skip locally, fail in CI, when a tool is missing."""
    return _require
