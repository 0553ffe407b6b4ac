"""What the console says about a run: its set-up, evaluations, curriculum changes, the end.

Every line the trainer prints is made here, from the run and its progress, so the loop only
decides *when* to say something. Also the throughput meter behind tokens/s.
"""

from __future__ import annotations

import signal
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fbtrain.evaluate import LN2
from fbtrain.make_command import make_command
from fbtrain.messages import is_int, is_number
from fbtrain.metrics.console import fit_parts, format_duration
from fbtrain.models import count_parameters
from fbtrain.models.core.select import core, core_label
from fbtrain.train.batches import CarriedStreams

if TYPE_CHECKING:
    from fbtrain.train.setup import RunParts, TrainState
    from fbtrain.train.step import StepResult

WARMUP_STEPS = 1  # steps of each process left out of tokens/s (allocations, first kernels)
# The status line's tokens/s is over the steps of its last 8 lines (train.log_every steps
# each): one line's steps are an eighth of it, so a short spell of load on a shared machine
# moves it by a part, not several-fold.
RATE_LINES = 8


class Throughput:
    """Tokens per second of whole training steps (their own time, not evaluations, samples
    or saves).

    :meth:`window_rate` is a metrics record's (the steps since the previous record),
    :meth:`recent_rate` the status line's: the last ``window`` steps, so that it moves
    with the machine's load without jumping with every short spell of it. Both leave out
    the first ``warmup`` steps of a process: they pay for allocations and first-call set-up
    that the rest of the run does not. ``tokens`` and ``seconds`` count every step of the
    process (the closing line's: its rate is their ratio).
    """

    def __init__(self, window: int, warmup: int = WARMUP_STEPS):
        self._skip = warmup
        self._window = [0, 0.0]  # tokens, seconds since the last window_rate()
        self._recent: deque[tuple[int, float]] = deque(maxlen=window)
        self._recent_sum = [0, 0.0]
        self.tokens, self.seconds = 0, 0.0  # every step of this process

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens += tokens
        self.seconds += seconds
        if self._skip > 0:
            self._skip -= 1
            return
        self._window[0] += tokens
        self._window[1] += seconds
        if len(self._recent) == self._recent.maxlen:
            old_tokens, old_seconds = self._recent[0]
            self._recent_sum[0] -= old_tokens
            self._recent_sum[1] -= old_seconds
        self._recent.append((tokens, seconds))
        self._recent_sum[0] += tokens
        self._recent_sum[1] += seconds

    def window_rate(self) -> float | None:
        """Tokens/s since the previous call (None when no measured step), then reset."""
        tokens, seconds = self._window
        self._window = [0, 0.0]
        return tokens / seconds if seconds > 0 else None

    def recent_rate(self) -> float | None:
        """Tokens/s over the last ``window`` measured steps (None before one)."""
        tokens, seconds = self._recent_sum
        return tokens / seconds if self._recent and seconds > 0 else None


@dataclass(frozen=True)
class SegmentTime:
    """Where this process's wall time went, for the closing line: ``tokens`` trained in
    ``steps`` seconds of training steps, ``evaluating`` and ``sampling`` seconds, and the
    ``wall`` time since it started (the rest: set-up, saves, logging)."""

    wall: float
    tokens: int
    steps: float
    evaluating: float = 0.0
    sampling: float = 0.0

    @property
    def rate(self) -> float | None:
        """Tokens/s of the training steps: ``tokens`` / ``steps``."""
        return self.tokens / self.steps if self.tokens and self.steps > 0 else None

    def parts(self, device: str) -> list[str]:
        """``1,536,000 tokens in 10m45s of steps``, ``2,381 tokens/s on cpu (...)`` and
        ``wall 11m50s: 10m45s steps, 40s evaluating, 12s sampling, 13s other``: each time
        rounded to whole seconds (tenths under a minute of wall time), and "other" (set-up,
        saves, logging) what is left, so the figures add up to the wall time as shown."""
        unit = 0.1 if self.wall < 60 else 1.0

        def show(units: int) -> str:
            return f"{units * unit:.1f}s" if unit < 1 else format_duration(units)

        wall, steps, evaluating, sampling = (round(t / unit) for t in (
            self.wall, self.steps, self.evaluating, self.sampling))
        other = max(0, wall - steps - evaluating - sampling)
        parts = []
        if self.rate is not None:
            parts += [f"{self.tokens:,} tokens in {show(steps)} of steps",
                      f"{self.rate:,.0f} tokens/s on {device}"]
        spent = [f"{show(steps)} steps", f"{show(evaluating)} evaluating"]
        if sampling:
            spent.append(f"{show(sampling)} sampling")
        parts.append(f"wall {show(wall)}: {', '.join(spent)}, {show(other)} other")
        return parts


