"""Checkpoints: the files (:mod:`.files`: atomic save, safe load, lookup, keep-last-N) and
what they hold (:mod:`.contents`: make, check for resume and warm start, load a model).

The names other code uses are re-exported here (``fbtrain.checkpoint.load_model``, ...).
"""

from fbtrain.checkpoint.contents import (
    check_resume_payload,
    load_model,
    nonfinite_tensors,
    strip_wrapper_prefixes,
)
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

__all__ = ["BEST", "CHECKPOINT_DIR", "FORMAT", "LAST", "CheckpointError", "CheckpointManager",
           "check_resume_payload", "load_checkpoint", "load_model", "nonfinite_tensors",
           "resolve_checkpoint", "save_checkpoint", "strip_wrapper_prefixes"]
