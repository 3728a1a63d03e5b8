"""embark.data: the batch every reader yields (:class:`Batch`, its sparse part a
:class:`JaggedBatch` in TorchRec's KJT layout), its per-rank slices (:func:`local_batch`),
a synthetic CTR generator with a planted teacher (:class:`SyntheticCTR`) and a Criteo TSV
reader (:class:`CriteoTSV`)."""

from embark.data.batch import Batch, local_batch, local_range, slice_batch
from embark.data.criteo import CriteoFormatError, CriteoTSV
from embark.data.jagged import JaggedBatch
from embark.data.synthetic import Split, SyntheticCTR

__all__ = [
    "Batch",
    "CriteoFormatError",
    "CriteoTSV",
    "JaggedBatch",
    "Split",
    "SyntheticCTR",
    "local_batch",
    "local_range",
    "slice_batch",
]
