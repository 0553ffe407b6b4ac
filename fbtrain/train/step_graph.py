"""Whole-step CUDA graphs (off by default; ``FBTRAIN_CUDA_GRAPHS=step`` turns them on).

Why: with the core alone graphed (``FBTRAIN_CUDA_GRAPHS=1``) the host still queues every
kernel of the rest of the step - embedding, head, loss, their backward, gradient clipping,
AdamW - and copies every core input, weights included, into the core graphs' static
buffers: ~590 launches a step at the main job's sizes. Captured whole, a step is a handful:
the learning rate filled into its device tensor, the batch copied into the graph's static
input buffers, one replay, and one read of the step's figures (``scripts/launch_count.py
--step-graph`` counts them).

How (PyTorch's "whole network capture"): one graph per shape of the batch. The first step
of a shape runs eagerly on the capture stream (the real step, and the warm-up a capture
needs), then the same step function is captured with static input buffers; the later steps
of that shape copy their batch in and replay. Inside the step the learning rate is a device
tensor (AdamW reads it there: fused AdamW takes a tensor ``lr``), the core runs without its
own graphs (:func:`fbtrain.models.core.graphs.suspended`), and nothing reads a tensor on
the host. The non-finite check still stops training before the update: the graph gates
AdamW's step on the device (``found_inf``: no update, step count kept) on the same test the
host makes afterwards, so a step the host refuses left the weights as they were.
Dropout masks come from the default CUDA generator, which a capture registers: each replay
advances it as the eager step did.

What changes, and is said once when it starts: CUDA reads a tensor learning rate as float32
(eager passes the Python float as a double), so the weights can differ from an eager run's
in the last bits; a float32-exact rate (a power of two, say) gives the eager numbers bit for
bit (``tests/test_step_graph.py``, on a CPU stand-in of the graph). Every step of this mode
takes the rate that way, the first of each shape included, so a resumed run continues
bitwise.

Where a step cannot be captured, one line says why and it runs eagerly (the core's own
graphs where they apply): not CUDA, torch.distributed (DDP's all-reduces run beside the
backward), ``train.grad_accum`` > 1, fp16 loss scaling (the scaler decides on the host),
carried memory (``train.context: carry``: the memory's shape and step count change between
segments), a core that syncs with the host (the PyTorch core), an optimizer that is not
fused AdamW. A capture that fails says so and runs the step eagerly from then on (and no
core graph is captured after it).
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor, nn

from fbtrain.distributed import DistContext
from fbtrain.messages import first_line
from fbtrain.models.core import graphs
from fbtrain.models.core.native import NativeCore
from fbtrain.models.core.select import core
from fbtrain.scoring import count_scored, score_sums
from fbtrain.train.setup import Run
from fbtrain.train.signals import StopSignals
from fbtrain.train.step import StepResult, check_finite, loss_denominator, train_step

HOST_SYNC = "fbtrain::host_sync"  # profiler mark of the step's one read on the host
STEP_MODE_NOTICE = (
    f"fbtrain: {graphs.GRAPHS_ENV}={graphs.STEP_VALUE}: each training step replays one CUDA "
    "graph per shape (the first step of a shape runs eagerly, then is captured); the "
    "learning rate is a float32 device tensor there, so the weights can differ from an "
    "eager run's in the last bits")

TrainStep = Callable[..., StepResult]  # train_step's signature: (run, index, signals, last)


class Figures(NamedTuple):
    """A step's figures, read on the host once the step ran."""

    loss: float
    grad_norm: float  # before clipping
    accuracy: float
    memory_rms: Tensor  # 0-dim float32 on the CPU (StepResult.memory_rms)
    scored: int  # scored targets of the step


def step_graph_problem(run: Run) -> str:
    """Why ``run``'s steps cannot be captured whole ('' when they can); the module
    docstring says why each one is refused."""
    cfg = run.cfg
    if run.ctx.device.type != "cuda":
        return f"the device is {run.ctx.device.type}, not CUDA"
    if run.ctx.enabled:
        return "DDP's gradient all-reduces cannot be captured with the step"
    if cfg.train.grad_accum != 1:
        return f"train.grad_accum is {cfg.train.grad_accum} (only 1 is captured)"
    if run.scaler.is_enabled():
        return "fp16 loss scaling decides on the host whether to step (use bf16 or fp32)"
    if cfg.train.context != "reset":
        return f"train.context {cfg.train.context}'s memory changes shape between segments"
    chosen = core() if hasattr(run.raw_model, "core_params") else None  # a feedback kind's
    if chosen not in (None, NativeCore):
        return "the PyTorch core syncs with the host (it needs the C++ core)"
    if not all(group.get("fused") for group in run.optimizer.param_groups):
        return "the optimizer is not fused AdamW (it must read the learning rate on the device)"
    return ""


