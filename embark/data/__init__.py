"""embark.data: the batch every reader yields (:class:`Batch`, its sparse part a
:class:`JaggedBatch` in TorchRec's KJT layout), its per-rank slices (:func:`local_batch`),
a synthetic CTR generator with a planted teacher (:class:`SyntheticCTR`), a Criteo TSV
reader (:class:`CriteoTSV`), the converter into TorchRec's binary npy layout
(:func:`convert_criteo`, ``python -m embark.data.convert``) and its memory-mapped per-rank
reader (:class:`CriteoBinary`), which requires the manifest the converter writes last
(:class:`DenseTransform` names what a folder's dense arrays hold)."""

from typing import TYPE_CHECKING

from embark.lazy import lazy_attributes

if TYPE_CHECKING:
    from embark.data.batch import Batch, local_batch, local_range, slice_batch
    from embark.data.binary import CriteoBinary, expand_multi_hot
    from embark.data.convert import convert_criteo
    from embark.data.criteo import CriteoTSV
    from embark.data.criteo_lines import CriteoFormatError, ReadStats
    from embark.data.criteo_sample import write_criteo_like
    from embark.data.jagged import JaggedBatch
    from embark.data.manifest import DenseTransform
    from embark.data.synthetic import Split, SyntheticCTR

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
}

__all__ = [
    "Batch",
    "CriteoBinary",
    "CriteoFormatError",
    "CriteoTSV",
    "DenseTransform",
    "JaggedBatch",
    "ReadStats",
    "Split",
    "SyntheticCTR",
    "convert_criteo",
    "expand_multi_hot",
    "local_batch",
    "local_range",
    "slice_batch",
    "write_criteo_like",
]


__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS, globals())
