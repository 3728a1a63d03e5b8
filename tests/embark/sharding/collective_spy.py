"""A context manager that records every tensor passed to a ``torch.distributed`` collective
(also those inside ``all_gather_object`` and friends), to prove what a step exchanges."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "gather",
    "reduce",
    "reduce_scatter",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
)


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, list | tuple):
        return [t for item in x for t in _tensors(item)]
    return []


class CollectiveSpy:
    """Within ``with CollectiveSpy() as spy:``, ``spy.calls`` counts collective calls,
    ``spy.bytes`` sums the bytes of their tensors and ``spy.float_numel`` is the largest
    floating-point tensor passed (0: none)."""

    def __init__(self) -> None:
        self.calls = 0
        self.bytes = 0
        self.float_numel = 0
        self._saved: list[tuple[Any, str, Any]] = []

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            for t in _tensors([*args, *kwargs.values()]):
                self.bytes += t.numel() * t.element_size()
                if t.is_floating_point():
                    self.float_numel = max(self.float_numel, t.numel())
            return fn(*args, **kwargs)

        return recorded

    def __enter__(self) -> CollectiveSpy:
        for module in (dist, c10d):
            for name in COLLECTIVES:
                fn = getattr(module, name, None)
                if fn is not None:
                    self._saved.append((module, name, fn))
                    setattr(module, name, self._wrap(fn))
        return self

    def __exit__(self, *exc: object) -> None:
        for module, name, fn in reversed(self._saved):
            setattr(module, name, fn)
        self._saved.clear()
