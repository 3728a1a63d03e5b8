"""Fixtures of the embark tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One torch intra-op thread, as the recipes and every spawned worker of these tests use:
    the models here are tiny, and on a shared 2-core machine a second thread only contends (the
    training tests took about 10× the CPU time with 2 threads as with 1). No test here checks
    a thread-count-dependent behaviour."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
