"""``TileSparseLinear``: an ``nn.Linear`` whose weight is stored in the condensed TW format.

The module holds the six tensors of a :class:`~tilesparse.format.TWLayout` as buffers (so
``.to()``, ``state_dict`` and ``load_state_dict`` move and save them like any buffer) and
computes ``y = x · W + b`` through :func:`tilesparse.ops.tw_linear`, whose backend is chosen by
``self.backend`` (``"auto"`` by default). Worked example of the buffers (K=4, N=6, G=2)::

    mask (K x N)            buffers
      n=0 1 2 3 4 5         col_idx  = [0, 1, 4, 5]
    k=0 x x . . x .         tile_ptr = [0, 2, 3, 4]           tiles {0,1} {4} {5}
    k=1 . . . . x x         row_idx  = [0, 2, 3, 0, 1, 1, 2]
    k=2 x x . . . x         row_ptr  = [0, 3, 5, 7]
    k=3 x x . . . .         val_ptr  = [0, 6, 8, 10]
                            values   = (10,) the three dense blocks, row-major

>>> import torch
>>> dense = torch.nn.Linear(4, 6)
>>> mask = torch.zeros(6, 4, dtype=torch.bool); mask[:4, :2] = True   # like dense.weight
>>> sparse = TileSparseLinear.from_dense(dense, mask=mask, tile=2)
>>> sparse
TileSparseLinear(in_features=4, out_features=6, tile=2, tiles=2, kept_columns=4/6, nnz=8/24 (sparsity 66.7%), bias=True, backend=auto)
>>> torch.equal(sparse.to_dense().weight, dense.weight * mask)
True
>>> torch.equal(TileSparseLinear.from_dense(dense, mask_kn=mask.T, tile=2).values, sparse.values)
True
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _EXTRA_STATE_KEY_SUFFIX

from tilesparse.backend import Backend, parse_backend
from tilesparse.format import TWLayout, condense
from tilesparse.ops import tw_linear

__all__ = ["TileSparseLinear"]

_INDEX_BUFFERS = ("col_idx", "tile_ptr", "row_idx", "row_ptr", "val_ptr")
_LAYOUT_BUFFERS = (*_INDEX_BUFFERS, "values")
# dtypes a saved index buffer may have: both convert to int64 exactly
_INDEX_DTYPES = (torch.int64, torch.int32)


def _decline_fused_paths(module: nn.Module, args: tuple[Any, ...]) -> None:
    """A forward pre-hook that changes nothing. Its presence makes ``nn.TransformerEncoderLayer``
    (and ``nn.TransformerEncoder``) decline the native fused kernel, which would read the dense
    ``.weight`` of ``linear1``/``linear2`` instead of calling ``tw_linear``: the layer then runs
    its Python path, through this module's ``forward``."""
    return None


