"""A whole DLRM served from its artifacts: embedding bags pooled from the parameter server's
tiers, the dense part run by onnxruntime.

Inputs and outputs of one request (batch ``B``; ``H_t`` = the table's
``maxnum_catfeature_query_per_table_per_sample`` in ``ps.json``)::

    dense      FP32          (B, D)      dense features
    ids_<t>    INT64|INT32   (B, w_t)    one bag per sample, w_t ≤ H_t; -1 pads a short bag
    ──────────────────────────────────────────────────────────────────────────────────────
    logits       FP32  (B,)
    probability  FP32  (B,)   sigmoid(logits)

These are the input names of ``export.onnx.export_onnx(model, include_embeddings=True)``, so a
client sends the same request to this server and to the full ONNX graph, and gets the same
scores for ids that are -1 or rows of the tables. Beyond that the two differ on purpose: a key
that no tier holds pools the table's default vector here (parameter-server semantics: keys are
arbitrary int64, not row numbers), where ``export.onnx.run_onnx`` refuses an id outside the
table; keys below -1 are an error in both.

The pooling ``combiner`` of each table is read from the dense graph's serving metadata
(:mod:`hps.artifact_format`, written by ``export.onnx``); a graph without it, or with
metadata of another version, is refused.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hps.artifact_format import ARTIFACT_VERSION, SERVING_METADATA_KEY, ServingMetadata
from hps.config import ModelConfig
from hps.serving.clipping import clip
from hps.serving.dense_cost import (
    DEFAULT_PARALLEL_MIN_MACS,
    Crossover,
    measure_crossover,
    serial_batch_limit,
    time_sessions,
    timed_batch_limit,
    weight_macs_per_sample,
)
from hps.session import LookupSession
from hps.types import FormatVersionError, Pooling
from hps.vocabulary import ServingVocabulary

__all__ = [
    "DLRMServable",
    "InputError",
    "NonFiniteOutputError",
    "Tensors",
    "check_outputs_finite",
]


log = logging.getLogger(__name__)

#: A request's or an execution's tensors by name.
Tensors = dict[str, np.ndarray]


_ID_DTYPES = (np.dtype(np.int64), np.dtype(np.int32))  # the id inputs a request may send


class CheckedInputs(dict[str, np.ndarray]):
    """A request's inputs after :meth:`DLRMServable.check`: ids already mapped through the
    model's vocabulary (row ids, not raw ids) and validated, so they are never checked or
    mapped a second time (a raw id mapped twice would read another row)."""


class InputError(ValueError):
    """A request whose tensors do not fit the model; the message names the input."""


class NonFiniteOutputError(ArithmeticError):
    """A request whose scores came out NaN or infinite (HTTP 422, gRPC ``INVALID_ARGUMENT``):
    its inputs, or the rows it looked up, overflow the model's float32 arithmetic."""


@dataclass(frozen=True)
class _Table:
    name: str
    dim: int
    max_hotness: int
    combiner: str


