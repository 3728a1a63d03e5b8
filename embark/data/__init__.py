"""embark.data: the batch every reader yields (:class:`Batch`, its sparse part a
:class:`JaggedBatch` in TorchRec's KJT layout), its per-rank slices (:func:`local_batch`),
a synthetic CTR generator with a planted teacher (:class:`SyntheticCTR`), a Criteo TSV
reader (:class:`CriteoTSV`), the converter into TorchRec's binary npy layout
(:func:`convert_criteo`, ``python -m embark.data.convert``) and its memory-mapped per-rank
reader (:class:`CriteoBinary`), which requires the manifest the converter writes last
(:class:`DenseTransform` names what a folder's dense arrays hold); tabular sources of your
own data (:class:`TabularSource`: a DataFrame, an Arrow table, Parquet or CSV, with a
:class:`TabularSpec`), the fitted :class:`Preprocessor` and its feature vocabularies
(:class:`Vocabulary`, saved as ``vocabulary.json`` for export and the server), and the one
meaning of ``hotness`` (the maximum bag size, :func:`enforce_hotness`)."""

from typing import TYPE_CHECKING

from embark.lazy import lazy_attributes

if TYPE_CHECKING:
    from embark.data.batch import Batch, local_batch, local_range, slice_batch
    from embark.data.binary import CriteoBinary, expand_multi_hot
    from embark.data.convert import convert_criteo
    from embark.data.criteo import CriteoTSV
    from embark.data.criteo_lines import CriteoFormatError, ReadStats
    from embark.data.criteo_sample import write_criteo_like
    from embark.data.hotness import HotnessError, enforce_hotness, max_bag_sizes
    from embark.data.jagged import JaggedBatch
    from embark.data.manifest import DenseTransform
    from embark.data.synthetic import Split, SyntheticCTR
    from embark.data.tabular import Preprocessor, TabularSource
    from embark.data.tabular_spec import Categorical, ColumnTransform, Dense, Splits, TabularSpec
    from embark.data.vocabulary import (
        OOVPolicy,
        Vocabulary,
        load_vocabularies,
        save_vocabularies,
    )

# Names are imported on first use, so that the converter starts without importing torch.
_EXPORTS = {
    "Batch": "embark.data.batch",
    "local_batch": "embark.data.batch",
    "local_range": "embark.data.batch",
    "slice_batch": "embark.data.batch",
    "CriteoBinary": "embark.data.binary",
    "expand_multi_hot": "embark.data.binary",
    "convert_criteo": "embark.data.convert",
    "CriteoTSV": "embark.data.criteo",
    "CriteoFormatError": "embark.data.criteo_lines",
    "ReadStats": "embark.data.criteo_lines",
    "write_criteo_like": "embark.data.criteo_sample",
    "JaggedBatch": "embark.data.jagged",
    "DenseTransform": "embark.data.manifest",
    "Split": "embark.data.synthetic",
    "SyntheticCTR": "embark.data.synthetic",
    "HotnessError": "embark.data.hotness",
    "enforce_hotness": "embark.data.hotness",
    "max_bag_sizes": "embark.data.hotness",
    "Preprocessor": "embark.data.tabular",
    "TabularSource": "embark.data.tabular",
    "Categorical": "embark.data.tabular_spec",
    "ColumnTransform": "embark.data.tabular_spec",
    "Dense": "embark.data.tabular_spec",
    "Splits": "embark.data.tabular_spec",
    "TabularSpec": "embark.data.tabular_spec",
    "OOVPolicy": "embark.data.vocabulary",
    "Vocabulary": "embark.data.vocabulary",
    "load_vocabularies": "embark.data.vocabulary",
    "save_vocabularies": "embark.data.vocabulary",
}

__all__ = [
    "Batch",
    "Categorical",
    "CriteoBinary",
    "CriteoFormatError",
    "CriteoTSV",
    "ColumnTransform",
    "Dense",
    "DenseTransform",
    "HotnessError",
    "JaggedBatch",
    "OOVPolicy",
    "Preprocessor",
    "ReadStats",
    "Split",
    "Splits",
    "SyntheticCTR",
    "TabularSource",
    "TabularSpec",
    "Vocabulary",
    "convert_criteo",
    "enforce_hotness",
    "expand_multi_hot",
    "load_vocabularies",
    "local_batch",
    "local_range",
    "max_bag_sizes",
    "save_vocabularies",
    "slice_batch",
    "write_criteo_like",
]


__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS, globals())
