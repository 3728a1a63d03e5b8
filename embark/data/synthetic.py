"""Synthetic click-through data whose labels come from a planted *teacher* DLRM.

Each sample has

* ``D`` dense features: raw counts ``c ~ LogNormal(mu, sigma)`` per feature, fed to the model as
  ``log(1 + c)`` (the same transform :mod:`embark.data.criteo` applies to Criteo's integers);
* one bag per table of ``hotness`` ids drawn i.i.d. from a bounded Zipf(α) over the table's
  rows, ``P(id = k) ∝ (k + 1)^-α`` (id 0 is the hottest), α = ``workload.zipf_alpha``;
  with ``ragged=True`` bag sizes are uniform on ``0 .. hotness`` (``hotness`` is the maximum
  bag size, :mod:`embark.data.hotness`) instead;
* a label ``y ~ Bernoulli(sigmoid(s * z + b))`` where ``z`` is the teacher's logit standardised
  on a calibration sample, ``s = label_sharpness`` and ``b = label_bias``.

The teacher is a DLRM over the same tables (by default the narrower
:func:`default_teacher_workload`, a different seed) whose embedding rows are redrawn
``N(0, teacher_embedding_std²)`` (std 0.1 by default) instead of the student's small uniform
init, so that every table carries signal. Its probabilities are the Bayes-optimal scores for the
labels, so :meth:`SyntheticCTR.teacher_auc` is the ceiling a student can reach.

Every random number is a pure function of ``(seed, split, sample, draw)`` — SplitMix64 over
a counter (:func:`uniforms`), sample ``g = index * batch_size + s`` for sample ``s`` of batch
``index`` — and the label of a sample comes from the teacher evaluated in float64 on that
sample's features alone. So rank ``r`` generates its slice of global batch ``i``
(:func:`~embark.data.batch.local_range`) without the rest, and the slices of all ranks,
concatenated, are bit-identical to the single-process batch (a float64 forward over a slice
can differ from one over the whole batch in its last bit; a label flips only if its uniform
draw falls within that bit of the probability, about 1e-16 per sample). The stream needs no
memory, any batch can be regenerated, and a resumed run continues with
``batches(n, start=step)``.

Draws of one sample, in order (``K`` per sample; ``h_t`` the hotness of table ``t``)::

    dense    2·D uniforms → D normals by Box-Muller → raw = exp(mu + sigma·z)
    table t  h_t uniforms → Zipf ids (ragged: 1 for the bag size, then h_t slots)
    label    1 uniform    → y = [u < sigmoid(s·z + b)]
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from dataclasses import replace
from enum import StrEnum
from typing import Any

import numpy as np
import torch

from embark.data.batch import Batch, local_range
from embark.data.jagged import JaggedBatch
from embark.models.dlrm import build_model
from embark.models.workloads import Workload
from embark.training.metrics import auc


class Split(StrEnum):
    """Independent sample streams of one generator, and the parts of a tabular source
    (:mod:`embark.data.tabular`: ``TRAIN``, ``EVAL`` the validation rows, ``TEST``)."""

    TRAIN = "train"
    EVAL = "eval"
    CALIBRATION = "calibration"
    TEST = "test"


_SPLIT_ID = {Split.TRAIN: 0, Split.EVAL: 1, Split.CALIBRATION: 2, Split.TEST: 3}
_CALIBRATION_SAMPLES = 8192  # enough for the teacher logit's mean and std to ~1%
STREAM_VERSION = (
    3  # counter-based draws per sample, float64 teacher labels, ragged bags of 0..hotness
)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # SplitMix64's increment (2^64 / φ)


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function over ``uint64`` (a bijection with full avalanche)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def uniforms(key: int, samples: np.ndarray, stride: int, first: int, count: int) -> np.ndarray:
    """``(n, count) float64`` in ``[0, 1)``: draws ``first .. first+count-1`` of each sample,
    SplitMix64 at counter ``sample * stride + draw`` under ``key`` (53 random bits each).

    Args:
        key: the stream's 64-bit key.
        samples: ``(n,) int64`` global sample numbers.
        stride: draws per sample (``K``); ``first + count <= stride``.
    """
    with np.errstate(over="ignore"):
        counter = samples.astype(np.uint64)[:, None] * np.uint64(stride) + np.arange(
            first, first + count, dtype=np.uint64
        )
        bits = _mix64(np.uint64(key) + counter * _GOLDEN)
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def default_teacher_workload(workload: Workload) -> Workload:
    """A narrower DLRM over the same tables: one bottom layer, one hidden top layer of 16,
    one cross layer of rank ≤ 8. Narrow enough that a student of the full width learns it
    from a few hundred thousand samples, wide enough to mix every table with the dense part."""
    inter = workload.interaction
    return replace(
        workload,
        name=f"{workload.name}-teacher",
        bottom_mlp=(workload.bottom_mlp[-1],),
        top_mlp=(16, 1),
        interaction=replace(inter, num_layers=1, low_rank=min(inter.low_rank, 8)),
    )


class SyntheticCTR:
    """Deterministic, streaming synthetic CTR data for ``workload`` (see the module docstring).

    Args:
        workload: tables, hotness, α and dense width; scale it with ``workload.scaled(f)`` first
            for small runs.
        batch_size: samples per batch, > 0.
        seed: generator seed; the teacher's weights derive from it too.
        ragged: variable bag sizes (uniform on 0..hotness, the maximum bag
            size) instead of fixed ``hotness``.
        label_sharpness: ``s``; larger → labels closer to deterministic, higher teacher AUC.
        label_bias: ``b``; sets the click rate (-1.0 → about 30% positives).
        dense_mu, dense_sigma: log-normal parameters of the raw dense counts.
        teacher_embedding_std: std of the teacher's embedding rows, redrawn
            ``N(0, teacher_embedding_std²)``; > 0. Larger → the tables weigh more in the
            teacher's logit relative to the dense features.
        teacher_workload: the teacher's architecture; ``None`` = :func:`default_teacher_workload`.
            Its tables (names, rows, order) and ``dense_features`` must equal ``workload``'s;
            its MLP widths and interaction may differ.

    Raises:
        ValueError: for a non-positive batch size, sharpness, ``dense_sigma`` or
            ``teacher_embedding_std``, or a ``teacher_workload`` whose tables or dense width
            differ from ``workload``'s.
    """

    def __init__(
        self,
        workload: Workload,
        batch_size: int,
        seed: int = 0,
        *,
        ragged: bool = False,
        label_sharpness: float = 2.0,
        label_bias: float = -1.0,
        dense_mu: float = 1.0,
        dense_sigma: float = 1.0,
        teacher_embedding_std: float = 0.1,
        teacher_workload: Workload | None = None,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if not label_sharpness > 0:
            raise ValueError(f"label_sharpness must be > 0, got {label_sharpness}")
        if not dense_sigma > 0:
            raise ValueError(f"dense_sigma must be > 0, got {dense_sigma}")
        std = teacher_embedding_std
        if isinstance(std, bool) or not (isinstance(std, int | float) and 0 < std < math.inf):
            raise ValueError(
                f"teacher_embedding_std must be a finite number > 0, got {teacher_embedding_std!r}"
            )
        self.workload = workload
        self.batch_size = batch_size
        self.seed = seed
        self.ragged = ragged
        self.label_sharpness = float(label_sharpness)
        self.label_bias = float(label_bias)
        self.dense_mu = float(dense_mu)
        self.dense_sigma = float(dense_sigma)
        self.teacher_embedding_std = float(std)
        alpha = workload.zipf_alpha
        self._cdfs = []
        for t in workload.tables:
            p = np.arange(1, t.num_rows + 1, dtype=np.float64) ** -alpha
            cdf = np.cumsum(p)
            self._cdfs.append(cdf / cdf[-1])
        if teacher_workload is None:
            teacher_workload = default_teacher_workload(workload)
        shape = [(t.name, t.num_rows) for t in workload.tables]
        teacher_shape = [(t.name, t.num_rows) for t in teacher_workload.tables]
        if teacher_shape != shape or teacher_workload.dense_features != workload.dense_features:
            raise ValueError(
                f"teacher_workload {teacher_workload.name!r} must have workload "
                f"{workload.name!r}'s tables (name, rows) and dense_features "
                f"{workload.dense_features}; got {teacher_shape[:4]}... and "
                f"{teacher_workload.dense_features}"
            )
        self.teacher_workload = teacher_workload
        self.teacher = build_model(teacher_workload, seed=1_000_003 + seed).eval()
        gen = torch.Generator().manual_seed(2_000_003 + seed)
        with torch.no_grad():
            for table in self.teacher.embeddings.parameters():  # one weight per table, in order
                table.normal_(0.0, teacher_embedding_std, generator=gen)
        for p_ in self.teacher.parameters():
            p_.requires_grad_(False)
        self._teacher64 = copy.deepcopy(self.teacher).double()
        self._stride = 2 * workload.dense_features + 1
        for t in workload.tables:
            self._stride += 1 + t.hotness if ragged else t.hotness
        self._z_mean, self._z_std = 0.0, 1.0
        calib = np.arange(_CALIBRATION_SAMPLES, dtype=np.int64)
        raw = self._teacher_raw(*self._features(Split.CALIBRATION, calib))
        self._z_mean, self._z_std = float(raw.mean()), float(raw.std().clamp_min(1e-12))

    #: :meth:`stream_config` keys, the keyword arguments that regenerate the stream.
    STREAM_KEYS = (
        "version",
        "ragged",
        "label_sharpness",
        "label_bias",
        "dense_mu",
        "dense_sigma",
        "teacher_embedding_std",
        "teacher_workload",
    )

    def stream_config(self) -> dict[str, Any]:
        """Everything besides the workload, ``batch_size`` and ``seed`` that fixes the batches:
        a JSON-able mapping (``teacher_workload`` as :meth:`Workload.to_dict`) that
        :meth:`from_stream_config` turns back into this stream. Checkpoints record it as
        ``data_stream``, so a resume can check it is fed the same data."""
        return {
            "version": STREAM_VERSION,
            "ragged": self.ragged,
            "label_sharpness": self.label_sharpness,
            "label_bias": self.label_bias,
            "dense_mu": self.dense_mu,
            "dense_sigma": self.dense_sigma,
            "teacher_embedding_std": self.teacher_embedding_std,
            "teacher_workload": self.teacher_workload.to_dict(),
        }

    @classmethod
    def from_stream_config(
        cls, workload: Workload, batch_size: int, seed: int, config: dict[str, Any]
    ) -> SyntheticCTR:
        """The stream ``SyntheticCTR(workload, batch_size, seed, **config)`` of a
        :meth:`stream_config` mapping.

        Raises:
            ValueError: naming the keys, for a mapping with other keys than
                :attr:`STREAM_KEYS`, or values the constructor rejects.
        """
        if not isinstance(config, dict) or set(config) != set(cls.STREAM_KEYS):
            got = sorted(config) if isinstance(config, dict) else type(config).__name__
            raise ValueError(
                f"data stream config must have exactly the keys {sorted(cls.STREAM_KEYS)}, got {got}"
            )
        kwargs = dict(config)
        version = kwargs.pop("version")
        if version != STREAM_VERSION:
            raise ValueError(
                f"data stream version {version!r} cannot be regenerated: this generator "
                f"writes version {STREAM_VERSION}"
            )
        kwargs["teacher_workload"] = Workload.from_dict(config["teacher_workload"])
        return cls(workload, batch_size, seed, **kwargs)

    # ------------------------------------------------------------------ pieces
    def _key(self, split: Split) -> int:
        seed = np.array([(self.seed * 3 + _SPLIT_ID[split]) % 2**64], dtype=np.uint64)
        with np.errstate(over="ignore"):
            return int(_mix64(_mix64(seed) + _GOLDEN)[0])

    def _features(
        self, split: Split, samples: np.ndarray
    ) -> tuple[torch.Tensor, JaggedBatch, np.ndarray]:
        """Features of the given global samples, and each one's label draw ``(n,)``."""
        key, k, n = self._key(split), self._stride, samples.size
        d = self.workload.dense_features
        u = uniforms(key, samples, k, 0, 2 * d)
        z = np.sqrt(-2.0 * np.log1p(-u[:, :d])) * np.cos(2.0 * np.pi * u[:, d:])
        raw = np.exp(self.dense_mu + self.dense_sigma * z)
        dense = torch.from_numpy(np.log1p(raw).astype(np.float32))
        values, lengths = [], []
        at = 2 * d
        for t, cdf in zip(self.workload.tables, self._cdfs):
            if self.ragged:
                bag = np.floor(uniforms(key, samples, k, at, 1)[:, 0] * (t.hotness + 1))
                n_t = np.minimum(bag.astype(np.int64), t.hotness)
                slots = uniforms(key, samples, k, at + 1, t.hotness)
                draws = slots[np.arange(t.hotness)[None, :] < n_t[:, None]]
                at += 1 + t.hotness
            else:
                n_t = np.full(n, t.hotness)
                draws = uniforms(key, samples, k, at, t.hotness).reshape(-1)
                at += t.hotness
            ids = np.searchsorted(cdf, draws, side="right")
            values.append(np.minimum(ids, t.num_rows - 1))
            lengths.append(n_t)
        sparse = JaggedBatch(
            [t.name for t in self.workload.tables],
            torch.from_numpy(np.concatenate(values).astype(np.int64)),
            torch.from_numpy(np.concatenate(lengths).astype(np.int32)),
        )
        return dense, sparse, uniforms(key, samples, k, at, 1)[:, 0]

    def _teacher_raw(self, dense: torch.Tensor, sparse: JaggedBatch, *_: object) -> torch.Tensor:
        """``(B,) float64`` the teacher's raw logits, in float64: a sample's logit does not
        depend on the other samples of the batch beyond its last bit."""
        with torch.no_grad():
            return self._teacher64(dense.double(), sparse)

    def _logits64(self, dense: torch.Tensor, sparse: JaggedBatch) -> torch.Tensor:
        z = (self._teacher_raw(dense, sparse) - self._z_mean) / self._z_std
        return self.label_sharpness * z + self.label_bias

    def teacher_logits(self, dense: torch.Tensor, sparse: JaggedBatch) -> torch.Tensor:
        """``(B,) float32`` the teacher's calibrated logits ``s * z + b`` for given features
        (computed in float64)."""
        return self._logits64(dense, sparse).float()

    def _samples(self, index: int, rank: int, world_size: int) -> np.ndarray:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        lo, hi = local_range(self.batch_size, rank, world_size)
        return np.arange(index * self.batch_size + lo, index * self.batch_size + hi, dtype=np.int64)

    def _make(
        self, split: Split, index: int, rank: int = 0, world_size: int = 1
    ) -> tuple[Batch, torch.Tensor]:
        dense, sparse, u = self._features(split, self._samples(index, rank, world_size))
        logits = self._logits64(dense, sparse)
        probs = torch.sigmoid(logits).numpy()
        labels = torch.from_numpy((u < probs).astype(np.float32))
        return Batch(dense, sparse, labels), logits.float()

    # ------------------------------------------------------------------ public
    def batch(
        self, index: int, split: Split | str = Split.TRAIN, *, rank: int = 0, world_size: int = 1
    ) -> Batch:
        """Rank ``rank``'s slice (:func:`~embark.data.batch.local_range`) of batch number
        ``index`` of ``split`` — the whole batch for ``world_size=1`` — generated without the
        rest of the batch, identical on each call.

        Raises:
            ValueError: for a negative index or a rank outside ``[0, world_size)``.
        """
        if index < 0:
            raise ValueError(f"batch index must be >= 0, got {index}")
        return self._make(Split(split), index, rank, world_size)[0]

    def batches(
        self,
        n: int | None = None,
        start: int = 0,
        split: Split | str = Split.TRAIN,
        *,
        rank: int = 0,
        world_size: int = 1,
    ) -> Iterator[Batch]:
        """Stream rank ``rank``'s slices of batches ``start, start+1, ...`` of ``split``;
        ``n=None`` streams forever."""
        split = Split(split)
        if start < 0 or (n is not None and n < 0):
            raise ValueError(f"need n >= 0 and start >= 0, got n={n}, start={start}")
        self._samples(0, rank, world_size)  # checks the rank now, not at the first batch
        i = start
        while n is None or i < start + n:
            yield self._make(split, i, rank, world_size)[0]
            i += 1

    def teacher_auc(self, num_batches: int = 16, split: Split | str = Split.EVAL) -> float:
        """AUC of the teacher's probabilities on the first ``num_batches`` of ``split`` (the
        ceiling for a student evaluated on the same batches)."""
        scores, labels = [], []
        for i in range(num_batches):
            b, logits = self._make(Split(split), i)
            scores.append(logits)
            labels.append(b.labels)
        return auc(torch.cat(scores), torch.cat(labels))