class DLRMServable:
    """One model of a ``ps.json``: HPS lookups + the dense ONNX graph.

    Args:
        model: the model's config (its ``network_file`` is the dense graph: inputs ``dense
            (B, D) float32`` and ``pooled (B, T, dim) float32``, output ``(B,) float32``).
        session: the parameter server's lookup session of this model.
        ort_threads: onnxruntime intra-op threads per call (0: onnxruntime's default).
        ort_parallel_min_macs: without ``ort_measure``, the fewest multiply-adds of the
            graph's weight matrices an execution runs on ``ort_threads`` (counted per sample
            and for the weights' read:
            :func:`hps.serving.dense_cost.serial_batch_limit`); smaller ones run on one
            thread, where waking the pool costs more than it saves (0: every execution on
            ``ort_threads``). The scores are the same either way.
        ort_measure: time both sessions at load and run on one thread the batches it wins
            (:func:`hps.serving.dense_cost.measure_crossover`), rather than counting
            multiply-adds against ``ort_parallel_min_macs`` (which 0 still turns off):
            :attr:`crossover` holds the timings. Batches whose random inputs would pass
            :data:`~hps.serving.dense_cost.MEASURE_MAX_BYTES` are not timed and run on the
            pool.

    Raises:
        FormatVersionError: the graph's serving metadata is missing or of another version.
        ValueError: no ``network_file``, a graph whose inputs are not ``dense`` / ``pooled``,
            metadata whose tables disagree with ``ps.json``, a negative thread count or
            ``ort_parallel_min_macs``, or a graph that fails on random inputs while timed.
    """

    def __init__(
        self,
        model: ModelConfig,
        session: LookupSession,
        ort_threads: int = 0,
        ort_parallel_min_macs: int = DEFAULT_PARALLEL_MIN_MACS,
        ort_measure: bool = True,
    ) -> None:
        import onnxruntime as ort

        if not model.network_file:
            raise ValueError(
                f"model {model.model!r} has no network_file in ps.json; the server "
                "serves a whole DLRM (dense graph + embeddings)"
            )
        path = Path(model.network_file)
        if not path.is_file():
            raise ValueError(f"model {model.model!r}: network_file {str(path)!r} does not exist")
        if ort_threads < 0:
            raise ValueError(f"ort_threads must be >= 0, got {ort_threads}")
        if ort_parallel_min_macs < 0:
            raise ValueError(f"ort_parallel_min_macs must be >= 0, got {ort_parallel_min_macs}")

        def load(threads: int) -> Any:
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = threads
            opts.inter_op_num_threads = 1
            # onnxruntime's pool threads otherwise spin after each run: on a shared host that
            # burns the cores the event loop and the lookups need (2 threads, batch 16: 540 µs
            # of CPU per 90 µs run spinning, 145 µs not)
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
            try:
                return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
            except Exception as e:  # onnxruntime raises its own types for a corrupt file
                raise ValueError(f"model {model.model!r}: cannot load {str(path)!r}: {e}") from None

        self._ort = load(ort_threads)
        self.name = model.model
        self.max_batch_size = model.max_batch_size
        self.session = session
        ins = {i.name: i for i in self._ort.get_inputs()}
        if set(ins) != {"dense", "pooled"}:
            raise ValueError(
                f"model {model.model!r}: {path.name} must have inputs 'dense' and "
                f"'pooled' (export_onnx(include_embeddings=False)), has {sorted(ins)}"
            )
        d = ins["dense"].shape[1] if len(ins["dense"].shape) == 2 else None
        if not isinstance(d, int):
            raise ValueError(
                f"model {model.model!r}: input 'dense' must be (B, D) with a fixed D, "
                f"got {ins['dense'].shape}"
            )
        self.dense_features = d
        self._output = self._ort.get_outputs()[0].name
        meta = self._ort.get_modelmeta().custom_metadata_map.get(SERVING_METADATA_KEY)
        combiners = self._combiners(model, meta, path)
        self.tables = [
            _Table(t.name, t.dim, t.max_query_per_sample, combiners[t.name]) for t in model.tables
        ]
        # raw ids → rows and the hotness policy training used (hps.vocabulary), when exported
        self.vocabulary = ServingVocabulary.beside(path)
        dims = {t.dim for t in self.tables}
        if len(dims) != 1:
            raise ValueError(
                f"model {model.model!r}: the dense graph takes one pooled block, so "
                f"every table needs the same vector size; got {sorted(dims)}"
            )
        self._table_names = [t.name for t in self.tables]
        self._id_names = tuple(f"ids_{t.name}" for t in self.tables)
        self._input_names = frozenset({"dense", *self._id_names})
        self._plain_widths_for: tuple[ServingVocabulary | None, tuple[int, ...], bool] | None = None
        self._pooling = [Pooling(t.combiner) for t in self.tables]
        # per calling thread (the model's inference thread, or any thread calling ``infer``):
        # a grow-only float32 buffer (the pooled block) each execution writes into,
        # so no two executions ever share one and no execution page-faults a fresh one
        self._buffers = threading.local()
        #: multiply-adds of one sample in the dense graph's weight matrices (0: not counted;
        #: they are counted only where they decide the thread count, without ``ort_measure``)
        self.macs_per_sample = 0
        #: what timing both sessions at load found (``None``: not measured)
        self.crossover: Crossover | None = None
        #: executions of fewer samples run the dense graph on one onnxruntime thread (0: none)
        self.serial_below = 0
        # the same graph on one thread, with a copy of its weights of its own
        self._ort_serial: Any = None
        if ort_threads != 1 and ort_parallel_min_macs:
            if ort_measure:
                self._ort_serial = load(1)
                shapes = {"dense": (d,), "pooled": (len(self.tables), self.tables[0].dim)}
                timed = timed_batch_limit(
                    model.max_batch_size, 4 * (d + len(self.tables) * self.tables[0].dim)
                )
                try:
                    self.crossover = measure_crossover(
                        time_sessions(self._ort.run, self._ort_serial.run, shapes, [self._output]),
                        timed,
                    )
                except Exception as e:  # onnxruntime raises its own types for a graph that fails
                    raise ValueError(
                        f"model {model.model!r}: its dense graph failed on random inputs "
                        f"{shapes} (after the batch) while its threads were timed: {e}"
                    ) from None
                self.serial_below = self.crossover.serial_below
            else:
                self.macs_per_sample = _counted_macs(model.model, path)
                self.serial_below = serial_batch_limit(
                    self.macs_per_sample, ort_parallel_min_macs, model.max_batch_size
                )
        if not self.serial_below:
            self._ort_serial = None
        elif self._ort_serial is None:
            self._ort_serial = load(1)

    @staticmethod
    def _combiners(model: ModelConfig, meta: str | None, path: Path) -> dict[str, str]:
        """Each table's combiner from the graph's serving metadata, which must be of this
        version and name the tables of ``ps.json`` in its order."""
        if meta is None:
            raise FormatVersionError(
                f"{path} (ONNX metadata {SERVING_METADATA_KEY!r})",
                None,
                ARTIFACT_VERSION,
                f"model {model.model!r}: the dense graph has no serving metadata; export it "
                "with export.onnx.export_onnx",
            )
        tables = ServingMetadata.from_json(meta, str(path)).tables
        names = [t.name for t in model.tables]
        if [t.name for t in tables] != names:
            raise ValueError(
                f"model {model.model!r}: ps.json tables {names} differ from the dense "
                f"graph's {[t.name for t in tables]} ({path.name} metadata)"
            )
        return {t.name: t.combiner for t in tables}

    # ------------------------------------------------------------------ protocol metadata
    def metadata(self) -> dict[str, Any]:
        """The v2 model-metadata document (``GET /v2/models/{name}``)."""
        inputs = [{"name": "dense", "datatype": "FP32", "shape": [-1, self.dense_features]}]
        inputs += [
            {"name": f"ids_{t.name}", "datatype": "INT64", "shape": [-1, t.max_hotness]}
            for t in self.tables
        ]
        return {
            "name": self.name,
            "versions": ["1"],
            "platform": "tilerec_dlrm",
            "inputs": inputs,
            "outputs": [
                {"name": "logits", "datatype": "FP32", "shape": [-1]},
                {"name": "probability", "datatype": "FP32", "shape": [-1]},
            ],
        }

    def config(self) -> dict[str, Any]:
        """The model's configuration in Triton's JSON form (``GET /v2/models/{name}/config``;
        gRPC ``ModelConfig``). With ``max_batch_size`` > 0, ``dims`` leave out the batch
        dimension, so a ``(B,)`` output is ``dims [1]`` reshaped to ``[]``, as Triton writes it.
        """
        inputs = [{"name": "dense", "data_type": "TYPE_FP32", "dims": [self.dense_features]}]
        inputs += [
            {"name": f"ids_{t.name}", "data_type": "TYPE_INT64", "dims": [t.max_hotness]}
            for t in self.tables
        ]
        scalar = {"data_type": "TYPE_FP32", "dims": [1], "reshape": {"shape": []}}
        return {
            "name": self.name,
            "platform": "tilerec_dlrm",
            "backend": "",
            "max_batch_size": self.max_batch_size,
            "input": inputs,
            "output": [{"name": "logits", **scalar}, {"name": "probability", **scalar}],
        }

    # ------------------------------------------------------------------ inference
    @property
    def id_inputs(self) -> list[str]:
        """The id inputs' names, ``ids_<t>`` in table order."""
        return list(self._id_names)

    def check(self, inputs: Tensors) -> CheckedInputs:
        """One request's inputs checked and normalised, ready to run or to merge with others.

        Args:
            inputs: ``dense (B, D) float32`` and ``ids_<t> (B, w_t) int64|int32`` per table.

        Returns:
            ``dense (B, D) float32`` (C-contiguous) and ``ids_<t> (B, w_t) int64``.

        Raises:
            InputError: a missing, unknown, mistyped or misshaped input, a batch over
                ``max_batch_size``, a dense value that is NaN or infinite, a key below -1.
        """
        checked = self._check_plain(inputs)
        if checked is not None:
            return checked
        return self._check_full(inputs)

    def _check_plain(self, inputs: Tensors) -> CheckedInputs | None:
        """:meth:`check` of a request every check passes without a word and every table takes
        as it is: the model's inputs, FP32 dense ``(B, D)`` all finite within the batch bound,
        ids int64 or int32 ``(B, w)`` with ``w`` within the table's hotness and its
        vocabulary's, every key ≥ 0 (≥ -1, padding, when no table has a vocabulary entry), no
        key list (so the vocabulary maps each id to itself). One
        reduction over all keys instead of one per table: a small request's tables are many
        small arrays. ``None`` for any other request (:meth:`_check_full` words its error)."""
        if inputs.keys() != self._input_names:
            return None
        dense = inputs["dense"]
        if dense.dtype != np.float32 or dense.ndim != 2 or dense.shape[1] != self.dense_features:
            return None
        b = dense.shape[0]
        if b > self.max_batch_size:
            return None
        ids = [inputs[n] for n in self._id_names]
        widths, any_entry = self._plain_widths()
        for a, w in zip(ids, widths, strict=True):
            if a.dtype not in _ID_DTYPES or a.ndim != 2 or a.shape[0] != b or a.shape[1] > w:
                return None
        keys = np.concatenate(ids, axis=None)
        # -1 pads a short bag; a vocabulary entry moves padding, so it takes the full path
        if keys.size and keys.min() < (0 if any_entry else -1):
            return None
        if not np.isfinite(dense).all():
            return None
        out = CheckedInputs(dense=np.ascontiguousarray(dense))
        for name, a in zip(self._id_names, ids, strict=True):
            # a copy of its own: ids may be views of the request body
            out[name] = a.astype(np.int64)
        return out

    def _plain_widths(self) -> tuple[tuple[int, ...], bool]:
        """Per table, the widest bag :meth:`_check_plain` takes (-1: none, the vocabulary has
        a key list), and whether any table has a vocabulary entry; for the vocabulary in
        effect."""
        voc = self.vocabulary
        cached = self._plain_widths_for
        if cached is not None and cached[0] is voc:
            return cached[1], cached[2]
        widths = []
        for t in self.tables:
            entry = None if voc is None else voc.tables.get(t.name)
            if entry is None:
                widths.append(t.max_hotness)
            else:
                widths.append(min(t.max_hotness, entry.hotness) if entry.keys is None else -1)
        any_entry = voc is not None and any(t.name in voc.tables for t in self.tables)
        self._plain_widths_for = (voc, tuple(widths), any_entry)
        return tuple(widths), any_entry

    def _check_full(self, inputs: Tensors) -> CheckedInputs:
        """:meth:`check` of any request: every check, each error worded."""
        want = self._input_names
        if inputs.keys() != want:
            missing, extra = sorted(want - set(inputs)), sorted(set(inputs) - want)
            raise InputError(
                f"model {self.name!r}: missing inputs {missing}, unknown inputs "
                f"{[clip(e) for e in extra]}; expected {sorted(want)}"
            )
        mapped = self._map_ids(inputs, _keys_floor([inputs[n] for n in self._id_names]))
        dense = inputs["dense"]
        if dense.dtype != np.float32:
            raise InputError(f"input 'dense' must be FP32, got {dense.dtype}")
        if dense.ndim != 2 or dense.shape[1] != self.dense_features:
            raise InputError(
                f"input 'dense' must have shape [B, {self.dense_features}], got {list(dense.shape)}"
            )
        b = dense.shape[0]
        if b > self.max_batch_size:
            raise InputError(
                f"batch {b} exceeds model {self.name!r}'s max_batch_size {self.max_batch_size}"
            )
        if not np.isfinite(dense).all():
            raise InputError("input 'dense' holds NaN or infinite values")
        out = CheckedInputs(dense=np.ascontiguousarray(dense))
        for t in self.tables:
            name = f"ids_{t.name}"
            ids, low = mapped[name]
            out[name] = self._check_ids(t, ids, b, low)
        return out

    def _map_ids(
        self, inputs: Tensors, floor: int | None = None
    ) -> dict[str, tuple[np.ndarray, int | None]]:
        """Each ``ids_<t>`` input through the model's vocabulary (raw ids → rows, the hotness
        policy), with a lower bound of its keys when already known (``None``: not computed);
        ``floor``: the smallest key of all id inputs, when known (one reduction for all
        tables: a request's tables are many small arrays).

        A table whose vocabulary maps raw ids to themselves (no key list) and whose request
        bag is at most ``hotness`` wide with no ``-1`` in it comes out of the vocabulary
        unchanged (no padding to move, no bag to refuse or truncate), so such ids skip it."""
        out: dict[str, tuple[np.ndarray, int | None]] = {}
        voc = self.vocabulary
        rest: Tensors = {}
        for t in self.tables:
            name = f"ids_{t.name}"
            ids = inputs[name]
            entry = None if voc is None else voc.tables.get(t.name)
            if entry is None:
                out[name] = (ids, floor)
                continue
            if (
                entry.keys is None
                and ids.dtype in _ID_DTYPES
                and ids.ndim == 2
                and ids.shape[1] <= entry.hotness
            ):
                if floor is not None and floor >= 0:
                    low = floor
                else:
                    low = int(ids.min()) if ids.size else 0
                if low >= 0:
                    out[name] = (ids, low)
                    continue
            rest[name] = ids
        if rest:
            assert voc is not None  # only tables with an entry go to the vocabulary
            try:
                rows = voc.apply(rest)
            except ValueError as e:
                raise InputError(str(e)) from None
            for name in rest:
                out[name] = (rows[name], None)
        return out

    def _check_ids(self, t: _Table, ids: np.ndarray, b: int, low: int | None = None) -> np.ndarray:
        """``ids (B, w) int64|int32`` as int64 (``InputError`` naming the input); ``low`` a
        lower bound of its keys when the caller knows one that is ≥ -1 (its smallest key
        otherwise, which names the bad key)."""
        name = f"ids_{t.name}"
        if ids.dtype not in _ID_DTYPES:
            raise InputError(f"input {name!r} must be INT64 or INT32, got {ids.dtype}")
        if ids.ndim != 2 or ids.shape[0] != b:
            raise InputError(
                f"input {name!r} must have shape [{b}, w] (w ≤ {t.max_hotness}), "
                f"got {list(ids.shape)}"
            )
        if ids.shape[1] > t.max_hotness:
            raise InputError(
                f"input {name!r} has {ids.shape[1]} ids per sample; table {t.name!r} "
                f"allows at most {t.max_hotness} "
                "(maxnum_catfeature_query_per_table_per_sample)"
            )
        if low is not None and low < -1:
            low = None  # a bound over other inputs too: this input's own smallest key decides
        if ids.size and (low := int(ids.min()) if low is None else low) < -1:
            raise InputError(f"input {name!r} holds key {low}; keys are ≥ 0 (-1 pads a short bag)")
        return ids.astype(np.int64)  # a copy of its own: ids may be views of the request body

    def infer(self, inputs: Tensors) -> Tensors:
        """Score one batch (its outputs are not checked: see :func:`check_outputs_finite`).

        Args:
            inputs: ``dense (B, D) float32`` and ``ids_<t> (B, w_t) int64|int32`` per table,
                raw as a client sent them, or :class:`CheckedInputs` (run as they are).

        Returns:
            ``{"logits": (B,) float32, "probability": (B,) float32}``.

        Raises:
            InputError: see :meth:`check`.
            TimeoutError: the parameter server had no free lookup worker in time.
            TierUnavailableError: a key that may exist could be read from no tier.
        """
        if not isinstance(inputs, CheckedInputs):
            inputs = self.check(inputs)
        dense = inputs["dense"]
        b = dense.shape[0]
        if b == 0:
            logits = np.zeros((0,), dtype=np.float32)
        else:
            pooled = self._pool(inputs, b)
            serial = self._ort_serial
            run = serial.run if serial is not None and b < self.serial_below else self._ort.run
            logits = run([self._output], {"dense": dense, "pooled": pooled})[0]
            logits = logits.astype(np.float32, copy=False).reshape(b)
        prob = (1.0 / (1.0 + np.exp(-logits.astype(np.float64)))).astype(np.float32)
        return {"logits": logits, "probability": prob}

    def _pool(self, inputs: Tensors, b: int) -> np.ndarray:
        """Every table's bags of ``inputs`` (``ids_<t> (B, w_t) int64``, -1 = padding) as
        ``(B, T, dim) float32``, valid until this thread's next call: gathered and pooled in
        one fused call (:meth:`LookupSession.lookup_pooled`) that sums each bag's rows in the
        order its request gave them, from 0 (so a sample's vector does not depend on its batch
        mates, nor on which of its rows were cache hits: merged executions stay bit-equal to
        each request alone), into this thread's reused buffer."""
        t, dim = len(self.tables), self.tables[0].dim
        keys = [torch.from_numpy(inputs[name]) for name in self._id_names]
        pooled = self._buffer("pooled", b * t * dim).view(b, t * dim)
        try:
            self.session.lookup_pooled(self._table_names, keys, self._pooling, out=pooled)
        except ValueError as e:  # a key the parameter server refuses, named by its table
            raise InputError(f"model {self.name!r}: {e}") from None
        return pooled.view(b, t, dim).cpu().numpy()  # a CUDA session's block is copied

    def _buffer(self, name: str, need: int) -> torch.Tensor:
        """This thread's grow-only float32 buffer ``name``, its first ``need`` elements, on
        the session's device (where the fused pass writes)."""
        buf: torch.Tensor | None = getattr(self._buffers, name, None)
        if buf is None or buf.numel() < need:
            buf = torch.empty(need, dtype=torch.float32, device=self.session.device)
            setattr(self._buffers, name, buf)
        return buf[:need]


