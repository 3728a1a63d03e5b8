"""K-major chains of TW layers: an MLP or FFN block of :class:`TileSparseLinear` layers run with
the activations kept in the kernel's ``Xᵀ`` layout from layer to layer.

A row-major ``tw_linear`` call packs ``X → Xᵀ`` (a fresh padded buffer), initialises ``Yᵀ``
(zeros or the bias) and copies ``Yᵀ → Y`` back, every layer, every call. A :class:`TWChain`
does one layout change where the chain starts and one where it ends::

    x (M, K0) ─copy─▶ xt (K0, B) ─L0─▶ yt0 (N0, B) ─L1─▶ yt1 (N1, B) … ─copy─▶ y (M, N_last)
                      allocated once       each layer's output buffer allocated once per shape

``B = round_up(M, 8)``: the batch padded to the kernel's alignment (no padding when ``M`` is a
multiple of 8). Padding columns are zeroed once, when the buffers are made; batch columns are
independent, so whatever the padding columns of a layer's output hold never reaches a real
column. Bias and activation (ReLU, GELU) are fused in the kernel's epilogue
(``D = act(acc + bias[n])`` in fp32, rounded once; :mod:`cutlass_kernels.epilogue`) with
``beta = 0``: one kernel per layer, and the output buffers are never zero-filled per call. Rows
of pruned output columns are never written by the kernel: they are set once to ``act(bias[n])``
(the epilogue's arithmetic) when the buffer is made. Layers are packed (and their layouts
validated) once per dtype/device, again only after a layer's tensors are replaced or edited in
place; the kernel instances are chosen once per call shape
(:func:`cutlass_kernels.launch.bind`). A call makes no ``.item()``, host sync or instance
selection of its own: one copy in, one binding call per layer, one allocation and copy out.
With ``cuda_graph=True`` the layers' launches of a call shape are captured into one CUDA graph
after a warm-up call and replayed from then on (:mod:`tilesparse.kernels.graphs`).

Backends (:class:`~tilesparse.backend.Backend`, the chain's ``backend``):

* ``emulated`` — the K-major path through :func:`cutlass_kernels.reference.emulate` (any
  device, any float dtype): exactly what the kernel computes from the same packed buffers.
* ``cutlass`` — the K-major path on the CUDA kernel (fp16/bf16 CUDA tensors), bit-equal to
  ``emulated`` (the emulation computes the kernel's epilogue op for op, GELU included).
* anything else (``auto``, ``cpu``, ``reference``) — the layers one by one, as the
  ``nn.Sequential`` would run them (each layer with its own backend).

The K-major path runs without autograd: in training (a dropout that is active, or gradients
needed for ``x`` or a bias) the chain runs as the ``nn.Sequential``.

>>> import torch
>>> from torch import nn
>>> from tilesparse import TileSparseLinear, to_chain
>>> fc1 = TileSparseLinear.from_dense(nn.Linear(16, 32), mask=torch.ones(32, 16, dtype=torch.bool), tile=8)
>>> fc2 = TileSparseLinear.from_dense(nn.Linear(32, 16), mask=torch.ones(16, 32, dtype=torch.bool), tile=8)
>>> chain = to_chain(nn.Sequential(fc1, nn.ReLU(), fc2), backend="emulated")
>>> chain.activations()
('relu', 'none')
>>> with torch.no_grad():
...     y = chain(torch.ones(3, 16))
>>> y.shape
torch.Size([3, 16])
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tilesparse.backend import Backend, parse_backend
from tilesparse.linear import TileSparseLinear

if TYPE_CHECKING:
    from cutlass_kernels.epilogue import Activation
    from cutlass_kernels.launch import BoundLaunch
    from cutlass_kernels.reference import TWLaunch, TWPackedWeight
    from tilesparse.kernels.graphs import GraphRunner

__all__ = ["TWChain", "chain_", "to_chain"]

_KMAJOR = (Backend.EMULATED, Backend.CUTLASS)
_PASS_THROUGH = (nn.Identity, nn.Dropout)
_ALIGNMENT = 8  # cutlass_kernels.manifest.ALIGNMENT (checked by the emulation's launch check)


def _activation_of(module: nn.Module) -> Activation | None:
    """The epilogue activation of ``module``, or None when it is not one the epilogue fuses."""
    from cutlass_kernels.epilogue import Activation

    if type(module) is nn.ReLU:
        return Activation.RELU
    if type(module) is nn.GELU:
        return Activation.GELU_TANH if module.approximate == "tanh" else Activation.GELU
    return None


@dataclass(frozen=True)
class _Step:
    """One layer of the chain: the index of its ``TileSparseLinear`` and the fused activation."""

    layer: int
    activation: Activation


def _parse(modules: list[nn.Module]) -> tuple[_Step, ...]:
    """The chain's steps; raises ``ValueError`` naming the first module that does not fit."""
    from cutlass_kernels.epilogue import Activation

    steps: list[_Step] = []
    pending: int | None = None  # the layer whose activation slot is still open
    prev_n: int | None = None
    for i, m in enumerate(modules):
        if isinstance(m, TileSparseLinear):
            if prev_n is not None and m.in_features != prev_n:
                raise ValueError(
                    f"TWChain: module {i} takes {m.in_features} features but the layer before "
                    f"gives {prev_n}"
                )
            if pending is not None:
                steps.append(_Step(pending, Activation.NONE))
            pending, prev_n = i, m.out_features
            continue
        act = _activation_of(m)
        if act is not None and pending is not None:
            steps.append(_Step(pending, act))
            pending = None
            continue
        if isinstance(m, _PASS_THROUGH) and (steps or pending is not None):
            continue
        raise ValueError(
            f"TWChain: module {i} ({type(m).__name__}) cannot be chained: a chain is "
            "TileSparseLinear layers, each followed by at most one nn.ReLU/nn.GELU, with "
            "nn.Dropout/nn.Identity anywhere after the first layer"
        )
    if pending is not None:
        steps.append(_Step(pending, Activation.NONE))
    if not steps:
        raise ValueError("TWChain: needs at least one TileSparseLinear")
    return tuple(steps)


