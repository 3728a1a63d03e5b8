"""DLRM with dot interaction and DLRM-DCNv2 (low-rank cross layers), over any list of tables.

Data flow for a batch of ``B`` samples, ``T`` tables, bottom-MLP output width ``d``::

    dense (B, D) ──bottom_mlp──▶ x (B, d) ─┐
    sparse ──embeddings[t] (bags pooled)──▶ e_t (B, dim_t) ──[projections[t] if dim_t != d]─┐
                                           ▼                                              │
                   interaction( x, e_1..e_T )  ◀──────────────────────────────────────────┘
                       dot:   [x, upper triangle of (T+1)×(T+1) pairwise dot products]
                       dcnv2: x_{l+1} = x_0 ⊙ (U_l V_l x_l + b_l) + x_l,  x_0 = [x, e_1..e_T]
                                           ▼
                                  top_mlp ──▶ logit (B,)

Every weighted dense operation is an ``nn.Linear`` (bottom/top MLPs, projections, the cross
layers' ``V`` (no bias) and ``U``), so a pruner can find and replace them.
Initialisation follows the MLPerf DLRM reference: linear weights ``N(0, sqrt(2/(fan_in+fan_out)))``,
biases ``N(0, sqrt(1/fan_out))``, embedding rows ``U(-sqrt(1/num_rows), sqrt(1/num_rows))``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from torch import nn

from embark.data.hotness import enforce_hotness
from embark.data.jagged import JaggedBatch
from embark.models.tables import EmbeddingTables, TableModel, torch_dtype
from embark.models.workloads import Workload
from hps.rowformat import RowDtype


def _mlp(widths: Sequence[int], in_features: int, last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    prev = in_features
    for i, w in enumerate(widths):
        layers.append(nn.Linear(prev, w))
        if i < len(widths) - 1 or last_relu:
            layers.append(nn.ReLU())
        prev = w
    return nn.Sequential(*layers)


class DotInteraction(nn.Module):
    """Pairwise dot products of ``T+1`` vectors, concatenated to the bottom output.

    ``forward(x: (B, d), emb: (B, T, d)) -> (B, d + (T+1)*T/2)``.
    """

    rows: torch.Tensor
    cols: torch.Tensor

    def __init__(self, num_vectors: int) -> None:
        super().__init__()
        rows, cols = torch.triu_indices(num_vectors, num_vectors, offset=1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)

    @staticmethod
    def out_features(d: int, num_tables: int) -> int:
        n = num_tables + 1
        return d + n * (n - 1) // 2

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        z = torch.cat([x.unsqueeze(1), emb], dim=1)  # (B, T+1, d)
        gram = torch.bmm(z, z.transpose(1, 2))  # (B, T+1, T+1)
        return torch.cat([x, gram[:, self.rows, self.cols]], dim=1)


class CrossNetV2(nn.Module):
    """DCNv2 low-rank cross network (as MLPerf DLRM-DCNv2 and TorchRec ``LowRankCrossNet``).

    ``x_{l+1} = x_0 * u[l](v[l](x_l)) + x_l`` with ``v[l] = Linear(F, r, bias=False)`` and
    ``u[l] = Linear(r, F)``. ``forward(x0: (B, F)) -> (B, F)``.
    """

    def __init__(self, in_features: int, num_layers: int, low_rank: int) -> None:
        super().__init__()
        self.in_features = in_features
        self.v = nn.ModuleList(
            nn.Linear(in_features, low_rank, bias=False) for _ in range(num_layers)
        )
        self.u = nn.ModuleList(nn.Linear(low_rank, in_features) for _ in range(num_layers))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for v, u in zip(self.v, self.u):
            ux = u(v(x))
            if self._may_overwrite(u, x, x0, ux):
                # Without autograd the result goes into u's output, which nothing else holds: a
                # fresh (B, F) tensor is a new mmap that faults on every page it first touches
                # (4096 × 3456 on 2 cores: 25 ms out of place vs 5.7 ms in place in fp32).
                x = torch.addcmul(x, x0, ux, out=ux)
            else:
                x = torch.addcmul(x, x0, ux)  # x0 * u(v(x)) + x in one pass over memory
        return x

    @staticmethod
    def _may_overwrite(u: nn.Module, x: torch.Tensor, x0: torch.Tensor, ux: torch.Tensor) -> bool:
        """Whether ``u``'s output ``ux`` can take the step's result in place: autograd off (it
        would need ``ux`` for the backward), the out-of-place result's dtype and shape equal
        ``ux``'s (under autocast ``ux`` is bf16 while ``x`` stays fp32), and no forward hook
        that could hold ``ux`` (activation statistics would see it overwritten)."""
        if torch.is_grad_enabled() or ux.shape != x.shape:
            return False
        if torch.promote_types(torch.promote_types(x.dtype, x0.dtype), ux.dtype) != ux.dtype:
            return False
        hooks = nn.modules.module
        return not (u._forward_hooks or hooks._global_forward_hooks)


class DLRM(TableModel):
    """DLRM (``interaction.type == "dot"``) or DLRM-DCNv2 (``"dcnv2"``) for a :class:`Workload`.

    Submodules: ``embeddings`` (:class:`~embark.models.tables.EmbeddingTables`: table name →
    ``nn.EmbeddingBag``, weights ``(num_rows, dim)`` float32 unless trained in FP16/BF16, or a
    table in a row format; it holds the trainer's fused updates too), ``projections`` (``ModuleDict`` table name → ``Linear(dim_t, d,
    bias=False)``, only for tables whose dim differs from the bottom output ``d``),
    ``bottom_mlp``, ``interaction`` (:class:`DotInteraction` or :class:`CrossNetV2`), ``top_mlp``.
    Use :func:`build_model` to construct and initialise one.
    """

    def __init__(self, workload: Workload) -> None:
        super().__init__()
        self.workload = workload
        self.table_names = [t.name for t in workload.tables]
        self._num_rows = {t.name: t.num_rows for t in workload.tables}
        d = workload.bottom_mlp[-1]
        self.embeddings = EmbeddingTables(workload.tables)
        self.projections = nn.ModuleDict(
            {t.name: nn.Linear(t.dim, d, bias=False) for t in workload.tables if t.dim != d}
        )
        self.bottom_mlp = _mlp(workload.bottom_mlp, workload.dense_features, last_relu=True)
        num_tables = len(workload.tables)
        inter = workload.interaction
        if inter.type == "dot":
            self.interaction: nn.Module = DotInteraction(num_tables + 1)
            top_in = DotInteraction.out_features(d, num_tables)
        else:
            top_in = d * (num_tables + 1)
            self.interaction = CrossNetV2(top_in, inter.num_layers, inter.low_rank)
        self.top_mlp = _mlp(workload.top_mlp, top_in, last_relu=False)

    def pool(self, sparse: JaggedBatch) -> list[torch.Tensor]:
        """Pooled embeddings, one ``(B, dim_t) float32`` per table in workload order.

        Raises:
            KeyError: when a table's key is missing from ``sparse``.
            ValueError: naming the table, when an id is negative or ``>= num_rows``
                (``nn.EmbeddingBag`` would fail without saying which table).
        """
        values = [sparse.values_for(name) for name in self.table_names]
        self._check_ids(values)
        return [
            self.embeddings.bag(name, v, sparse.bag_offsets(name))
            for name, v in zip(self.table_names, values)
        ]

    def embedding_store(self) -> EmbeddingTables:
        """The model's tables (:class:`~embark.models.tables.EmbeddingTables`)."""
        return self.embeddings

    def embedding_tables(self) -> dict[str, nn.Parameter]:
        """``{table: (num_rows, dim) weight}`` of the float tables, in workload order (a table
        stored in a row format, ``embark.quant``, holds no weight and is left out)."""
        return self.embeddings.trainable_weights()

    def _check_ids(self, values: Sequence[torch.Tensor]) -> None:
        """Range check of every table's ``(nnz_t,) int64`` ids: one min/max per table and one
        device-to-host copy for all of them."""
        filled = [(n, v) for n, v in zip(self.table_names, values) if v.numel()]
        if not filled:
            return
        bounds = torch.stack([torch.stack(torch.aminmax(v)) for _, v in filled]).tolist()
        for (name, _), (lo, hi) in zip(filled, bounds):
            rows = self._num_rows[name]
            if lo < 0 or hi >= rows:
                bad = hi if hi >= rows else lo
                raise ValueError(
                    f"table {name!r} has {rows} rows but id {bad} was looked up "
                    f"(expected ids 0..{rows - 1})"
                )

    def dense_forward(
        self, dense: torch.Tensor, pooled: torch.Tensor | Sequence[torch.Tensor]
    ) -> torch.Tensor:
        """The dense part alone: bottom MLP, interaction, top MLP.

        Args:
            dense: ``(B, D) float32`` dense features.
            pooled: ``(B, T, dim) float32`` pooled embeddings in table order, or a sequence of
                ``T`` tensors ``(B, dim_t)`` (needed when table dims differ).

        Returns:
            ``(B,) float32`` logits.
        """
        x = self.bottom_mlp(dense)
        if isinstance(pooled, torch.Tensor):
            if pooled.dim() != 3 or pooled.shape[1] != len(self.table_names):
                raise ValueError(
                    f"pooled must be (B, {len(self.table_names)}, dim), got {tuple(pooled.shape)}"
                )
            if len(self.projections) == 0 and pooled.shape[2] == x.shape[1]:
                # already (B, T, d): skip the unbind + stack copy of the whole block
                return self._interact_top(x, pooled)
            pooled = pooled.unbind(1)
        if len(pooled) != len(self.table_names):
            raise ValueError(f"expected {len(self.table_names)} pooled tensors, got {len(pooled)}")
        embs = [
            self.projections[n](e) if n in self.projections else e
            for n, e in zip(self.table_names, pooled)
        ]
        return self._interact_top(x, torch.stack(embs, dim=1))

    def _interact_top(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """``x: (B, d)`` bottom output, ``emb: (B, T, d)`` → ``(B,)`` logits."""
        if isinstance(self.interaction, DotInteraction):
            z = self.interaction(x, emb)
        else:
            z = self.interaction(torch.cat([x, emb.flatten(1)], dim=1))
        return self.top_mlp(z).squeeze(-1)

    def forward(self, dense: torch.Tensor, sparse: JaggedBatch) -> torch.Tensor:
        """``dense: (B, D) float32``, ``sparse``: a :class:`JaggedBatch` keyed by table name →
        ``(B,) float32`` logits.

        A bag longer than its table's ``hotness`` is refused or truncated by the table's
        ``hotness_policy`` (:func:`embark.data.hotness.enforce_hotness`), as the server does.
        """
        sparse = enforce_hotness(sparse, self.workload.tables)
        self.check_inputs(dense, sparse)
        return self.dense_forward(dense, self.pool(sparse))

    def check_inputs(self, dense: torch.Tensor, sparse: JaggedBatch) -> None:
        """``dense`` is ``(B, dense_features)`` and ``sparse`` has the same ``B``.

        Raises:
            ValueError: naming the shapes.
        """
        if dense.dim() != 2 or dense.shape[1] != self.workload.dense_features:
            raise ValueError(
                f"dense must be (B, {self.workload.dense_features}), got {tuple(dense.shape)}"
            )
        if sparse.batch_size != dense.shape[0]:
            raise ValueError(
                f"dense has batch {dense.shape[0]} but sparse has batch {sparse.batch_size}"
            )


ModuleT = TypeVar("ModuleT", bound=nn.Module)

TableFill = Callable[[str, float, torch.Generator], None]
"""``fill(name, bound, generator)`` stands in for drawing one table's initial values: it must
draw exactly ``num_rows × dim`` float32 values of ``U(-bound, bound)`` from ``generator``, in
row-major order (:func:`uniform_block_` does, keeping any block of them)."""

# float32 values drawn at a time into scratch memory by uniform_block_ (4 MiB): rows outside
# the kept block cost this much memory however large the table is.
SCRATCH_ELEMENTS = 1 << 20


@torch.no_grad()
def init_weights_(model: ModuleT, seed: int, fill_table: TableFill | None = None) -> ModuleT:
    """MLPerf-reference initialisation of every ``nn.Linear`` and ``nn.EmbeddingBag`` in
    ``model``, drawn from a private generator seeded by ``seed`` (the global RNG is untouched).
    Modules are visited in ``named_modules`` order, so the result depends only on ``seed``.

    Args:
        fill_table: when given, an embedding module's weight is not written: its draw is
            ``fill_table(module name, bound, generator)`` (e.g. a rank keeping its shard of
            the table through :func:`uniform_block_`), so that the modules after it get the
            values they would get with the whole table drawn.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            fan_out, fan_in = m.weight.shape
            m.weight.normal_(0.0, math.sqrt(2.0 / (fan_in + fan_out)), generator=gen)
            if m.bias is not None:
                m.bias.normal_(0.0, math.sqrt(1.0 / fan_out), generator=gen)
        elif isinstance(m, nn.EmbeddingBag | nn.Embedding):
            bound = math.sqrt(1.0 / m.num_embeddings)
            if fill_table is None:
                m.weight.uniform_(-bound, bound, generator=gen)
            else:
                fill_table(name, bound, gen)
    return model


@torch.no_grad()
def uniform_block_(
    shape: tuple[int, int],
    bound: float,
    generator: torch.Generator,
    out: torch.Tensor | None = None,
    row_start: int = 0,
    col_start: int = 0,
    scratch_elements: int = SCRATCH_ELEMENTS,
) -> None:
    """Draw ``torch.empty(shape).uniform_(-bound, bound, generator=generator)`` keeping only
    the block ``[row_start : row_start + r, col_start : col_start + c]`` of it, in ``out``.

    The CPU generator draws one 32-bit number per float32 element, in row-major order, so a
    table drawn row block by row block is the table drawn whole: ``out`` gets exactly those
    values and ``generator`` ends where the whole draw leaves it (``rows × dim`` draws). Rows
    outside the block (and a column block's other columns) go through at most
    ``scratch_elements`` floats of scratch memory; a block of whole rows is drawn in place.

    Args:
        shape: ``(rows, dim)`` of the whole table.
        out: ``(r, c) float32``, the block; ``None``: keep nothing (only advance ``generator``).
        row_start, col_start: the block's first row and column in the table.

    Raises:
        ValueError: naming the shapes, when the block leaves the table or ``out`` is not
            float32 (another dtype draws other numbers).
    """
    num_rows, dim = shape
    r0, c0 = (row_start, col_start) if out is not None else (0, 0)
    r1, c1 = (r0 + out.shape[0], c0 + out.shape[1]) if out is not None else (0, 0)
    if out is not None and (out.dim() != 2 or out.dtype != torch.float32):
        raise ValueError(f"out must be a 2-d float32 tensor, got {out.dtype} {tuple(out.shape)}")
    if not (0 <= r0 <= r1 <= num_rows and 0 <= c0 <= c1 <= dim):
        raise ValueError(
            f"block rows {r0}:{r1}, columns {c0}:{c1} is outside the {num_rows} × {dim} table"
        )
    step = max(1, scratch_elements // max(dim, 1))
    scratch = torch.empty(min(step, num_rows) * dim)

    def through_scratch(start: int, stop: int) -> None:
        for a in range(start, stop, step):
            b = min(stop, a + step)
            rows = (
                scratch[: (b - a) * dim]
                .view(b - a, dim)
                .uniform_(-bound, bound, generator=generator)
            )
            lo, hi = max(a, r0), min(b, r1)
            if out is not None and lo < hi:
                out[lo - r0 : hi - r0].copy_(rows[lo - a : hi - a, c0:c1])

    through_scratch(0, r0)
    if out is not None and (c0, c1) == (0, dim) and out.is_contiguous():
        out.uniform_(-bound, bound, generator=generator)
    else:
        through_scratch(r0, r1)
    through_scratch(r1, num_rows)


def _materialise(model: DLRM, skip: tuple[str, ...] = ()) -> None:
    """Allocate (uninitialised, on the CPU) every child of a meta-device ``model`` but those
    named in ``skip``, and rebuild the interaction's index buffers (``to_empty`` leaves
    non-persistent buffers uninitialised)."""
    for name, child in model.named_children():
        if name not in skip:
            child.to_empty(device="cpu")
    if isinstance(model.interaction, DotInteraction):
        n = len(model.table_names) + 1
        model.interaction.rows, model.interaction.cols = torch.triu_indices(n, n, 1)


def build_model(workload: Workload, seed: int = 0, table_dtype: RowDtype = RowDtype.FP32) -> DLRM:
    """Build and initialise a :class:`DLRM` for ``workload``, deterministically from ``seed``.

    The modules are created on the meta device and materialised once, so building a large
    table costs one initialisation, not two.

    Args:
        table_dtype: the tables' storage dtype (``fp32``, ``fp16`` or ``bf16``): a half-size
            table is allocated as such and filled block by block (4 MiB of float32 scratch),
            never held in float32 whole; its values are the float32 model's rounded to
            nearest.

    Raises:
        ValueError: for a ``table_dtype`` a trainable table cannot have (int8 ...).
    """
    dtype = torch_dtype(table_dtype)
    with torch.device("meta"):
        model = DLRM(workload)
    if dtype == torch.float32:
        _materialise(model)
        return init_weights_(model, seed)
    _materialise(model, skip=("embeddings",))
    for t in workload.tables:
        bag = model.embeddings[t.name]
        assert isinstance(bag, nn.EmbeddingBag)
        bag.weight = nn.Parameter(torch.empty(t.num_rows, t.dim, dtype=dtype))
    return init_weights_(model, seed, _RoundedFill(model.embeddings))


class _RoundedFill:
    """A :data:`TableFill` (over module names ``embeddings.<table>``) drawing a table's float32
    values block of rows by block into its low-precision weight (rounded to nearest)."""

    def __init__(self, tables: EmbeddingTables) -> None:
        self.tables = tables

    def __call__(self, name: str, bound: float, generator: torch.Generator) -> None:
        weight = self.tables.trainable_weights()[name.removeprefix("embeddings.")]
        rows, dim = weight.shape
        step = max(1, SCRATCH_ELEMENTS // max(dim, 1))
        scratch = torch.empty(min(step, rows), dim)
        for start in range(0, rows, step):
            block = scratch[: min(step, rows - start)]
            block.uniform_(-bound, bound, generator=generator)
            weight.data[start : start + block.shape[0]].copy_(block)


def build_dense_part(
    workload: Workload, seed: int = 0, fill_table: TableFill | None = None
) -> DLRM:
    """The :class:`DLRM` of ``workload`` without its tables (``embeddings`` is empty; only
    :meth:`~DLRM.dense_forward` and :meth:`~DLRM.check_inputs` apply), no table ever allocated.

    Args:
        fill_table: called for each table in workload order as ``fill_table(table name,
            bound, generator)`` in place of its draw (:data:`TableFill`); the dense part then
            gets exactly ``build_model(workload, seed)``'s values. ``None``: no table is
            drawn, and the dense part gets other values (placeholders, e.g. for a checkpoint
            to overwrite).
    """
    with torch.device("meta"):
        model = DLRM(workload)
    _materialise(model, skip=("embeddings",))
    init_weights_(model, seed, _TableNames(fill_table))
    model.embeddings = EmbeddingTables(())
    return model


class _TableNames:
    """A :data:`TableFill` over module names (``embeddings.<table>``) calling ``fill`` with the
    table name (nothing is drawn without one)."""

    def __init__(self, fill: TableFill | None) -> None:
        self.fill = fill

    def __call__(self, name: str, bound: float, generator: torch.Generator) -> None:
        if self.fill is not None:
            self.fill(name.removeprefix("embeddings."), bound, generator)