def check_outputs_finite(model: str, outputs: Tensors) -> None:
    """Refuse outputs holding a NaN or an infinity (a score no client should act on).

    Args:
        model: the model's name (for the message).
        outputs: output name → ``(B,)`` array of one request.

    Raises:
        NonFiniteOutputError: naming the model, the output and the first bad sample.
    """
    for name, arr in outputs.items():
        finite = np.isfinite(arr)
        if not finite.all():
            bad = np.flatnonzero(~finite.reshape(-1))
            raise NonFiniteOutputError(
                f"model {clip(model)!r} computed a non-finite {name} ({arr.reshape(-1)[bad[0]]}) "
                f"for sample {int(bad[0])} ({bad.size} of {arr.size} values): the inputs or the "
                "embedding rows they look up overflow the model's float32 arithmetic"
            )


def _keys_floor(ids: list[np.ndarray]) -> int | None:
    """The smallest key of all ``ids`` arrays (int64 or int32) in one reduction, or ``None``
    when one is of another type (the per-input checks name it) or there are no keys."""
    if not ids or any(a.dtype not in _ID_DTYPES for a in ids):
        return None
    flat = np.concatenate([a.ravel() for a in ids])
    return int(flat.min()) if flat.size else None


def _counted_macs(model: str, path: Path) -> int:
    """:func:`weight_macs_per_sample` of ``model``'s graph, 0 (logged) when it cannot be
    counted: its executions then all run on the pool, as without the bound."""
    try:
        macs = weight_macs_per_sample(path)
    except (ImportError, ValueError) as e:
        log.warning(
            "model %r: its dense graph's cost is not counted (%s); every execution "
            "runs on all onnxruntime threads",
            model,
            e,
        )
        return 0
    if macs == 0:
        log.warning(
            "model %r: no weight matrix of its dense graph was counted (MatMul or Gemm "
            "with an initializer operand); every execution runs on all onnxruntime "
            "threads",
            model,
        )
    return macs
