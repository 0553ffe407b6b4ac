"""Training: ``run(cfg)`` trains a model as a config says (see :mod:`.trainer`).

    setup.py    build the run from the config, in one visible order (and restore it)
    step.py     one optimizer step: forward/backward, clip, agree across ranks, check, update
    trainer.py  the loop and its cadence: log, evaluate, sample, checkpoint, stop
    signals.py  SIGINT / SIGTERM / SIGHUP: save, then exit
    report.py   what the console says
    batches.py  where each step's micro-batches come from (random windows, carried streams)
    optim.py    AdamW's parameter groups and the learning-rate schedule
"""

from fbtrain.errors import TrainingError
from fbtrain.train.trainer import Trainer, run

__all__ = ["Trainer", "TrainingError", "run"]