def _stamp(layer: TileSparseLinear) -> tuple[int, ...]:
    """Identity and version of every tensor a layer's packing reads (host metadata only)."""
    out: list[int] = []
    for t in (
        layer.col_idx,
        layer.tile_ptr,
        layer.row_idx,
        layer.row_ptr,
        layer.values,
        layer.val_ptr,
        layer.bias,
    ):
        if t is not None:
            out += [id(t), t._version]
    return tuple(out)


@dataclass
class _Packed:
    """The chain's packed weights and epilogue biases for one (backend, dtype, device)."""

    key: tuple[Any, ...]
    stamp: tuple[tuple[int, ...], ...]
    weights: tuple[TWPackedWeight, ...]
    biases: tuple[torch.Tensor | None, ...]


def _on_kernel_device(x: torch.Tensor) -> bool:
    """Whether ``x`` can feed the CUDA kernels (fp16/bf16 on a CUDA device)."""
    return x.device.type == "cuda" and x.dtype in (torch.float16, torch.bfloat16)


@dataclass
class _Buffers:
    """The K-major buffers and launches of one call shape (``rows`` real batch rows); on the
    ``cutlass`` backend, the launches bound to their instances and the graph runner."""

    rows: int
    xt: torch.Tensor
    launches: tuple[TWLaunch, ...]
    bound: tuple[BoundLaunch, ...] = ()
    runner: GraphRunner | None = None


