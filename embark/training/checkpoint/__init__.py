"""Trainer checkpoints, one room: a folder of safetensors files and a versioned
``state.json``, written atomically and checked whole before anything is loaded.

- :mod:`~embark.training.checkpoint.store` saving and loading (layout, atomic publish,
  the three loading steps :func:`read_checkpoint`, :func:`check_fits`, :func:`restore`);
- :mod:`~embark.training.checkpoint.schema` the ``state.json`` schema
  (:func:`check_state`, :class:`FormatVersionError`);
- :mod:`~embark.training.checkpoint.shards` chunked tensors of a sharded save and reading any
  rectangle of them back (:class:`Chunk`, :func:`read_region`, :func:`plan_region`);
- :mod:`~embark.training.checkpoint.siblings` the temporary siblings a save writes and their
  cleanup and recovery (:func:`remove_stale_siblings`, :func:`recover_previous`).
"""

from embark.training.checkpoint.schema import (
    STATE_FILE,
    TENSOR_FILES,
    FormatVersionError,
    check_state,
)
from embark.training.checkpoint.shards import (
    Chunk,
    Piece,
    chunks_of,
    plan_region,
    read_pieces,
    read_region,
)
from embark.training.checkpoint.siblings import (
    fresh_sibling,
    previous_checkpoints,
    recover_previous,
    remove_stale_siblings,
)
from embark.training.checkpoint.store import (
    CHECKPOINT_FORMAT_VERSION,
    MODEL_FILE,
    OPTIMIZER_FILE,
    Checkpoint,
    begin_save,
    check_fits,
    check_save_target,
    file_records,
    finish_save,
    is_replaceable,
    optimizer_files,
    read_checkpoint,
    read_header,
    read_state,
    restore,
    save_checkpoint,
    state_document,
    verify_file,
    write_tensors,
)

__all__ = [
    "CHECKPOINT_FORMAT_VERSION",
    "MODEL_FILE",
    "OPTIMIZER_FILE",
    "STATE_FILE",
    "TENSOR_FILES",
    "Checkpoint",
    "Chunk",
    "FormatVersionError",
    "Piece",
    "begin_save",
    "check_fits",
    "check_save_target",
    "check_state",
    "chunks_of",
    "file_records",
    "finish_save",
    "fresh_sibling",
    "is_replaceable",
    "optimizer_files",
    "plan_region",
    "previous_checkpoints",
    "read_checkpoint",
    "read_header",
    "read_pieces",
    "read_region",
    "read_state",
    "recover_previous",
    "remove_stale_siblings",
    "restore",
    "save_checkpoint",
    "state_document",
    "verify_file",
    "write_tensors",
]
