"""What the console says about a run: its set-up, evaluations, curriculum changes, the end.

Every line the trainer prints is made here, from the run and its progress, so the loop only
decides *when* to say something. Also the throughput meter behind tokens/s.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fbtrain.config.kinds import model_kind
from fbtrain.evaluate import LN2
from fbtrain.make_command import make_command
from fbtrain.messages import is_int, is_number
from fbtrain.metrics.console import fit_parts, format_duration
from fbtrain.models import count_parameters
from fbtrain.models.core.graphs import idle_graphs_note
from fbtrain.models.core.select import core, core_label
from fbtrain.train.batches import CarriedStreams

if TYPE_CHECKING:
    from fbtrain.train.setup import Progress, Run
    from fbtrain.train.step import StepResult

WARMUP_STEPS = 1  # steps of each process left out of tokens/s (allocations, first kernels)


class Throughput:
    """Tokens per second of whole training steps (their own time, not eval or saving), and
    the wall-clock rate the ETA is computed from.

    The first ``WARMUP_STEPS`` steps of a process are left out: they pay for allocations
    and first-call setup that the rest of the run does not.
    """

    def __init__(self, warmup: int = WARMUP_STEPS):
        self._skip = warmup
        self._window = [0, 0.0]  # tokens, seconds since the last window_rate()
        self.tokens, self.seconds = 0, 0.0  # whole run (of this process)
        self._wall_start: float | None = None  # when the first measured step began

    def add(self, tokens: int, seconds: float) -> None:
        if self._skip > 0:
            self._skip -= 1
            return
        if self._wall_start is None:  # wall clock from the start of this step on
            self._wall_start = time.perf_counter() - seconds
        self._window[0] += tokens
        self._window[1] += seconds
        self.tokens += tokens
        self.seconds += seconds

    def window_rate(self) -> float | None:
        """Tokens/s since the previous call (None when no measured step), then reset."""
        tokens, seconds = self._window
        self._window = [0, 0.0]
        return tokens / seconds if seconds > 0 else None

    @property
    def overall_rate(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None

    def remaining_seconds(self, tokens_left: int) -> float | None:
        """Seconds to train ``tokens_left`` more tokens at the wall-clock rate of the steps
        measured so far (after warm-up), the evaluations, samples and saves between them
        included: an ETA that the rest of the run can keep. None before a measured step."""
        if self._wall_start is None or self.tokens <= 0:
            return None
        wall = time.perf_counter() - self._wall_start
        return max(0, tokens_left) * wall / self.tokens


def remaining_seconds(run: Run, progress: Progress, throughput: Throughput) -> float | None:
    """The ETA of ``run``: its tokens still to train (the curriculum's, so longer stages
    ahead count for what they are) at :meth:`Throughput.remaining_seconds`' rate."""
    total = run.curriculum.total_tokens() * run.ctx.world_size
    return throughput.remaining_seconds(total - progress.tokens)


def has_core(run: Run) -> bool:
    """Whether ``run``'s model steps through a feedback core (the feedback kinds)."""
    return hasattr(run.raw_model, "core_params")


def device_text(run: Run) -> str:
    """``cpu (2 threads, fp32, C++ core)`` or ``cuda:0 (NVIDIA H200, bf16 autocast, fused
    core (Triton))``: where, at what precision, and (feedback kinds) which core runs, as
    $FBTRAIN_CORE chose it (an interpreter, far slower, must not look like the C++ core)."""
    dtype = {None: "fp32", torch.bfloat16: "bf16 autocast",
             torch.float16: "fp16 autocast"}[run.amp_dtype]
    if has_core(run):
        dtype += f", {core_label(core())}"
    device = run.ctx.device
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)}, {dtype})"
    threads = torch.get_num_threads()
    return f"cpu ({threads} thread{'s' if threads != 1 else ''}, {dtype})"


