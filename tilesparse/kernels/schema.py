"""The contract of ``tilesparse::tw_linear`` that every implementation shares: its name, the
dtypes it takes, and the checks each implementation runs before it touches the data.

The op (:mod:`tilesparse.ops`) has one fixed schema::

    tilesparse::tw_linear(Tensor x, Tensor col_idx, Tensor tile_ptr, Tensor row_idx,
                          Tensor row_ptr, Tensor values, Tensor val_ptr, Tensor? bias,
                          int out_features, str backend) -> Tensor

``x`` is ``(M, K)`` contiguous; the index tensors are a :class:`~tilesparse.format.TWLayout`'s
(drawn in ``tilesparse/format.py``); the result ``(M, N)`` has ``x``'s dtype.

:func:`check_op_inputs` is where the CPU implementation (``tilesparse.ops``) and the CUDA one
(``tilesparse.kernels.cuda``) both start: a layout whose offsets or indices would make the C++
or CUDA kernel read out of bounds or write one column twice is rejected with a ``ValueError``
before any kernel runs. The index check is cached per index set (:class:`LayoutCache`).
"""

from __future__ import annotations

import torch

from tilesparse.backend import Backend, parse_backend
from tilesparse.format import (
    TWLayout,
    _first_not_ascending,
    _first_tile_with_unsorted_rows,
    _pointer_problem,
)
from tilesparse.kernels.cache import LayoutCache

__all__ = [
    "OP_NAME",
    "SUPPORTED_DTYPES",
    "check_args",
    "check_op_inputs",
    "op_layout",
]

OP_NAME = "tilesparse::tw_linear"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_INDEX_NAMES = ("col_idx", "tile_ptr", "row_idx", "row_ptr", "val_ptr")

# Index sets that passed _check_data: anchored on col_idx; the record's stamp holds the five
# index tensors' versions, len(values), K and N (anything different is checked again).
_VALIDATED: LayoutCache[bool] = LayoutCache()


