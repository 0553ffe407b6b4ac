"""Checkpoints: the files (:mod:`.files`: atomic save, safe load, lookup, keep-last-N), the
training state they hold (:mod:`.state`: the dict of parts, made, checked, restored, and the
upgrade from older layouts) and the model read back (:mod:`.contents`: load, warm start,
export).

The names other code uses are re-exported here (``fbtrain.checkpoint.load_model``, ...).
"""

from fbtrain.checkpoint.contents import load_model
from fbtrain.checkpoint.files import (
    BEST,
    CHECKPOINT_DIR,
    FORMAT,
    LAST,
    CheckpointError,
    CheckpointManager,
    load_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
)
from fbtrain.checkpoint.state import (
    make_checkpoint,
    nonfinite_tensors,
    read_checkpoint,
    restore_checkpoint,
    strip_wrapper_prefixes,
    upgrade,
)

__all__ = ["BEST", "CHECKPOINT_DIR", "FORMAT", "LAST", "CheckpointError", "CheckpointManager",
           "load_checkpoint", "load_model", "make_checkpoint", "nonfinite_tensors",
           "read_checkpoint", "resolve_checkpoint", "restore_checkpoint", "save_checkpoint",
           "strip_wrapper_prefixes", "upgrade"]