def step_function(run: Run) -> TrainStep:
    """:func:`~fbtrain.train.step.train_step`, or its whole-step-graphed twin where
    ``$FBTRAIN_CUDA_GRAPHS=step`` asks and ``run`` allows (one notice line either way)."""
    if not graphs.step_graphs_requested():
        return train_step
    why = step_graph_problem(run)
    if why:
        print(f"fbtrain: {graphs.GRAPHS_ENV}={graphs.STEP_VALUE} is set, but {why}; the step "
              "runs eagerly (its core graphed where it can be)", file=sys.stderr, flush=True)
        return train_step
    print(STEP_MODE_NOTICE, file=sys.stderr, flush=True)
    clip = run.cfg.train.grad_clip if run.cfg.train.grad_clip > 0 else math.inf
    step_graphs = StepGraphs(run.model, run.optimizer, run.params, clip, run.amp_dtype,
                             run.ctx)

    def graphed(run: Run, index: int, signals: StopSignals, last: Path) -> StepResult:
        return graphed_train_step(run, step_graphs, index, signals, last)

    return graphed


def graphed_train_step(run: Run, step_graphs: StepGraphs, index: int, signals: StopSignals,
                       last: Path) -> StepResult:
    """:func:`~fbtrain.train.step.train_step` through ``step_graphs``: the same figures,
    stop rules and result, one micro-batch and no loss scaling (:func:`step_graph_problem`)."""
    seq_len, batch = run.curriculum.seq_len_at(index), run.curriculum.batch_size_at(index)
    start = time.perf_counter()
    lr = run.schedule.apply(run.optimizer, index)  # the groups' floats: what a checkpoint saves
    ((x, y, _),) = run.batches.micro_batches(seq_len, batch, run.ctx.device)
    figures = step_graphs.step(x, y, lr)
    # The update already ran in the graph, gated on this same test (module docstring).
    check_finite(run, index + 1, figures.loss, figures.grad_norm, last)
    loss, norm, accuracy = figures.loss, figures.grad_norm, figures.accuracy
    if run.data.labelled and not figures.scored:
        loss = norm = accuracy = math.nan  # as train_step logs a step with nothing scored
    return StepResult(loss, norm, lr, seq_len, batch, x.numel(), signals.received,
                      figures.memory_rms, time.perf_counter() - start,
                      accuracy if run.data.labelled else None)


class _StepGraph:
    """One captured step: ``body()`` recorded into a CUDA graph on ``stream``; ``out`` its
    static output, rewritten by each :meth:`replay`."""

    def __init__(self, body: Callable[[], Tensor], device: torch.device,
                 stream: torch.cuda.Stream):
        self.graph = torch.cuda.CUDAGraph()
        rng = torch.cuda.get_rng_state(device)
        caller = torch.cuda.current_stream(device)
        try:
            with warnings.catch_warnings():
                # An empty capture would replay nothing: a failure, not a warning.
                warnings.filterwarnings("error", message=".*CUDA Graph is empty.*")
                with torch.cuda.graph(self.graph, stream=stream):
                    self.out = body()
        except BaseException:
            # As graphs._Graph: the caller's stream back, what was queued finished, and the
            # generator where an uncaptured run would have it.
            torch.cuda.set_stream(caller)
            torch.cuda.synchronize(device)
            torch.cuda.set_rng_state(rng, device)
            raise

    def replay(self) -> None:
        self.graph.replay()