def has_core(run: RunParts) -> bool:
    """Whether ``run``'s model steps through a feedback core (the feedback kinds)."""
    return hasattr(run.raw_model, "core_params")


def device_text(run: RunParts) -> str:
    """``cpu (2 threads, fp32, C++ core)`` or ``cuda:0 (NVIDIA H200, bf16 autocast, C++
    core)``: where, at what precision, and (feedback kinds) which core runs, as
    $FBTRAIN_CORE chose it (the PyTorch core, far slower, must not look like the C++ one)."""
    dtype = {None: "fp32", torch.bfloat16: "bf16 autocast",
             torch.float16: "fp16 autocast"}[run.amp_dtype]
    if has_core(run):
        dtype += f", {core_label(core())}"
    device = run.ctx.device
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)}, {dtype})"
    threads = torch.get_num_threads()
    return f"cpu ({threads} thread{'s' if threads != 1 else ''}, {dtype})"


def announcement(run: RunParts, progress: TrainState, resume_path: Path | None,
                 removed: list[Path]) -> list[str]:
    """The lines a run starts with: where, what model, what device and data, from where."""
    cfg, data = run.cfg, run.data
    lines = [f"run directory: {run.run_dir}"]
    if removed:
        lines.append(f"removed {len(removed)} temp file(s) left by an interrupted save: "
                     f"{', '.join(p.name for p in removed)}")
    lines.append(f"model: {cfg.model.kind}, {count_parameters(run.raw_model):,} parameters "
                 f"(d_model {cfg.model.d_model}, {cfg.model.n_layers} layers, "
                 f"{cfg.model.n_heads} heads)")
    ranks = f" x {run.ctx.world_size} ranks (DDP)" if run.ctx.enabled else ""
    lines.append(f"device: {device_text(run)}{ranks}")
    labelled = " (targets only where labelled; accuracy reported)" if data.labelled else ""
    lines.append(f"data: {data.n_tokens[0]:,} train / {data.n_tokens[1]:,} val "
                 f"{data.tokenizer.unit}s{labelled}, vocabulary {data.tokenizer.vocab_size}"
                 + (f", {data.chars_per_token[0]:.2f} characters a {data.tokenizer.unit}"
                    if data.chars_per_token[0] != 1.0 else ""))
    # Why fbtrain eval reports another figure: it scores every window of the split.
    lines.append(f"val loss below: {len(data.val_x)} fixed windows (fbtrain eval scores the "
                 "whole split)")
    if isinstance(run.batches, CarriedStreams):
        streams = run.batches.layout
        lines.append(f"context: carry ({len(streams.starts)} streams of {streams.length:,} "
                     "tokens per rank, memory carried across segments; validation windows "
                     f"after {data.val_x.shape[1] - run.curriculum.max_seq_len} tokens of context)")
    if resume_path is not None:
        lines.append(f"resuming from {resume_path} at step {progress.step}")
        if cfg.train.init_from:
            lines.append("train.init_from is ignored when resuming (the checkpoint has the "
                         "weights)")
    lines.extend(run.notes)  # why it resumes from there (or afresh), a rewind's files moved
    if cfg.logging.tensorboard:
        lines.append(f"tensorboard --logdir {run.run_dir.parent}")
    return lines


