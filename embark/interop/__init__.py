"""embark.interop: TorchRec models, tables, batches and plans in tilerec's terms.

TorchRec is optional: nothing here imports it at import time; the functions that build TorchRec
objects import it when called.

- tables: :func:`tables_from_ebc_configs`, :func:`workload_from_ebc_configs`,
  :func:`ebc_configs_from_tables` (``EmbeddingBagConfig`` ⇄ :class:`~embark.types.TableConfig`).
- weights: :func:`ebc_to_embark_state_dict`, :func:`embark_to_ebc_state_dict`
  (``embedding_bags.<t>.weight`` ⇄ ``embeddings.<t>.weight``).
- batches: :func:`batch_from_kjt` (a ``KeyedJaggedTensor`` keyed by feature → a
  :class:`~embark.data.jagged.JaggedBatch` keyed by table; see ``JaggedBatch.from_kjt``).
- plans: :func:`plan_from_torchrec`, :func:`plan_to_torchrec`.
- models: :class:`EBCModel` (an ``EmbeddingBagCollection`` + a dense module, what ``export``
  exports and ``hps`` serves), :func:`from_torchrec_dlrm` (TorchRec's own DLRM as one).

>>> from embark.interop import from_torchrec_dlrm           # doctest: +SKIP
>>> from export import write_serving_artifacts              # doctest: +SKIP
>>> write_serving_artifacts(from_torchrec_dlrm(torchrec_dlrm), "out")  # doctest: +SKIP
"""

from embark.interop.torchrec_model import EBCModel, TorchRecDLRMDense, from_torchrec_dlrm
from embark.interop.torchrec_plan import plan_from_torchrec, plan_to_torchrec
from embark.interop.torchrec_tables import (
    batch_from_kjt,
    ebc_configs_from_tables,
    ebc_to_embark_state_dict,
    embark_to_ebc_state_dict,
    feature_of_table,
    tables_from_ebc_configs,
    workload_from_ebc_configs,
)

__all__ = [
    "EBCModel",
    "TorchRecDLRMDense",
    "batch_from_kjt",
    "ebc_configs_from_tables",
    "ebc_to_embark_state_dict",
    "embark_to_ebc_state_dict",
    "feature_of_table",
    "from_torchrec_dlrm",
    "plan_from_torchrec",
    "plan_to_torchrec",
    "tables_from_ebc_configs",
    "workload_from_ebc_configs",
]