class StepGraphs:
    """The training step of ``model`` (forward, loss, backward, clipping at ``clip``, the
    ``optimizer`` step) as one CUDA graph per batch shape (module docstring).

    :meth:`step` is called with each step's batch and learning rate; on a new shape it runs
    the step eagerly and captures it (the previous shape's graph is dropped: the curriculum
    only lengthens, and each graph holds a pool of the step's activations).

    A graph is baked to the tensors it was captured on: the parameters, their gradients
    and AdamW's state. Replacing any of them in place of a shape's graph (loading an
    optimizer state, moving the model) would leave the graph updating the old ones, so
    the trainer does all of that before its first step. Evaluation's core calls still use
    the core's own graphs (``FBTRAIN_CUDA_GRAPHS=step`` asks for those too).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 params: list[nn.Parameter], clip: float, amp_dtype: torch.dtype | None,
                 ctx: DistContext):
        self.model, self.optimizer, self.params, self.clip = model, optimizer, params, clip
        self.amp_dtype, self.ctx, self.device = amp_dtype, ctx, ctx.device
        # float32: CUDA's fused AdamW reads a tensor rate as float (module docstring).
        self.lr = torch.zeros((), dtype=torch.float32, device=self.device)
        self.graph: _StepGraph | None = None
        self.key: tuple | None = None
        self.static: list[Tensor] = []
        self.failed = False  # a capture failed: every step runs eagerly from then on
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def step(self, x: Tensor, y: Tensor, lr: float) -> Figures:
        """Train one step on inputs ``x`` and targets ``y`` ``[batch, T]`` at rate ``lr``."""
        # On the run's device, which need not be the current one (a run on cuda:1 without
        # DDP never sets it): a replay is queued on the current device's stream, and
        # capture and AdamW's capture check read that device's stream too.
        with torch.cuda.device(self.device) if self.stream is not None else \
                contextlib.nullcontext():
            self.lr.fill_(lr)
            key = (tuple(x.shape), tuple(y.shape), x.dtype, y.dtype)
            if self.graph is not None and key == self.key:
                for static, given in zip(self.static, (x, y), strict=True):
                    static.copy_(given)
                self.graph.replay()
                return self._read(self.graph.out)
            return self._read(self._first(x, y, key))

    def _first(self, x: Tensor, y: Tensor, key: tuple) -> Tensor:
        """The first step of a shape: run eagerly on the capture stream, then captured."""
        self.graph = self.key = None  # the previous shape's graph (and its pool) goes
        with self._on_stream():
            stats = self._body(x, y, capturing=False)
        if self.failed:
            return stats
        self.static = [x.clone(), y.clone()]
        try:
            self.graph = _StepGraph(lambda: self._body(*self.static, capturing=True),
                                    self.device, self.stream)
            self.key = key
        except (RuntimeError, UserWarning) as e:
            self.failed, self.graph = True, None
            graphs.note_capture_failed()
            print(f"fbtrain: CUDA graph capture of the training step failed ({first_line(e)});"
                  " running it eagerly from now on", file=sys.stderr, flush=True)
        return stats

    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        """The block on the capture stream, ordered after and before the caller's work
        (the warm-up a capture needs runs where the capture will)."""
        if self.stream is None:
            yield
            return
        caller = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(caller)
        with torch.cuda.stream(self.stream):
            yield
        caller.wait_stream(self.stream)

    def _body(self, x: Tensor, y: Tensor, capturing: bool) -> Tensor:
        """One step on the device, as train_step's with one micro-batch: ``[loss, grad norm,
        accuracy, memory RMS, scored]`` (float32). No host reads; the update is skipped on
        the device when the loss or gradient norm is not finite."""
        self.optimizer.zero_grad(set_to_none=True)  # captured: the backward makes the grads
        scored = count_scored(y)
        denominator = loss_denominator(self.ctx, scored)
        loss_sum = torch.zeros((), device=self.device)
        correct = torch.zeros((), dtype=torch.long, device=self.device)
        with graphs.suspended():  # the core's calls (and so its backward) ungraphed
            with self._autocast():
                logits, new_state = self.model(x, None)
            ce_sum, _, right = score_sums(logits, y)
            loss = ce_sum / denominator
            loss.backward()
        loss_sum += loss.detach()
        correct += right
        memory_rms = new_state.keys.detach().float().square().mean().sqrt()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        accuracy = correct.float() / denominator
        finite = torch.isfinite(loss_sum) & torch.isfinite(grad_norm)
        self._update((~finite).float(), capturing)
        return torch.stack([loss_sum.float(), grad_norm.float(), accuracy.float(),
                            memory_rms, scored.float()])

    def _autocast(self) -> contextlib.AbstractContextManager:
        """The run's autocast, without its cache of cast weights: cast copies cached during
        a capture would be the graph's, freed under it (PyTorch's CUDA graph notes). The
        casts give the same values either way."""
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype, cache_enabled=False)

    def _update(self, found_inf: Tensor, capturing: bool) -> None:
        """AdamW's step at the device rate ``self.lr``, skipped where ``found_inf`` is 1.
        The groups keep their float rates and flags outside the step (a checkpoint saves
        them); ``capturable`` only while capturing (PyTorch checks it there, and warns
        about it outside)."""
        groups = self.optimizer.param_groups
        saved = [(g["lr"], g["capturable"]) for g in groups]
        for g in groups:
            g["lr"] = self.lr
            g["capturable"] = capturing
        self.optimizer.found_inf = found_inf  # what GradScaler hands a fused optimizer
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.found_inf
            for g, (lr, capturable) in zip(groups, saved, strict=True):
                g["lr"], g["capturable"] = lr, capturable

    def _read(self, stats: Tensor) -> Figures:
        """The step's figures on the host: one device-to-host copy, the step's one sync."""
        with torch.profiler.record_function(HOST_SYNC):
            host = stats.to("cpu", copy=True)
        loss, norm, accuracy, _, scored = host.tolist()
        return Figures(loss, norm, accuracy, host[3], int(scored))
