"""The jagged (ragged) batch of sparse ids: TorchRec's KeyedJaggedTensor layout, key-major.

A batch holds ``F`` features (keys, one per embedding table) for ``B`` samples. Every
(feature, sample) pair is a *bag* of zero or more ids. All ids are concatenated key-major
(every bag of key 0 in sample order, then key 1, ...) into ``values``; ``lengths`` holds each
bag's size in the same order, and ``offsets`` is its exclusive prefix sum.

Worked example, ``keys = ["t0", "t1"]``, ``B = 3``::

                 sample 0     sample 1    sample 2
    "t0"         [V0, V1]     [V2]        [ ]
    "t1"         [V3]         [V4]        [V5, V6, V7]

    values  = [V0, V1, V2, V3, V4, V5, V6, V7]        (nnz,) = (8,)   int64
    lengths = [ 2,  1,  0,  1,  1,  3]                (F*B,) = (6,)   int32
    offsets = [ 0,  2,  3,  3,  4,  5,  8]            (F*B+1,) = (7,) int64
               '---- t0 ---' '---- t1 ---'

    per_key()["t1"] == (values[3:8], lengths[3:6]) == ([V3, V4, V5, V6, V7], [1, 1, 3])

Key ``f``'s bags are ``lengths[f*B : (f+1)*B]`` and its ids are
``values[offsets[f*B] : offsets[(f+1)*B]]``; ``bag_offsets(f)`` re-bases those offsets to 0,
which is what ``nn.EmbeddingBag(input, offsets)`` takes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


def _min_and_sum(lengths: torch.Tensor) -> tuple[int, int]:
    """``(min, sum)`` of ``(n,) int32`` bag sizes (``(0, 0)`` when empty). A CPU tensor is
    reduced by numpy: torch's int32 sum widens through a slow path, and its threaded
    reductions stall when the cores are busy (tens of ms for one batch's lengths)."""
    if lengths.numel() == 0:
        return 0, 0
    if lengths.device.type == "cpu" and not lengths.requires_grad:
        a = lengths.numpy()
        return int(a.min()), int(a.sum(dtype=np.int64))
    return int(lengths.min()), int(lengths.sum(dtype=torch.int64))


@dataclass
class JaggedBatch:
    """Sparse ids of one batch in KeyedJaggedTensor layout (see the module docstring).

    Args:
        keys: feature names, ``F`` of them, unique; by convention the table names.
        values: ``(nnz,) int64`` all ids, key-major then sample-major.
        lengths: ``(F*B,) int32`` bag sizes, same order; ``F*B`` must be a multiple of ``F``.

    Raises:
        ValueError: wrong dtypes or ranks, duplicate keys, negative lengths, or
            ``lengths.sum() != values.numel()``.
    """

    keys: list[str]
    values: torch.Tensor
    lengths: torch.Tensor
    _offsets: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.keys = list(self.keys)
        if not self.keys:
            raise ValueError("JaggedBatch: keys must not be empty")
        if len(set(self.keys)) != len(self.keys):
            raise ValueError(f"JaggedBatch: duplicate keys in {self.keys}")
        if self.values.dtype != torch.int64 or self.values.dim() != 1:
            raise ValueError(
                f"JaggedBatch.values must be a 1-d int64 tensor, got {self.values.dtype} "
                f"of shape {tuple(self.values.shape)}"
            )
        if self.lengths.dtype != torch.int32 or self.lengths.dim() != 1:
            raise ValueError(
                f"JaggedBatch.lengths must be a 1-d int32 tensor, got {self.lengths.dtype} "
                f"of shape {tuple(self.lengths.shape)}"
            )
        n = self.lengths.numel()
        if n % len(self.keys):
            raise ValueError(
                f"JaggedBatch: lengths has {n} entries, not a multiple of {len(self.keys)} keys"
            )
        lowest, total = _min_and_sum(self.lengths)
        if n and lowest < 0:
            raise ValueError(f"JaggedBatch: negative bag length {lowest}")
        if total != self.values.numel():
            raise ValueError(
                f"JaggedBatch: lengths sum to {total} but values has {self.values.numel()} ids"
            )

    # ------------------------------------------------------------------ views
    @property
    def batch_size(self) -> int:
        """``B``, the number of samples."""
        return self.lengths.numel() // len(self.keys)

    @property
    def offsets(self) -> torch.Tensor:
        """``(F*B+1,) int64`` exclusive prefix sum of ``lengths`` (cached)."""
        if self._offsets is None:
            off = torch.zeros(
                self.lengths.numel() + 1, dtype=torch.int64, device=self.lengths.device
            )
            torch.cumsum(self.lengths, 0, out=off[1:])
            self._offsets = off
        return self._offsets

    def key_index(self, key: str) -> int:
        """Position of ``key`` in :attr:`keys`.

        Raises:
            KeyError: naming the key and the keys present.
        """
        try:
            return self.keys.index(key)
        except ValueError:
            raise KeyError(f"key {key!r} not in JaggedBatch keys {self.keys}") from None

    def values_for(self, key: str) -> torch.Tensor:
        """``(nnz_key,) int64`` the ids of one key, all samples."""
        f, b = self.key_index(key), self.batch_size
        off = self.offsets
        return self.values[int(off[f * b]) : int(off[(f + 1) * b])]

    def lengths_for(self, key: str) -> torch.Tensor:
        """``(B,) int32`` the bag sizes of one key."""
        f, b = self.key_index(key), self.batch_size
        return self.lengths[f * b : (f + 1) * b]

    def bag_offsets(self, key: str) -> torch.Tensor:
        """``(B,) int64`` start of each bag of ``key`` within :meth:`values_for` (``nn.EmbeddingBag``
        ``offsets``, without the trailing total)."""
        f, b = self.key_index(key), self.batch_size
        off = self.offsets[f * b : (f + 1) * b]
        return off - off[0] if b else off

    def per_key(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{key: (values (nnz_key,) int64, lengths (B,) int32)}``, views into this batch."""
        return {k: (self.values_for(k), self.lengths_for(k)) for k in self.keys}

    # ------------------------------------------------------------ constructors
    @classmethod
    def from_per_key(cls, per_key: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> JaggedBatch:
        """Inverse of :meth:`per_key`: concatenate ``{key: (values, lengths)}`` key-major.

        Raises:
            ValueError: when keys disagree on the batch size.
        """
        keys = list(per_key)
        if not keys:
            raise ValueError("JaggedBatch.from_per_key: no keys")
        sizes = {k: per_key[k][1].numel() for k in keys}
        if len(set(sizes.values())) != 1:
            raise ValueError(f"JaggedBatch.from_per_key: keys disagree on batch size: {sizes}")
        values = torch.cat([per_key[k][0].to(torch.int64) for k in keys])
        lengths = torch.cat([per_key[k][1].to(torch.int32) for k in keys])
        return cls(keys, values, lengths)

    @classmethod
    def from_dense_bags(cls, keys: Sequence[str], ids: Sequence[torch.Tensor]) -> JaggedBatch:
        """Build from fixed-size bags: ``ids[f]`` is ``(B, hotness_f) int64`` for key ``f``."""
        per_key = {}
        for k, x in zip(keys, ids, strict=True):
            if x.dim() != 2:
                raise ValueError(
                    f"key {k!r}: expected (B, hotness) ids, got shape {tuple(x.shape)}"
                )
            lengths = torch.full((x.shape[0],), x.shape[1], dtype=torch.int32)
            per_key[k] = (x.reshape(-1).to(torch.int64), lengths)
        return cls.from_per_key(per_key)

    # ----------------------------------------------------------------- devices
    def to(self, device: torch.device | str, non_blocking: bool = False) -> JaggedBatch:
        """A copy on ``device`` (the same object when already there)."""
        device = torch.device(device)
        if self.values.device == device and self.lengths.device == device:
            return self
        # Already validated: skip __post_init__ (its checks would sync with the device).
        moved = object.__new__(JaggedBatch)
        moved.keys = list(self.keys)
        moved.values = self.values.to(device, non_blocking=non_blocking)
        moved.lengths = self.lengths.to(device, non_blocking=non_blocking)
        moved._offsets = None
        return moved

    def equals(self, other: JaggedBatch) -> bool:
        """Exact equality of keys, values and lengths."""
        return (
            self.keys == other.keys
            and torch.equal(self.values, other.values)
            and torch.equal(self.lengths, other.lengths)
        )

    # ---------------------------------------------------------------- torchrec
    def to_kjt(self) -> Any:
        """The same batch as an unweighted ``torchrec.KeyedJaggedTensor`` (keys, values, lengths
        and stride ``B`` unchanged; needs torchrec, which is optional).

        Raises:
            ImportError: when torchrec is not importable.
        """
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        return KeyedJaggedTensor(
            keys=list(self.keys),
            values=self.values,
            lengths=self.lengths,
            stride=self.batch_size,
        )

    @classmethod
    def from_kjt(cls, kjt: Any) -> JaggedBatch:
        """Build from a ``torchrec.KeyedJaggedTensor``, exactly or not at all.

        Values become ``int64`` and lengths ``int32``; keys stay the KJT's (TorchRec names them
        by *feature*; :func:`embark.interop.batch_from_kjt` renames them to tables).

        A *variable-batch* KJT (``stride_per_key_per_rank``: each key has its own number of
        bags, TorchRec's VBE) is converted exactly when it carries ``inverse_indices``
        ``(keys, (F, B) int)``: sample ``b`` of key ``f`` gets bag ``inverse_indices[f, b]`` of
        that key, the expansion TorchRec's ``EmbeddingBagCollection`` applies to its pooled
        output. Worked example, key ``"t0"`` with 2 bags for ``B = 3`` samples::

            bags of t0: [V0, V1] [V2]      inverse_indices[t0] = [1, 0, 1]
            expanded:   [V2] [V0, V1] [V2]  lengths [1, 2, 1], values [V2, V0, V1, V2]

        Raises:
            ValueError: for a *weighted* KJT (``weights()`` set): a JaggedBatch holds no
                per-id weights and :class:`~embark.models.dlrm.DLRM` pools unweighted, so
                the weights could only be dropped; a weighted feature is pooled by TorchRec's
                weighted ``EmbeddingBagCollection`` (:class:`embark.interop.EBCModel` takes the
                KJT as it is). Also for a variable-batch KJT without ``inverse_indices`` (which
                sample a bag belongs to is then unknown), or whose inverse indices miss a key
                or point past that key's bags.
        """
        keys = list(kjt.keys())
        if kjt.weights_or_none() is not None:
            raise ValueError(
                f"JaggedBatch.from_kjt: the KeyedJaggedTensor with keys {keys} is weighted, but "
                f"a JaggedBatch has no per-id weights (DLRM pools unweighted), so converting "
                f"would drop them; pool weighted features with TorchRec's weighted "
                f"EmbeddingBagCollection (embark.interop.EBCModel takes the KJT as it is)"
            )
        values = kjt.values().to(torch.int64)
        lengths = kjt.lengths().to(torch.int32)
        if not kjt.variable_stride_per_key():
            return cls(keys, values, lengths)
        inverse = kjt.inverse_indices_or_none()
        if inverse is None:
            raise ValueError(
                f"JaggedBatch.from_kjt: the KeyedJaggedTensor with keys {keys} has a variable "
                f"batch per key (stride_per_key_per_rank {kjt.stride_per_key_per_rank()}) and "
                f"no inverse_indices, so which sample each bag belongs to is unknown; pass "
                f"inverse_indices=(keys, (F, B) indices) when building it"
            )
        return cls._from_variable_batch(keys, values, lengths, kjt.stride_per_key(), inverse)

    @classmethod
    def _from_variable_batch(
        cls,
        keys: list[str],
        values: torch.Tensor,
        lengths: torch.Tensor,
        strides: Sequence[int],
        inverse: tuple[Sequence[str], torch.Tensor],
    ) -> JaggedBatch:
        """Expand each key's ``strides[f]`` bags to ``B`` samples by its inverse indices."""
        inv_keys, inv = list(inverse[0]), inverse[1]
        missing = [k for k in keys if k not in inv_keys]
        if missing:
            raise ValueError(
                f"JaggedBatch.from_kjt: inverse_indices name keys {inv_keys} but not {missing}"
            )
        per_key: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        bag0 = id0 = 0
        for key, stride in zip(keys, strides, strict=True):
            key_lengths = lengths[bag0 : bag0 + stride].to(torch.int64)
            n = int(key_lengths.sum())
            key_values = values[id0 : id0 + n]
            bag0, id0 = bag0 + stride, id0 + n
            idx = inv[inv_keys.index(key)].to(device=values.device, dtype=torch.int64)
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= stride):
                bad = int(idx.max()) if int(idx.max()) >= stride else int(idx.min())
                raise ValueError(
                    f"JaggedBatch.from_kjt: inverse index {bad} of key {key!r} is outside its "
                    f"{stride} bags (expected 0..{stride - 1})"
                )
            starts = torch.cumsum(key_lengths, 0) - key_lengths  # each bag's first id
            out_lengths = key_lengths[idx]
            out_starts = torch.cumsum(out_lengths, 0) - out_lengths
            # id j of the output comes from bag idx[b] (b its sample) at the same position in it
            within = torch.arange(
                int(out_lengths.sum()), device=values.device
            ) - torch.repeat_interleave(out_starts, out_lengths)
            gather = torch.repeat_interleave(starts[idx], out_lengths) + within
            per_key[key] = (key_values[gather], out_lengths.to(torch.int32))
        return cls.from_per_key(per_key)
