"""Whole-step CUDA graphs (off by default; ``FBTRAIN_CUDA_GRAPHS=1`` turns them on).

Why: on a GPU a training step of the feedback core is thousands of tiny kernels, and the
host's cost of launching each, not the arithmetic, is the step's cost whatever the GPU.
Captured whole - forward, loss, backward, clipping, AdamW - a step is a handful of host
launches: the learning rate filled into its device tensor, the batch copied into the
graph's static input buffers, one replay, and the step's one read of its figures
(scripts/gpu_check.py profiles the host's launch calls on a GPU).

How (PyTorch's "whole network capture"): one graph per shape of the batch. The first step
of a shape runs eagerly on the capture stream (the real step, and the warm-up a capture
needs), then the same function is captured with static input buffers; the later steps of
that shape copy their batch in and replay. That function is the eager step's own body
(:func:`fbtrain.train.step.step_body`) followed by the update: the learning rate is a
device tensor (AdamW reads it there: fused AdamW takes a tensor ``lr``), and nothing reads
a tensor on the host. The non-finite check still stops training before the update: the
graph gates AdamW's step on the device (``found_inf``: no update, step count kept) on the
same test the host makes afterwards (:func:`~fbtrain.train.step.check_finite`), so a step
the host refuses left the weights as they were. Dropout masks come from the default CUDA
generator, which a capture registers: each replay advances it as the eager step did.

What changes, and is said once when it starts: CUDA reads a tensor learning rate as float32
(eager passes the Python float as a double), so the weights can differ from an eager run's
in the last bits; a float32-exact rate (a power of two, say) gives the eager numbers bit for
bit (``tests/test_step_graph.py``, on a CPU stand-in of the graph). Every step of this mode
takes the rate that way, the first of each shape included, so a resumed run continues
bitwise.

Where a step cannot be captured, one line says why and it runs eagerly: not CUDA,
torch.distributed (DDP's all-reduces run beside the backward), ``train.grad_accum`` > 1,
fp16 loss scaling (the scaler decides on the host), carried memory (``train.context:
carry``: the memory's shape and step count change between segments), a core that syncs
with the host (the PyTorch core), an optimizer that is not fused AdamW. A capture that
fails says so and runs the step eagerly from then on.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from fbtrain.errors import UserError
from fbtrain.messages import first_line
from fbtrain.models.core.native import NativeCore
from fbtrain.models.core.select import core
from fbtrain.train.setup import RunParts
from fbtrain.train.step import MicroBatch, StepResult, step_body, train_step

GRAPHS_ENV = "FBTRAIN_CUDA_GRAPHS"
GRAPHS_ON = ("1", "true", "yes", "on")
GRAPHS_OFF = ("", "0", "false", "no", "off")  # unset or empty: off, the default
GRAPHS_NOTICE = (
    f"fbtrain: {GRAPHS_ENV} is set: each training step replays one CUDA graph per shape "
    "(the first step of a shape runs eagerly, then is captured); the learning rate is a "
    "float32 device tensor there, so the weights can differ from an eager run's in the "
    "last bits")

TrainStep = Callable[..., StepResult]  # train_step's signature: (run, index, signals, last)


def graphs_requested() -> bool:
    """Whether ``$FBTRAIN_CUDA_GRAPHS`` asks for whole-step CUDA graphs. Any value but
    those of :data:`GRAPHS_ON` and :data:`GRAPHS_OFF` is a UserError (one line, exit 2): a
    typo must not silently train without the graphs that were asked for."""
    raw = os.environ.get(GRAPHS_ENV, "")
    value = raw.strip().lower()
    if value in GRAPHS_ON + GRAPHS_OFF:
        return value in GRAPHS_ON
    raise UserError(f"{GRAPHS_ENV}={raw!r} is not a setting; use one of "
                    f"{', '.join(v for v in GRAPHS_ON + GRAPHS_OFF if v)} (or leave it unset)")


def step_graph_problem(run: RunParts) -> str:
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


def step_function(run: RunParts) -> TrainStep:
    """:func:`~fbtrain.train.step.train_step`, through whole-step graphs where
    ``$FBTRAIN_CUDA_GRAPHS`` asks and ``run`` allows (one notice line either way)."""
    if not graphs_requested():
        return train_step
    why = step_graph_problem(run)
    if why:
        print(f"fbtrain: {GRAPHS_ENV} is set, but {why}; the step runs eagerly",
              file=sys.stderr, flush=True)
        return train_step
    print(GRAPHS_NOTICE, file=sys.stderr, flush=True)
    return functools.partial(train_step, graphs=StepGraphs(run))


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
            # torch leaves its capture stream current when a capture fails: the caller's
            # stream back, what was queued finished, and the generator where an uncaptured
            # run would have it (the eager fallback then draws the masks eager would).
            torch.cuda.set_stream(caller)
            torch.cuda.synchronize(device)
            torch.cuda.set_rng_state(rng, device)
            raise

    def replay(self) -> None:
        self.graph.replay()


class StepGraphs:
    """The training step of ``run`` (:func:`~fbtrain.train.step.step_body`, then AdamW's
    update) as one CUDA graph per batch shape (module docstring); ``train_step`` calls it
    as its ``graphs`` with each step's micro-batch and learning rate.

    On a new shape it runs the step eagerly and captures it (the previous shape's graph is
    dropped: the curriculum only lengthens, and each graph holds a pool of the step's
    activations). A graph is baked to the tensors it was captured on: the parameters, their
    gradients and AdamW's state. Replacing any of them in place of a shape's graph (loading
    an optimizer state, moving the model) would leave the graph updating the old ones, so
    the trainer does all of that before its first step.
    """

    def __init__(self, run: RunParts):
        self.run, self.device = run, run.ctx.device
        # float32: CUDA's fused AdamW reads a tensor rate as float (module docstring).
        self.lr = torch.zeros((), dtype=torch.float32, device=self.device)
        self.graph: _StepGraph | None = None
        self.key: tuple | None = None
        self.static: list[Tensor] = []
        self.failed = False  # a capture failed: every step runs eagerly from then on
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def __call__(self, micro_batches: list[MicroBatch], lr: float) -> Tensor:
        """Train one step on ``micro_batches`` (one, without memory: step_graph_problem)
        at rate ``lr``; the step's figures, as :func:`~fbtrain.train.step.step_body`'s."""
        ((x, y, _),) = micro_batches
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
                return self.graph.out
            return self._first(x, y, key)

    def _first(self, x: Tensor, y: Tensor, key: tuple) -> Tensor:
        """The first step of a shape: run eagerly on the capture stream, then captured."""
        self.graph = self.key = None  # the previous shape's graph (and its pool) goes
        with self._on_stream():
            stats = self._step(x, y, capturing=False)
        if self.failed:
            return stats
        self.static = [x.clone(), y.clone()]
        try:
            self.graph = _StepGraph(lambda: self._step(*self.static, capturing=True),
                                    self.device, self.stream)
            self.key = key
        except (RuntimeError, UserWarning) as e:
            self.failed, self.graph = True, None
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

    def _step(self, x: Tensor, y: Tensor, capturing: bool) -> Tensor:
        """What is captured: the eager step's body on ``x``, ``y``, then the update, skipped
        on the device where the loss or gradient norm is not finite (the host's test)."""
        stats = step_body(self.run, [(x, y, None)])
        finite = torch.isfinite(stats[0]) & torch.isfinite(stats[1])
        self._update((~finite).float(), capturing)
        return stats

    def _update(self, found_inf: Tensor, capturing: bool) -> None:
        """AdamW's step at the device rate ``self.lr``, skipped where ``found_inf`` is 1.
        The groups keep their float rates and flags outside the step (a checkpoint saves
        them); ``capturable`` only while capturing (PyTorch checks it there, and warns
        about it outside)."""
        optimizer = self.run.optimizer
        groups = optimizer.param_groups
        saved = [(g["lr"], g["capturable"]) for g in groups]
        for g in groups:
            g["lr"] = self.lr
            g["capturable"] = capturing
        optimizer.found_inf = found_inf  # what GradScaler hands a fused optimizer
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
            for g, (lr, capturable) in zip(groups, saved, strict=True):
                g["lr"], g["capturable"] = lr, capturable