def announcement(run: Run, progress: Progress, resume_path: Path | None,
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
    idle = idle_graphs_note(run.ctx.device, has_core(run))
    if idle:
        lines.append(idle)
    labelled = " (targets only where labelled; accuracy reported)" if data.labelled else ""
    lines.append(f"data: {data.n_tokens[0]:,} train / {data.n_tokens[1]:,} val "
                 f"{data.tokenizer.unit}s{labelled}, vocabulary {data.tokenizer.vocab_size}")
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


def step_metrics(run: Run, result: StepResult, tokens: int, rate: float | None
                 ) -> dict[str, Any]:
    """A step's metrics record (the loss of this step, not an average: exact under resume);
    ``tokens`` trained so far, ``rate`` tokens/s since the last record."""
    metrics: dict[str, Any] = {
        "loss": result.loss, "bpc": result.loss / LN2, "lr": result.lr,
        "grad_norm": result.grad_norm, "tokens_per_sec": rate, "seq_len": result.seq_len,
        "batch_size": result.batch_size, "tokens": tokens,
        # Bounded when the memory recursion is stable; growing without end, it is not.
        "memory_rms": result.memory_rms.item(),
    }
    if result.accuracy is not None:
        metrics["accuracy"] = result.accuracy
    model, device = run.raw_model, run.ctx.device
    if model_kind(run.cfg.model.kind).memory_mix:
        with torch.no_grad():
            weights = model.memory_weights().float().tolist()
        metrics.update({f"mem_weight/{i}": w for i, w in enumerate(weights)})
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


def summary(run: Run, progress: Progress, rate: float | None, seconds: float) -> str:
    """The last lines: where training stopped, its losses, its speed and its wall time,
    ``|``-separated and wrapped between parts into lines of at most 80 columns
    (:func:`~fbtrain.metrics.console.fit_parts`).

    ``rate`` and ``seconds`` are this process's. A run resumed (its clock counts earlier
    segments) gives the run's totals, its tokens and training time over all segments, and
    this segment's rate and time labelled as such."""
    parts = [f"done at step {progress.step}"]
    if progress.val_loss is not None:
        parts.append(f"val loss {progress.val_loss:.4f} (bpc {progress.val_loss / LN2:.4f}, "
                     f"{len(run.data.val_x)} fixed windows)")
    if progress.best_val_loss is not None:
        parts.append(f"best {progress.best_val_loss:.4f}")
    clock = run.clock
    if clock.resumed:
        segments = clock.segments + 1
        parts.append(f"run: {progress.tokens:,} tokens, "
                     f"{format_duration(clock.seconds + seconds)} training in {segments} "
                     "segments")
        speed = f"{rate:,.0f} tokens/s on {device_text(run)}, " if rate is not None else ""
        parts.append(f"this segment: {speed}{format_duration(seconds)}")
        return "\n".join(fit_parts(parts))
    if rate is not None:
        parts.append(f"{rate:,.0f} tokens/s on {device_text(run)}")
    parts.append(f"wall {format_duration(seconds)}")
    return "\n".join(fit_parts(parts))


def finished_lines(run_dir: Path, path: Path, payload: dict[str, Any], max_steps: int
                   ) -> tuple[str, str]:
    """What a run that has nothing left to train says instead of training: that it is done
    and what to do next, then its closing line from the checkpoint ``payload`` (read from
    ``path``): step, losses, and the run's tokens and training time (its ``clock``)."""
    step, progress = payload["step"], payload["progress"]
    done = (f"{run_dir} is already trained: {path.name} is at step {step} and "
            f"train.max_steps is {max_steps}, so there is nothing to train (to train on: "
            f"--set train.max_steps=N, more than {step}; to try it: fbtrain sample "
            f"--checkpoint {run_dir})")
    parts = [f"done at step {step}"]
    if is_number(progress.get("val_loss")):
        parts.append(f"val loss {progress['val_loss']:.4f} (bpc {progress['val_loss'] / LN2:.4f})")
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
