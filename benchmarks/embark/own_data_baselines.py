"""The two references of the "Bring your own data" example (docs/own-data.md): TorchRec's DLRM
trained on the same batches, and a logistic regression on one-hot features of the same split.

Both select their epoch (or ``C``) by validation AUC and report the test AUC there, as the
example does.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from embark.data.batch import Batch
from embark.models.workloads import Workload
from embark.training.metrics import auc

__all__ = ["example_blocks", "logistic_regression_auc", "torchrec_dlrm_auc"]

PAGE = Path(__file__).resolve().parents[2] / "docs" / "own-data.md"


def example_blocks() -> list[str]:
    """The python blocks of the page's worked example, in order."""
    section = PAGE.read_text().split("## The worked example", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def _kjt_auc(model: torch.nn.Module, batches: Sequence[Batch]) -> float:
    model.eval()
    with torch.no_grad():
        logits = torch.cat([model(b.dense, b.sparse.to_kjt()).reshape(-1) for b in batches])
    return auc(logits, torch.cat([b.labels for b in batches]))


def torchrec_dlrm_auc(
    workload: Workload,
    epochs: Sequence[Sequence[Batch]],
    valid: Sequence[Batch],
    test: Sequence[Batch],
    lr: float,
    seed: int = 0,
) -> dict[str, float]:
    """TorchRec's ``DLRM`` (an ``EmbeddingBagCollection`` of the workload's tables, the same
    bottom and top widths, dot interaction) trained by ``torch.optim.Adagrad`` at ``lr`` on
    ``epochs`` (one list of batches each).

    Returns:
        ``{"valid_auc", "test_auc", "epoch"}`` at the epoch of the best validation AUC.
    """
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    torch.manual_seed(seed)
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name=t.name, embedding_dim=t.dim, num_embeddings=t.num_rows, feature_names=[t.name]
            )
            for t in workload.tables
        ]
    )
    model = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=workload.dense_features,
        dense_arch_layer_sizes=list(workload.bottom_mlp),
        over_arch_layer_sizes=list(workload.top_mlp),
    )
    opt = torch.optim.Adagrad(model.parameters(), lr=lr)
    best = {"valid_auc": -1.0, "test_auc": float("nan"), "epoch": -1.0}
    for e, batches in enumerate(epochs):
        model.train()
        for b in batches:
            opt.zero_grad()
            logits = model(b.dense, b.sparse.to_kjt()).reshape(-1)
            F.binary_cross_entropy_with_logits(logits, b.labels).backward()
            opt.step()
        va = _kjt_auc(model, valid)
        if va > best["valid_auc"]:
            best = {"valid_auc": va, "test_auc": _kjt_auc(model, test), "epoch": float(e)}
    return best


def _one_hot(workload: Workload, batches: Sequence[Batch]) -> tuple[object, np.ndarray]:
    """``(n, sum of rows + D)`` sparse one-hot ids (a bag: one 1 per id) beside the dense."""
    import scipy.sparse as sp

    blocks = []
    for t in workload.tables:
        rows, cols, n0 = [], [], 0
        for b in batches:
            lengths = b.sparse.lengths_for(t.name).numpy().astype(np.int64)
            rows.append(np.repeat(np.arange(lengths.size) + n0, lengths))
            cols.append(b.sparse.values_for(t.name).numpy())
            n0 += lengths.size
        r, c = np.concatenate(rows), np.concatenate(cols)
        blocks.append(sp.csr_matrix((np.ones(r.size), (r, c)), shape=(n0, t.num_rows)))
    dense = torch.cat([b.dense for b in batches]).numpy().astype(np.float64)
    x = sp.hstack([*blocks, sp.csr_matrix(dense)]).tocsr()
    return x, torch.cat([b.labels for b in batches]).numpy()


def logistic_regression_auc(
    workload: Workload,
    train: Sequence[Batch],
    valid: Sequence[Batch],
    test: Sequence[Batch],
    cs: Sequence[float] = (0.1, 0.3, 1.0, 3.0),
) -> dict[str, float]:
    """scikit-learn's ``LogisticRegression`` (L2, lbfgs) on one-hot ids and the dense features,
    ``C`` chosen by validation AUC.

    Returns:
        ``{"valid_auc", "test_auc", "C"}`` at the best ``C``.
    """
    from sklearn.linear_model import LogisticRegression

    xtr, ytr = _one_hot(workload, train)
    xva, yva = _one_hot(workload, valid)
    xte, yte = _one_hot(workload, test)
    best = {"valid_auc": -1.0, "test_auc": float("nan"), "C": float("nan")}
    for c in cs:
        m = LogisticRegression(C=c, max_iter=3000).fit(xtr, ytr)
        va = auc(torch.from_numpy(m.decision_function(xva)), torch.from_numpy(yva))
        if va > best["valid_auc"]:
            te = auc(torch.from_numpy(m.decision_function(xte)), torch.from_numpy(yte))
            best = {"valid_auc": va, "test_auc": te, "C": float(c)}
    return best