def step_metrics(run: RunParts, result: StepResult, tokens: int, rate: float | None
                 ) -> dict[str, Any]:
    """A step's metrics record (the loss of this step, not an average: exact under resume);
    ``tokens`` trained so far, ``rate`` tokens/s since the last record."""
    metrics: dict[str, Any] = {
        # bpc: over the characters the step's scored targets cover (a token may be several)
        "loss": result.loss, "bpc": result.loss / LN2 / result.chars_per_token,
        "lr": result.lr,
        "grad_norm": result.grad_norm, "tokens_per_sec": rate, "seq_len": result.seq_len,
        "batch_size": result.batch_size, "tokens": tokens,
        # Bounded when the memory recursion is stable; growing without end, it is not.
        "memory_rms": result.memory_rms.item(),
    }
    if result.accuracy is not None:
        metrics["accuracy"] = result.accuracy
    metrics.update({f"mem_weight/{i}": w for i, w in enumerate(result.memory_weights)})
    device = run.ctx.device
    if device.type == "cuda":
        metrics["peak_mem_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    return metrics


def curriculum_line(before: int, after: int, batch: int, step: int) -> str:
    """The sequence length changes before step ``step`` (0-based index)."""
    return f"curriculum: seq_len {before} -> {after} (batch {batch}) from step {step + 1}"


def evaluation_line(step: int, metrics: dict[str, float], improved: bool,
                    windows: int) -> str:
    """``step 100: val loss 1.6007 | bpc 2.3093 (64 fixed windows) | best``.

    The figure is named for what it is: the loss on the same ``windows`` validation
    windows at every evaluation, not the whole split that ``fbtrain eval`` scores."""
    accuracy = (f" | accuracy {100 * metrics['val/accuracy']:.2f}%"
                if "val/accuracy" in metrics else "")
    best = " | best" if improved else ""
    return (f"step {step}: val loss {metrics['val/loss']:.4f} | bpc {metrics['val/bpc']:.4f}"
            f" ({windows} fixed windows){accuracy}{best}")


def summary(run: RunParts, progress: TrainState, time: SegmentTime) -> str:
    """The last lines: where training stopped, its losses, then what this process trained,
    at what rate, and where its wall time went (:class:`SegmentTime`), ``|``-separated and
    wrapped between parts into lines of at most 80 columns
    (:func:`~fbtrain.metrics.console.fit_parts`). A run resumed (its clock counts earlier
    segments) first gives the run's totals, its tokens and training time over all segments,
    then this segment's figures, labelled as such."""
    parts = [f"done at step {progress.step}"]
    if progress.val_loss is not None:
        bpc = progress.val_loss / LN2 / run.data.chars_per_token[1]
        parts.append(f"val loss {progress.val_loss:.4f} (bpc {bpc:.4f}, "
                     f"{len(run.data.val_x)} fixed windows)")
    if progress.best_val_loss is not None:
        parts.append(f"best {progress.best_val_loss:.4f}")
    lines = fit_parts(parts)
    clock = run.clock
    segment = time.parts(device_text(run))
    if clock.resumed:
        lines += fit_parts([f"run: {progress.tokens:,} tokens, "
                            f"{format_duration(clock.seconds + time.wall)} training in "
                            f"{clock.segments + 1} segments"])
        segment[0] = f"this segment: {segment[0]}"
    return "\n".join(lines + fit_parts(segment))


def finished_lines(run_dir: Path, path: Path, payload: dict[str, Any], max_steps: int
                   ) -> tuple[str, str]:
    """What a run that has nothing left to train says instead of training: that it is done
    and what to do next, then its closing line from the checkpoint ``payload`` (read from
    ``path``): step, losses, and the run's tokens and training time (its ``clock``)."""
    step, progress = payload["step"], payload["progress"]
    # A run's own checkpoint resumed from outside it (its checkpoints/ moved away) is
    # sampled where it is.
    sample = run_dir if path.is_relative_to(run_dir) else path
    done = (f"{run_dir} is already trained: {path.name} is at step {step} and "
            f"train.max_steps is {max_steps}, so there is nothing to train (to train on: "
            f"--set train.max_steps=N, more than {step}; to try it: fbtrain sample "
            f"--checkpoint {sample})")
    parts = [f"done at step {step}"]
    if is_number(progress.get("val_loss")):
        bpc = progress.get("val_bpc")
        if not is_number(bpc) and payload.get("tokenizer") != "bpe":  # saved before val_bpc
            bpc = progress["val_loss"] / LN2  # a character or byte is one token
        bpc_text = f" (bpc {bpc:.4f})" if is_number(bpc) else ""
        parts.append(f"val loss {progress['val_loss']:.4f}{bpc_text}")
    if is_number(progress.get("best_val_loss")):
        parts.append(f"best {progress['best_val_loss']:.4f}")
    clock = payload.get("clock")
    if (isinstance(clock, dict) and is_number(clock.get("seconds"))
            and is_int(clock.get("segments"))):
        segments = clock["segments"]
        parts.append(f"run: {progress.get('tokens', 0):,} tokens, "
                     f"{format_duration(clock['seconds'])} training in {segments} "
                     f"segment{'s' if segments != 1 else ''}")
    return done, "\n".join(fit_parts(parts))


def resume_hint() -> str:
    """How to resume, in the interrupt line: the make command again, with the variables it
    was given (``make quick DATA=input.txt``), when make started the run (it passes
    ``--resume auto``), else both forms."""
    command = make_command()
    if command:
        return f"run `{command}` again to resume (it passes --resume auto)"
    return "resume with --resume auto (or run `make train` again, if make started it)"


def interrupted_line(step: int, signum: int, last: Path, *, final: bool, cut: str = "") -> str:
    """What a run stopped by signal ``signum`` after step ``step`` says (the CLI prints it
    as its ``error:`` line). ``final``: the step was the last one, so training is complete
    and there is nothing to resume; ``cut``: the evaluation or sample it cut short, if any."""
    name = signal.Signals(signum).name
    if not final:
        return f"interrupted at step {step} ({name}); saved {last}; {resume_hint()}"
    during = f", during its {cut}" if cut else ""
    lost = f" (that {cut} was not logged)" if cut else ""
    return (f"interrupted at step {step} ({name}), the last step{during}: training is "
            f"complete{lost}; saved {last}")