class TWChain(nn.Sequential):
    """An ``nn.Sequential`` of :class:`TileSparseLinear` layers (each optionally followed by
    ``nn.ReLU``/``nn.GELU``, with ``nn.Dropout``/``nn.Identity`` allowed) run K-major (see the
    module docstring). Its children, their names and so its ``state_dict`` keys are the
    Sequential's.

    Args:
        *modules: the modules, in order.
        backend: ``emulated``/``cutlass`` for the K-major path, anything else runs the layers
            one by one.
        cuda_graph: on ``cutlass``, capture each call shape's launches into a CUDA graph after
            one eager call and replay it (``x`` is copied into the graph's input buffer; the
            output is a fresh tensor, as without graphs). Ignored on other backends.

    Raises:
        ValueError: a module that cannot be chained, layer sizes that do not follow, or an
            unknown backend.

    Forward: ``x (..., K0)`` → ``(..., N_last)`` in ``x.dtype``.
    """

    def __init__(
        self,
        *modules: nn.Module,
        backend: Backend | str = Backend.EMULATED,
        cuda_graph: bool = False,
    ) -> None:
        super().__init__(*modules)
        self._steps = _parse(list(modules))
        self.backend = backend
        self.cuda_graph = cuda_graph
        self._packed: _Packed | None = None
        self._bufs: _Buffers | None = None

    @property
    def backend(self) -> str:
        """The chain's backend name (set a :class:`Backend` or a name)."""
        return self._backend.value

    @backend.setter
    def backend(self, value: Backend | str) -> None:
        self._backend = parse_backend(value)

    def activations(self) -> tuple[str, ...]:
        """The fused activation of each layer, in order (``"none"``, ``"relu"``, ``"gelu"``,
        ``"gelu_tanh"``)."""
        return tuple(s.activation.value for s in self._steps)

    def layers(self) -> tuple[TileSparseLinear, ...]:
        """The chain's TW layers, in order."""
        mods = list(self)
        out = []
        for s in self._steps:
            m = mods[s.layer]
            assert isinstance(m, TileSparseLinear)
            out.append(m)
        return tuple(out)

    def _apply(self, fn: Any, recurse: bool = True) -> TWChain:
        # .to()/.half() replace the layers' tensors: packs and buffers are made again.
        self._packed, self._bufs = None, None
        super()._apply(fn, recurse)
        return self

    def _kmajor(self, x: torch.Tensor) -> bool:
        if self._backend not in _KMAJOR:
            return False
        if self.training and any(type(m) is nn.Dropout and m.p > 0 for m in self):
            return False
        if torch.is_grad_enabled():
            layers = self.layers()
            if x.requires_grad or any(
                lay.bias is not None and lay.bias.requires_grad for lay in layers
            ):
                return False
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._kmajor(x):
            return super().forward(x)
        layers = self.layers()
        k0, n_last = layers[0].in_features, layers[-1].out_features
        if x.shape[-1] != k0:
            raise ValueError(
                f"TWChain: x has {x.shape[-1]} features (shape {tuple(x.shape)}), expected {k0}"
            )
        if self._backend is Backend.CUTLASS and not _on_kernel_device(x):
            raise ValueError(
                f"TWChain backend 'cutlass' takes float16/bfloat16 CUDA tensors, got {x.dtype} on {x.device}"
            )
        lead = x.shape[:-1]
        m = math.prod(lead)
        bufs = self._call_buffers(layers, m, x.dtype, x.device)
        bufs.xt[:, :m].copy_(x.reshape(m, k0).t())  # the one layout change in
        if bufs.runner is not None:
            bufs.runner()
        else:
            import cutlass_kernels.reference as reference

            for launch in bufs.launches:
                reference.emulate(launch)
        y = x.new_empty((m, n_last))
        y.copy_(bufs.launches[-1].yt[:, :m].t())  # the one layout change out
        return y.reshape(*lead, n_last)

    def _pack(
        self, layers: tuple[TileSparseLinear, ...], dtype: torch.dtype, device: torch.device
    ) -> _Packed:
        """The packed weights, made (and their layouts validated) once per (backend, dtype,
        device) and again only when a layer's tensors changed."""
        key = (self._backend, dtype, device)
        stamp = tuple(_stamp(lay) for lay in layers)
        p = self._packed
        if p is not None and p.key == key and p.stamp == stamp:
            return p
        import cutlass_kernels.reference as reference

        weights: list[TWPackedWeight] = []
        for lay in layers:
            if self._backend is Backend.CUTLASS:
                from cutlass_kernels.launch import tile_limit
                from tilesparse.kernels.cuda import packed_weight

                weights.append(packed_weight(lay.layout, dtype, device, tile_limit(dtype, device)))
            else:
                weights.append(reference.pack_weight(lay.layout, dtype=dtype, device=device))
        biases = tuple(
            None
            if lay.bias is None
            else lay.bias.detach().to(device=device, dtype=dtype).contiguous()
            for lay in layers
        )
        self._packed = _Packed(key, stamp, tuple(weights), biases)
        self._bufs = None
        return self._packed

    def _call_buffers(
        self,
        layers: tuple[TileSparseLinear, ...],
        rows: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> _Buffers:
        """The call's buffers and launches: made once per packing and batch size."""
        packed = self._pack(layers, dtype, device)
        b = self._bufs
        if b is not None and b.rows == rows:
            return b
        import cutlass_kernels.reference as reference
        from cutlass_kernels.epilogue import apply_activation

        batch = -(-rows // _ALIGNMENT) * _ALIGNMENT
        xt = torch.zeros((layers[0].in_features, batch), dtype=dtype, device=device)
        launches: list[TWLaunch] = []
        src = xt
        for lay, w, bias, step in zip(
            layers, packed.weights, packed.biases, self._steps, strict=True
        ):
            yt = torch.zeros((lay.out_features, batch), dtype=dtype, device=device)
            if bias is not None:  # rows of pruned columns: act(bias), never written again
                acc = torch.float64 if dtype == torch.float64 else torch.float32
                yt.copy_(apply_activation(bias.to(acc), step.activation).unsqueeze(1).expand_as(yt))
            launches.append(
                reference.TWLaunch(
                    w, src, yt, batch, rows, 1.0, 0.0, bias=bias, activation=step.activation
                )
            )
            src = yt
        self._bufs = _Buffers(rows, xt, tuple(launches))
        if self._backend is Backend.CUTLASS:
            self._bind(self._bufs)
        return self._bufs

    def _bind(self, bufs: _Buffers) -> None:
        """Choose each launch's instance once and make the runner that launches them."""
        from cutlass_kernels.launch import bind
        from tilesparse.kernels.graphs import GraphRunner, TorchCudaGraph

        bufs.bound = tuple(bind(launch) for launch in bufs.launches)
        device = bufs.xt.device
        bound = bufs.bound

        def launches() -> None:
            stream = torch.cuda.current_stream(device).cuda_stream
            for b in bound:
                b.run(stream)

        def make_graph() -> TorchCudaGraph:
            return TorchCudaGraph(device)

        bufs.runner = GraphRunner(
            launches, make_graph, enabled=self.cuda_graph, on_cuda=_on_kernel_device(bufs.xt)
        )


def to_chain(
    module: nn.Sequential, backend: Backend | str | None = None, *, cuda_graph: bool = False
) -> TWChain:
    """A :class:`TWChain` over ``module``'s children (the same module objects: nothing is
    copied), e.g. a compressed MLP or FFN block ``Sequential(fc1, GELU(), Dropout(), fc2)``.

    Args:
        module: an ``nn.Sequential`` of chainable modules (see :class:`TWChain`).
        backend: the chain's backend (default: ``cutlass`` when the first layer's tensors are
            on a CUDA device, else ``emulated``).
        cuda_graph: as :class:`TWChain`.

    Raises:
        ValueError: as :class:`TWChain`.
    """
    if not isinstance(module, nn.Sequential):
        raise ValueError(f"to_chain takes an nn.Sequential, got {type(module).__name__}")
    mods = list(module)
    if backend is None:
        first = next((m for m in mods if isinstance(m, TileSparseLinear)), None)
        on_cuda = first is not None and first.values.device.type == "cuda"
        backend = Backend.CUTLASS if on_cuda else Backend.EMULATED
    chain = TWChain(*mods, backend=backend, cuda_graph=cuda_graph)
    chain.train(module.training)
    return chain


def _chainable(module: nn.Sequential) -> bool:
    try:
        _parse(list(module))
    except ValueError:
        return False
    return True


def chain_(
    model: nn.Module, backend: Backend | str | None = None, *, cuda_graph: bool = False
) -> list[str]:
    """Replace, in place, every ``nn.Sequential`` inside ``model`` that is a chain (see
    :class:`TWChain`) with a :class:`TWChain` over the same modules; ``state_dict`` keys do not
    change. Other modules are left as they are.

    Args:
        model: e.g. a compressed model (``TileSparsePruner.compress()``'s result).
        backend: as :func:`to_chain`.
        cuda_graph: as :class:`TWChain`.

    Returns:
        the qualified names of the replaced modules (``""`` for ``model`` itself, which is
        then NOT replaced: use :func:`to_chain` on it).
    """
    replaced: list[str] = []
    for name, mod in list(model.named_modules()):
        if name == "" or type(mod) is not nn.Sequential or not _chainable(mod):
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, attr, to_chain(mod, backend, cuda_graph=cuda_graph))
        replaced.append(name)
    return replaced
