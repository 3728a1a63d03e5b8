"""embark.data: the jagged batch type, a synthetic CTR generator with a planted teacher, and a
Criteo TSV reader."""

from embark.data.criteo import CriteoFormatError, CriteoTSV
from embark.data.jagged import JaggedBatch
from embark.data.synthetic import Batch, Split, SyntheticCTR

__all__ = ["Batch", "CriteoFormatError", "CriteoTSV", "JaggedBatch", "Split", "SyntheticCTR"]