def check_args(
    x: torch.Tensor,
    col_idx: torch.Tensor,
    tile_ptr: torch.Tensor,
    row_idx: torch.Tensor,
    row_ptr: torch.Tensor,
    values: torch.Tensor,
    val_ptr: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
) -> None:
    """Shape/dtype checks that need no data (shared by the real and the fake kernels).

    Args:
        x: ``(M, K)`` activations; the rest as in the op schema (module docstring).

    Raises:
        ValueError: naming the bad argument and what was expected.
    """
    index = dict(zip(_INDEX_NAMES, (col_idx, tile_ptr, row_idx, row_ptr, val_ptr)))
    if x.dim() != 2:
        raise ValueError(f"tilesparse::tw_linear takes x of shape (M, K), got {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise ValueError(f"tw_linear: x has dtype {x.dtype}; expected one of {names}")
    if values.dtype != x.dtype:
        raise ValueError(
            f"tw_linear: x has dtype {x.dtype} but the layer's values are {values.dtype}; "
            f"cast one to the other (e.g. module.to({x.dtype}))"
        )
    if values.dim() != 1:
        raise ValueError(f"tw_linear: values must be 1-D, got shape {tuple(values.shape)}")
    for name, t in index.items():
        if t.dtype != torch.int64 or t.dim() != 1:
            raise ValueError(
                f"tw_linear: {name} must be a 1-D int64 tensor, got {t.dtype} {tuple(t.shape)}"
            )
    n_ptr = index["tile_ptr"].shape[0]
    if n_ptr < 1 or index["row_ptr"].shape[0] != n_ptr or index["val_ptr"].shape[0] != n_ptr:
        raise ValueError(
            "tw_linear: tile_ptr, row_ptr and val_ptr must have T+1 >= 1 entries each, got "
            f"{index['tile_ptr'].shape[0]}, {index['row_ptr'].shape[0]}, {index['val_ptr'].shape[0]}"
        )
    if out_features < 0:
        raise ValueError(f"tw_linear: out_features must be >= 0, got {out_features}")
    if bias is not None and tuple(bias.shape) != (out_features,):
        raise ValueError(
            f"tw_linear: bias must have shape ({out_features},), got {tuple(bias.shape)}"
        )
    if bias is not None and bias.dtype != x.dtype:
        raise ValueError(
            f"tw_linear: bias has dtype {bias.dtype} but x has {x.dtype}; cast one to the other "
            f"(e.g. module.to({x.dtype}))"
        )


def _check_data(
    K: int,
    N: int,
    col_idx: torch.Tensor,
    tile_ptr: torch.Tensor,
    row_idx: torch.Tensor,
    row_ptr: torch.Tensor,
    values: torch.Tensor,
    val_ptr: torch.Tensor,
) -> bool:
    """Checks that read index values (real kernels only): a bad layout must not reach the C++
    kernel, which trusts every offset and index (it would read or write out of bounds, or
    give wrong columns). The tensors passed :func:`check_args`. Returns True (the value
    :data:`_VALIDATED` records)."""
    for name, ptr in (("tile_ptr", tile_ptr), ("row_ptr", row_ptr), ("val_ptr", val_ptr)):
        problem = _pointer_problem(name, ptr)
        if problem:
            raise ValueError(f"tw_linear: {problem}")
    nk, R = col_idx.numel(), row_idx.numel()
    if int(tile_ptr[-1]) != nk or int(row_ptr[-1]) != R:
        raise ValueError(
            f"tw_linear: tile_ptr/row_ptr must end at len(col_idx)={nk}/len(row_idx)={R}, got "
            f"{int(tile_ptr[-1])}/{int(row_ptr[-1])}"
        )
    if int(val_ptr[-1]) != values.numel():
        raise ValueError(
            f"tw_linear: val_ptr ends at {int(val_ptr[-1])} but values has {values.numel()} entries"
        )
    if R and (int(row_idx.min()) < 0 or int(row_idx.max()) >= K):
        raise ValueError(f"tw_linear: row_idx must lie in [0, K={K}); x has K={K} features")
    if nk and (int(col_idx.min()) < 0 or int(col_idx.max()) >= N):
        raise ValueError(f"tw_linear: col_idx must lie in [0, out_features={N})")
    bad = _first_not_ascending(col_idx)
    if bad is not None:
        raise ValueError(
            f"tw_linear: col_idx must be strictly ascending (one tile per column), but "
            f"col_idx[{bad + 1}]={int(col_idx[bad + 1])} follows col_idx[{bad}]={int(col_idx[bad])}"
        )
    widths = tile_ptr[1:] - tile_ptr[:-1]
    heights = row_ptr[1:] - row_ptr[:-1]
    if bool((widths <= 0).any()) or not torch.equal(val_ptr[1:] - val_ptr[:-1], widths * heights):
        raise ValueError(
            "tw_linear: every tile needs >= 1 column and val_ptr blocks of rows × columns"
        )
    t = _first_tile_with_unsorted_rows(row_idx, row_ptr)
    if t is not None:
        rows = row_idx[int(row_ptr[t]) : int(row_ptr[t + 1])].tolist()
        raise ValueError(f"tw_linear: tile {t} rows must be strictly ascending, got {rows}")
    return True


def check_op_inputs(
    x: torch.Tensor,
    col_idx: torch.Tensor,
    tile_ptr: torch.Tensor,
    row_idx: torch.Tensor,
    row_ptr: torch.Tensor,
    values: torch.Tensor,
    val_ptr: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    backend: Backend | str,
) -> Backend:
    """Every check a real implementation of ``tilesparse::tw_linear`` runs before it touches
    the data (the CPU/reference implementation in ``tilesparse.ops`` and the CUDA one in
    ``tilesparse.kernels.cuda`` both start here).

    Args:
        x: ``(M, K)`` contiguous activations; the rest as in the op schema (module docstring).

    Returns:
        the parsed backend.

    Raises:
        ValueError: bad shapes or dtypes, a non-contiguous ``x``, an unknown backend or one
            that cannot run on ``x``'s device (``cpu`` off the CPU, ``cutlass`` off CUDA), or
            an index set that is not a valid layout for ``K = x.shape[1]``, ``N = out_features``.
    """
    check_args(x, col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr, bias, out_features)
    if not x.is_contiguous():
        raise ValueError(
            f"tilesparse::tw_linear needs a contiguous x, got strides {x.stride()} for shape "
            f"{tuple(x.shape)}; call x.contiguous() (tilesparse.ops.tw_linear does)"
        )
    be = parse_backend(backend)
    if be is Backend.CPU and x.device.type != "cpu":
        raise ValueError(f"backend 'cpu' runs on CPU tensors, got a {x.device.type} tensor")
    if be is Backend.CUTLASS and x.device.type != "cuda":
        raise ValueError(
            f"backend 'cutlass' runs on CUDA tensors with the kernel from cutlass_kernels; got a "
            f"{x.device.type} tensor"
        )
    K = x.shape[1]
    _VALIDATED.get(
        (col_idx, tile_ptr, row_idx, row_ptr, val_ptr),
        (values.numel(), K, out_features),
        "checked",
        lambda: _check_data(K, out_features, col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr),
    )
    return be


def op_layout(in_features: int, out_features: int, tensors: tuple[torch.Tensor, ...]) -> TWLayout:
    """The :class:`TWLayout` of the op's tensors (``col_idx, tile_ptr, row_idx, row_ptr,
    values, val_ptr``), its ``tile`` the widest tile (1 when there is none)."""
    col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr = tensors
    widths = tile_ptr[1:] - tile_ptr[:-1]
    tile = int(widths.max()) if widths.numel() else 1
    return TWLayout(
        in_features,
        out_features,
        max(tile, 1),
        col_idx,
        tile_ptr,
        row_idx,
        row_ptr,
        values,
        val_ptr,
    )