def _check_mask(
    name: str,
    mask: Any,
    want: tuple[int, int],
    layout: str,
    other_kw: str,
    other_layout: str,
) -> None:
    """Raise ``ValueError`` unless ``mask`` is a bool tensor of shape ``want``, naming both
    layouts' shapes when it has the other one's."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 2:
        desc = (
            f"{mask.dtype} {tuple(mask.shape)}"
            if isinstance(mask, torch.Tensor)
            else type(mask).__name__
        )
        raise ValueError(f"{name} must be a 2-D bool tensor {layout} = {want}, got {desc}")
    got = tuple(mask.shape)
    if got == want:
        return
    other = (want[1], want[0])
    hint = f"; a {other_layout} mask is passed as {other_kw}" if got == other else ""
    raise ValueError(
        f"{name} must be {layout} = {want} for this layer ({other_layout} would be {other}), "
        f"got {got}{hint}"
    )


class TileSparseLinear(nn.Module):
    """A linear layer with a condensed tile-wise sparse weight.

    Buffers (see :class:`~tilesparse.format.TWLayout` for their meaning):
        col_idx: ``(Nk,) int64``; tile_ptr, row_ptr, val_ptr: ``(T+1,) int64``;
        row_idx: ``(R,) int64``; values: ``(V,)`` float, the dense per-tile blocks.
    Parameters:
        bias: ``(N,)`` float, when the layer has a bias (trainable, as in ``nn.Linear``).

    Inference only: the kept weights (``values``) are a buffer and get no gradient (the
    autograd formula of :func:`tilesparse.ops.tw_linear` covers ``x`` and ``bias``), so an
    optimizer built over a compressed model trains its biases alone. Fine-tune while the mask
    is a parametrization (:class:`~tilesparse.pruner.TileSparsePruner`), then compress.

    A freshly constructed module holds an empty layout (every weight pruned); fill it with
    :meth:`from_dense` or ``load_state_dict`` of a saved one (buffers take the saved sizes;
    the saved layout is validated first — index tensors must be int64 or int32, the saved
    ``tile`` an integer >= 1 — and a load that fails leaves the module unchanged).

    Args:
        in_features: ``K``.
        out_features: ``N``.
        tile: ``G``, the widest a tile may be (> 0).
        bias: whether the layer has a bias.
        backend: the :func:`tilesparse.ops.tw_linear` backend (``"auto"``, ``"reference"``,
            ``"cpu"``, ``"cutlass"``, ``"emulated"``).
        dtype: dtype of ``values`` and ``bias``.

    Raises:
        ValueError: for non-positive sizes or tile, or an unknown backend.
    """

    col_idx: torch.Tensor
    tile_ptr: torch.Tensor
    row_idx: torch.Tensor
    row_ptr: torch.Tensor
    values: torch.Tensor
    val_ptr: torch.Tensor

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tile: int = 128,
        bias: bool = True,
        backend: Backend | str = "auto",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        for name, v in (
            ("in_features", in_features),
            ("out_features", out_features),
            ("tile", tile),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"TileSparseLinear.{name} must be a positive integer, got {v!r}")
        self.in_features = in_features
        self.out_features = out_features
        self.tile = tile
        self.backend = backend
        i64 = torch.int64
        self.register_buffer("col_idx", torch.zeros(0, dtype=i64))
        self.register_buffer("tile_ptr", torch.zeros(1, dtype=i64))
        self.register_buffer("row_idx", torch.zeros(0, dtype=i64))
        self.register_buffer("row_ptr", torch.zeros(1, dtype=i64))
        self.register_buffer("values", torch.zeros(0, dtype=dtype))
        self.register_buffer("val_ptr", torch.zeros(1, dtype=i64))
        if bias:
            self.bias: nn.Parameter | None = nn.Parameter(torch.zeros(out_features, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self._layout: TWLayout | None = None
        self.register_forward_pre_hook(_decline_fused_paths)

    @property
    def backend(self) -> str:
        """The :func:`tilesparse.ops.tw_linear` backend's name; set it to a
        :class:`~tilesparse.backend.Backend` or a name (an unknown one raises ``ValueError``)."""
        return self._backend

    @backend.setter
    def backend(self, value: Backend | str) -> None:
        self._backend = parse_backend(value).value

    # -- construction -------------------------------------------------------------------
    @classmethod
    def from_dense(
        cls,
        linear: nn.Linear,
        *positional: object,
        mask: torch.Tensor | None = None,
        tile: int = 128,
        backend: Backend | str = "auto",
        mask_kn: torch.Tensor | None = None,
    ) -> TileSparseLinear:
        """Condense ``linear`` under a mask of its kept weights.

        The mask is passed by keyword, which names its layout: ``mask=`` follows torch's
        convention (``torch.nn.utils.prune``), shaped like ``linear.weight``,
        ``(out, in) = (N, K)``; ``mask_kn=`` is the transposed form ``(in, out) = (K, N)`` (the
        orientation of :mod:`tilesparse.patterns` and :class:`TWLayout`). A square layer cannot
        tell the two apart by shape, so the layout is never guessed and a positional mask is an
        error.

        Args:
            linear: the dense layer; its ``weight`` is ``(N, K)``.
            mask: ``(N, K) bool``, shaped like ``linear.weight``: the kept entries.
            tile: ``G``.
            backend: see the class.
            mask_kn: ``(K, N) bool``, the kept entries of ``W = linear.weight.T`` (instead of
                ``mask``). Any mask is accepted (a TW-structured one gives the fewest, widest
                tiles).

        Returns:
            a module on ``linear.weight``'s device and dtype whose ``to_dense()`` has weight
            ``linear.weight * mask`` (``* mask_kn.T``) exactly.

        Raises:
            ValueError: for a positional mask (or any positional argument after ``linear``),
                when neither or both of ``mask`` and ``mask_kn`` are given, when the
                mask is not bool or its shape is not the layout it was passed as (naming both
                shapes), or for an unknown backend.
        """
        if positional:
            raise ValueError(
                "from_dense takes its mask by keyword, which names the layout: mask= (out, in), "
                "shaped like linear.weight, or mask_kn= (in, out); a positional mask would be "
                "ambiguous on a square layer (tile= and backend= are keywords too)"
            )
        weight = linear.weight.detach()
        n, k = weight.shape
        if (mask is None) == (mask_kn is None):
            raise ValueError(
                "from_dense takes exactly one mask: mask (out, in), shaped like linear.weight, "
                "or mask_kn= (in, out)"
            )
        if mask is not None:
            _check_mask("mask", mask, (n, k), "(out, in)", "mask_kn=", "(in, out)")
            kn = mask.T
        else:
            assert mask_kn is not None
            _check_mask("mask_kn", mask_kn, (k, n), "(in, out)", "mask=", "(out, in)")
            kn = mask_kn
        module = cls(
            k, n, tile=tile, bias=linear.bias is not None, backend=backend, dtype=weight.dtype
        )
        layout = condense(weight.T.cpu(), kn.cpu(), tile)
        module.set_layout(layout)
        if linear.bias is not None and module.bias is not None:
            with torch.no_grad():
                module.bias.copy_(linear.bias.detach().cpu())
        return module.to(weight.device)

    def set_layout(self, layout: TWLayout) -> None:
        """Replace the stored weight by ``layout`` (same ``K``, ``N``).

        Raises:
            ValueError: when the layout's shape differs from the module's.
        """
        if (layout.in_features, layout.out_features) != (self.in_features, self.out_features):
            raise ValueError(
                f"layout is {layout.in_features}x{layout.out_features} (KxN) but the module is "
                f"{self.in_features}x{self.out_features}"
            )
        layout.validate()
        device = self.values.device
        for name in _INDEX_BUFFERS:
            setattr(self, name, getattr(layout, name).to(device=device, dtype=torch.int64))
        self.values = layout.values.to(device=device, dtype=self.values.dtype)
        self.tile = layout.tile
        self._layout = None

    # -- the layout view ----------------------------------------------------------------
    @property
    def layout(self) -> TWLayout:
        """A :class:`TWLayout` whose tensors ARE this module's buffers (no copy); cached and
        rebuilt after ``.to()``/``load_state_dict``/:meth:`set_layout`."""
        if self._layout is None:
            self._layout = TWLayout(
                in_features=self.in_features,
                out_features=self.out_features,
                tile=self.tile,
                col_idx=self.col_idx,
                tile_ptr=self.tile_ptr,
                row_idx=self.row_idx,
                row_ptr=self.row_ptr,
                values=self.values,
                val_ptr=self.val_ptr,
            )
        return self._layout

    def _apply(self, fn: Any, recurse: bool = True) -> TileSparseLinear:
        # .to()/.cuda()/.half() replace the buffers: the cached layout (and its backend
        # cache, e.g. packed blocks) would point at the old tensors.
        self._layout = None
        out = super()._apply(fn, recurse)
        self._layout = None
        return out

    # -- state dict: buffer sizes depend on the mask, so adopt the saved sizes ------------
    def get_extra_state(self) -> torch.Tensor:
        """``(3,) int64`` ``[in_features, out_features, tile]``: a tensor, so the state dict
        holds tensors only (``safetensors``, ``save_pretrained``)."""
        return torch.tensor([self.in_features, self.out_features, self.tile], dtype=torch.int64)

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.tile = self._saved_tile(state, "extra state")
        self._layout = None

    def _saved_tile(self, state: Any, where: str) -> int:
        """The tile of a saved extra state, after checking that it is this module's shape.

        Raises:
            ValueError: when the state is not a ``(3,)`` int64/int32 tensor ``[K, N, tile]``
                (a float ``2.7`` is not truncated, a bool is not 1), the tile is under 1, or
                the shape is not this module's.
        """
        if (
            not isinstance(state, torch.Tensor)
            or state.dtype not in _INDEX_DTYPES
            or tuple(state.shape) != (3,)
        ):
            desc = (
                f"{state.dtype} {tuple(state.shape)}"
                if isinstance(state, torch.Tensor)
                else type(state).__name__
            )
            raise ValueError(
                f"{where}: expected a (3,) int64 tensor [in_features, out_features, tile], got {desc}"
            )
        k, n, tile = (int(v) for v in state.tolist())
        if tile < 1:
            raise ValueError(f"{where}: the saved tile must be an integer >= 1, got {tile}")
        if (k, n) != (self.in_features, self.out_features):
            raise ValueError(
                f"state dict holds a {k}x{n} (KxN) TileSparseLinear, this module is "
                f"{self.in_features}x{self.out_features}"
            )
        return tile

    def _check_saved_layout(self, state_dict: dict[str, Any], prefix: str) -> None:
        """Validate the layout this module would hold after loading ``state_dict`` (saved
        tensors where present, its own where not), before anything is changed.

        Raises:
            ValueError: naming the module's key prefix and the broken invariant.
        """
        where = f"state dict for TileSparseLinear {prefix.removesuffix('.') or '(root)'!r}"
        tensors: dict[str, torch.Tensor] = {}
        for name in _LAYOUT_BUFFERS:
            saved = state_dict.get(prefix + name, getattr(self, name))
            if not isinstance(saved, torch.Tensor) or saved.is_meta:
                return  # no data to check (the base class reports a non-tensor entry)
            if name in _INDEX_BUFFERS and saved.dtype not in _INDEX_DTYPES:
                # a cast would truncate (fp16 holds integers exactly only up to 2048) or wrap
                raise ValueError(
                    f"{where}: key {prefix + name!r} is an index tensor and must be torch.int64 or "
                    f"torch.int32, got {saved.dtype} (was the state dict cast to another dtype?)"
                )
            # values: only its shape is checked, so it is not copied
            own = getattr(self, name)
            tensors[name] = (
                saved.detach() if name == "values" else saved.detach().to("cpu", own.dtype)
            )
        tile = self.tile
        extra_key = prefix + _EXTRA_STATE_KEY_SUFFIX
        if extra_key in state_dict:
            tile = self._saved_tile(state_dict[extra_key], f"{where}, key {extra_key!r}")
        layout = TWLayout(
            self.in_features,
            self.out_features,
            tile,
            col_idx=tensors["col_idx"],
            tile_ptr=tensors["tile_ptr"],
            row_idx=tensors["row_idx"],
            row_ptr=tensors["row_ptr"],
            values=tensors["values"],
            val_ptr=tensors["val_ptr"],
        )
        try:
            layout.validate()
        except ValueError as e:
            keys = ",".join(_LAYOUT_BUFFERS)
            raise ValueError(
                f"{where}: keys {prefix}{{{keys}}} are not a valid KxN={self.in_features}x"
                f"{self.out_features}, tile={tile} condensed weight: {e}"
            ) from None

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # Checked first, so a corrupt checkpoint changes nothing; the loaded buffers are then
        # the validated ones (copy_ converts dtypes the same way the check did). A copy the
        # base class rejects puts everything back. A key the state dict lacks keeps the
        # module's own tensor (validated together with the saved ones); whether that is an
        # error is for load_state_dict(strict=...) to say: `strict` here is always True.
        self._check_saved_layout(state_dict, prefix)
        old = {name: getattr(self, name) for name in _LAYOUT_BUFFERS}
        old_tile = self.tile
        old_bias = None if self.bias is None else (self.bias, self.bias.detach().clone())
        n_errors = len(error_msgs)
        try:
            for name in _LAYOUT_BUFFERS:
                saved = state_dict.get(prefix + name)
                if isinstance(saved, torch.Tensor):
                    own = getattr(self, name)
                    # resize in place of copy_: the number of kept entries is the saved mask's
                    setattr(
                        self, name, torch.empty(saved.shape, dtype=own.dtype, device=own.device)
                    )
            super()._load_from_state_dict(
                state_dict,
                prefix,
                local_metadata,
                strict,
                missing_keys,
                unexpected_keys,
                error_msgs,
            )
        except BaseException:
            self._restore(old, old_tile, old_bias)
            raise
        if len(error_msgs) > n_errors:  # load_state_dict raises once every module is loaded
            self._restore(old, old_tile, old_bias)
        self._layout = None

    def _restore(
        self,
        buffers: dict[str, torch.Tensor],
        tile: int,
        bias: tuple[nn.Parameter, torch.Tensor] | None,
    ) -> None:
        """Put back the state a failed :meth:`_load_from_state_dict` found."""
        for name, t in buffers.items():
            setattr(self, name, t)
        self.tile = tile
        if bias is not None:
            param, data = bias
            if self.bias is not param:  # load_state_dict(assign=True) replaced it
                self.bias = param
            with torch.no_grad():
                param.copy_(data)
        self._layout = None

    # -- compute ------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x: (..., K)`` → ``(..., N)``, pruned output columns equal to the bias."""
        return tw_linear(x, self.layout, self.bias, self.backend)

    def to_dense(self) -> nn.Linear:
        """The equivalent ``nn.Linear`` (pruned weights zero), on this module's device."""
        dense = nn.Linear(
            self.in_features,
            self.out_features,
            bias=self.bias is not None,
            device=self.values.device,
            dtype=self.values.dtype,
        )
        with torch.no_grad():
            dense.weight.copy_(self._cpu_layout().to_dense().T)
            if self.bias is not None and dense.bias is not None:
                dense.bias.copy_(self.bias.detach())
        return dense

    @property
    def weight(self) -> torch.Tensor:
        """The dense ``(N, K)`` weight (pruned entries zero), materialised on each access and
        not stored: for code that reads ``.weight`` of a linear layer (e.g. the fast-path
        checks of ``nn.TransformerEncoderLayer``). ``forward`` never uses it."""
        return self._cpu_layout().to_dense().T.to(self.values.device)

    def mask(self) -> torch.Tensor:
        """``(N, K) bool``, shaped like :attr:`weight`: the stored entries."""
        return self._cpu_layout().mask().T.contiguous()

    def mask_kn(self) -> torch.Tensor:
        """``(K, N) bool``: the stored entries, in the layout's orientation."""
        return self._cpu_layout().mask()

    def _cpu_layout(self) -> TWLayout:
        # TWLayout.to_dense/mask build CPU tensors; index them with CPU tensors too
        lay = self.layout
        return TWLayout(
            lay.in_features,
            lay.out_features,
            lay.tile,
            *(
                getattr(lay, n).cpu()
                for n in ("col_idx", "tile_ptr", "row_idx", "row_ptr", "values", "val_ptr")
            ),
        )

    @property
    def nnz(self) -> int:
        return int(self.values.numel())

    @property
    def sparsity(self) -> float:
        """Fraction of the ``K·N`` weights that are not stored."""
        return 1.0 - self.nnz / (self.in_features * self.out_features)

    def extra_repr(self) -> str:
        total = self.in_features * self.out_features
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, tile={self.tile}, "
            f"tiles={self.layout.num_tiles}, kept_columns={self.col_idx.numel()}/{self.out_features}, "
            f"nnz={self.nnz}/{total} (sparsity {100 * self.sparsity:.1f}%), "
            f"bias={self.bias is not None}, backend={self.backend}"
        )
