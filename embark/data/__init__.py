"""embark.data: the jagged batch type, a synthetic CTR generator with a planted teacher, and a
Criteo TSV reader."""

from embark.data.batch import Batch
from embark.data.criteo import CriteoFormatError, CriteoTSV
from embark.data.jagged import JaggedBatch
from embark.data.synthetic import Split, SyntheticCTR

__all__ = ["Batch", "CriteoFormatError", "CriteoTSV", "JaggedBatch", "Split", "SyntheticCTR"]
