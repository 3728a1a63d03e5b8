"""CUDA graphs for fixed-shape kernel sequences (a :class:`~tilesparse.TWChain`'s launches).

A chain of ``L`` TW layers is ``L`` binding calls per forward; at small batches the host time
of those calls exceeds the kernels' time. Captured once into a CUDA graph, the ``L`` launches
replay with one host call. The buffers a graph reads and writes must stay where they are, so a
graph belongs to one set of buffers (one call shape): :class:`GraphRunner` is made with them and
dropped with them.

What a call does (:func:`decide`, pure, so the policy is tested without a GPU)::

    graphs off, or not on a CUDA device           -> EAGER   (launch one by one)
    the caller is itself capturing a graph         -> EAGER   (its capture records our launches)
    capture failed once for these buffers          -> EAGER   (logged once, never retried)
    fewer than `warmup` eager calls so far         -> EAGER   (instance choice, lazy init, the
                                                               launchers' one-time attributes)
    no graph yet                                   -> CAPTURE (then replay it)
    otherwise                                      -> REPLAY

The graph itself is behind :class:`GraphLike` (:class:`TorchCudaGraph` on a GPU; a stand-in in
the tests).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

import torch

__all__ = ["GraphAction", "GraphLike", "GraphRunner", "TorchCudaGraph", "decide"]

log = logging.getLogger(__name__)


class GraphAction(StrEnum):
    """What one call does with its launches."""

    EAGER = "eager"
    CAPTURE = "capture"
    REPLAY = "replay"


class GraphLike(Protocol):
    """A capturable, replayable sequence of kernel launches."""

    def capture(self, launches: Callable[[], None]) -> None:
        """Record what ``launches()`` enqueues on the current stream (without running it)."""
        ...

    def replay(self) -> None:
        """Enqueue the recorded work on the current stream."""
        ...


class TorchCudaGraph:
    """:class:`GraphLike` on ``torch.cuda.CUDAGraph``: one warm-up run of ``launches`` on a side
    stream (as torch's ``graph`` documentation asks), then the capture."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, launches: Callable[[], None]) -> None:
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            launches()
        current.wait_stream(side)
        with torch.cuda.graph(self.graph):
            launches()

    def replay(self) -> None:
        self.graph.replay()


def decide(
    *,
    enabled: bool,
    on_cuda: bool,
    capturing: bool,
    failed: bool,
    eager_calls: int,
    warmup: int,
    captured: bool,
) -> GraphAction:
    """The action of one call (see the module docstring's table, top to bottom)."""
    if not enabled or not on_cuda or capturing or failed or eager_calls < warmup:
        return GraphAction.EAGER
    return GraphAction.REPLAY if captured else GraphAction.CAPTURE


@dataclass
class GraphRunner:
    """Runs one set of buffers' launches eagerly or through a graph, as :func:`decide` says.

    Attributes:
        launches: enqueues every launch on the current stream (reads and writes only the
            buffers this runner belongs to).
        make_graph: a new empty graph (called once, at the capture).
        enabled: whether graphs are wanted (the chain's option).
        on_cuda: whether the buffers are on a CUDA device.
        warmup: eager calls before the capture (>= 1: the first call selects instances and
            may build the extension, which a capture must not see).
        is_capturing: whether the caller's stream is being captured (default:
            ``torch.cuda.is_current_stream_capturing`` when ``on_cuda``).
    """

    launches: Callable[[], None]
    make_graph: Callable[[], GraphLike]
    enabled: bool
    on_cuda: bool
    warmup: int = 1
    is_capturing: Callable[[], bool] | None = None
    eager_calls: int = 0
    failed: str | None = None
    graph: GraphLike | None = field(default=None, repr=False)
    actions: list[GraphAction] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.warmup < 1:
            raise ValueError(f"warmup must be >= 1 eager call before a capture, got {self.warmup}")

    def _capturing(self) -> bool:
        if self.is_capturing is not None:
            return self.is_capturing()
        return (
            self.on_cuda and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        )

    def __call__(self) -> GraphAction:
        """Run the launches once; returns what was done (also appended to ``actions`` only
        while it differs from the last entry, so a long run keeps a short history)."""
        action = decide(
            enabled=self.enabled,
            on_cuda=self.on_cuda,
            capturing=self._capturing(),
            failed=self.failed is not None,
            eager_calls=self.eager_calls,
            warmup=self.warmup,
            captured=self.graph is not None,
        )
        if action is GraphAction.CAPTURE:
            graph = self.make_graph()
            try:
                graph.capture(self.launches)
            except RuntimeError as e:  # e.g. an operation a capture does not allow
                self.failed = f"{type(e).__name__}: {e}"
                log.warning("CUDA graph capture failed, running eagerly from now on: %s", e)
                action = GraphAction.EAGER
            else:
                self.graph = graph
        if action is GraphAction.EAGER:
            self.launches()
            self.eager_calls += 1
        else:
            assert self.graph is not None
            self.graph.replay()
        if not self.actions or self.actions[-1] is not action:
            self.actions.append(action)
        return action
