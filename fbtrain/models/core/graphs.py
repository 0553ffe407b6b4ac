"""CUDA graphs for the core's sweeps (off by default; ``FBTRAIN_CUDA_GRAPHS=1`` turns them on;
``FBTRAIN_CUDA_GRAPHS=step`` captures the whole training step instead, see
:mod:`fbtrain.train.step_graph`, and falls back to these where it cannot).

Why: on a GPU a training step of the core is thousands of tiny kernels, and the host's cost
of launching each (a few microseconds) is the step's cost whatever the GPU. A CUDA graph
records the kernels of one call once and replays them in one launch. The core can be
captured because its ATen path makes no host syncs (``tests/test_launches.py`` holds it to
that) and every shape in it follows from the input shapes.

How: :class:`GraphedCore` wraps a :class:`~fbtrain.models.core.spec.Core`. The first call
of ``core_forward`` / ``core_backward`` with a given spec and input shapes warms up on a
side stream, then captures the call into a graph with static input buffers (the generator's
state is restored around the warm-up, so dropout draws what eager would); each call copies
its inputs into those buffers and replays. The outputs are cloned out of the graph's
buffers, because a later replay (the next chunk's forward before this one's backward)
overwrites them. Dropout masks come from the default CUDA generator, which graph capture
registers (philox offsets advance per replay as eager calls would advance them), so graphed
and eager calls agree bitwise in fp32. Where a capture fails, one notice line says so and
the core runs eagerly from then on (a failed capture can leave the allocator's capture
state behind it, so no other shape is tried).

Only the C++ core and the fused core (``capturable``) are captured (the PyTorch core reads
the memory weights on the host), and not under torch.distributed (DDP's gradient all-reduces
run alongside the backward's capture, which graph capture's global mode forbids); each says
so once and runs eagerly. Inside a whole-step capture (:func:`suspended`) the core is not
captured again: a capture cannot nest, and the step's graph already holds the core's kernels.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from fbtrain.messages import first_line
from fbtrain.models.core.native import NativeCore
from fbtrain.models.core.spec import (
    BackwardInputs,
    Core,
    CoreError,
    CoreInputs,
    CoreOutputs,
    CoreSpec,
)

GRAPHS_ENV = "FBTRAIN_CUDA_GRAPHS"
STEP_VALUE = "step"  # $FBTRAIN_CUDA_GRAPHS asking for whole-step graphs (train/step_graph.py)
WARMUP_CALLS = 2  # eager calls on the side stream before capture (allocator, cuBLAS handles)


GRAPHS_ON = ("1", "true", "yes", "on")  # the core's sweeps graphed
GRAPHS_OFF = ("", "0", "false", "no", "off")  # unset or empty: off, the default


def graphs_choice() -> str:
    """``$FBTRAIN_CUDA_GRAPHS``, checked: ``off``, ``on`` (the core's sweeps) or ``step``
    (the whole step). Any other value is a CoreError (one line, exit 2): a typo must not
    silently train without the graphs that were asked for."""
    raw = os.environ.get(GRAPHS_ENV, "")
    value = raw.strip().lower()
    if value in GRAPHS_OFF:
        return "off"
    if value in GRAPHS_ON:
        return "on"
    if value == STEP_VALUE:
        return STEP_VALUE
    raise CoreError(f"{GRAPHS_ENV}={raw!r} is not a setting; use one of "
                    f"{', '.join(v for v in GRAPHS_ON + GRAPHS_OFF if v)} or {STEP_VALUE} "
                    "(or leave it unset)")


def graphs_requested() -> bool:
    """Whether ``$FBTRAIN_CUDA_GRAPHS`` asks for CUDA graphs (``1``, ``true``, ``yes``, or
    ``step``: where a whole step cannot be captured, its core still is)."""
    return graphs_choice() != "off"


def step_graphs_requested() -> bool:
    """Whether ``$FBTRAIN_CUDA_GRAPHS`` is ``step``: one CUDA graph per shape for the whole
    training step (:mod:`fbtrain.train.step_graph`)."""
    return graphs_choice() == STEP_VALUE


def idle_graphs_note(device: torch.device, has_core: bool) -> str | None:
    """The line that says ``$FBTRAIN_CUDA_GRAPHS=1`` does nothing for this run (on a CPU, or
    for a model without a feedback core), or None. (``step`` says so itself, with why, in
    :func:`fbtrain.train.step_graph.step_function`.)"""
    if graphs_choice() != "on":
        return None
    raw = os.environ.get(GRAPHS_ENV, "").strip()
    if device.type != "cuda":
        return (f"{GRAPHS_ENV}={raw} does nothing here: CUDA graphs need a CUDA "
                f"device, and this run is on {device.type}")
    if not has_core:
        return (f"{GRAPHS_ENV}={raw} does nothing here: it graphs the feedback core, "
                "and this model has none")
    return None


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """While the block runs, :func:`maybe_graphed` hands out the plain core: the whole step
    is being run or captured as one graph, and a CUDA graph capture cannot nest."""
    global _suspended
    before, _suspended = _suspended, True
    try:
        yield
    finally:
        _suspended = before


def _signature(tensors: Sequence[Any]) -> tuple:
    """Shapes, dtypes and devices of ``tensors`` (None and lists kept apart), a cache key."""
    out = []
    for t in tensors:
        if t is None:
            out.append(None)
        elif isinstance(t, Tensor):
            out.append((tuple(t.shape), t.dtype, str(t.device)))
        else:
            out.append(_signature(t))
    return tuple(out)


class _Graph:
    """One captured call: its static inputs, the graph and its static outputs."""

    def __init__(self, fn: Callable[[list[Tensor | None]], Any], args: list[Tensor | None]):
        self.device = next(a.device for a in args if a is not None)
        # Everything on the tensors' device, which need not be the current one (a run on
        # cuda:1 without DDP never sets it): torch's default capture stream belongs to the
        # device current when it was made, and a capture on one device's stream records
        # nothing of another's kernels.
        with torch.cuda.device(self.device):
            self._capture(fn, args)

    def _capture(self, fn: Callable[[list[Tensor | None]], Any],
                 args: list[Tensor | None]) -> None:
        device = self.device
        self.static = [None if a is None else a.clone() for a in args]
        caller = torch.cuda.current_stream(device)
        rng = torch.cuda.get_rng_state(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(caller)
        with torch.cuda.stream(side):
            for _ in range(WARMUP_CALLS):
                fn(self.static)
        caller.wait_stream(side)
        torch.cuda.set_rng_state(rng, device)  # the warm-up's draws are not the caller's
        self.graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(self.graph, stream=side):
                self.out = fn(self.static)
        except BaseException:
            # torch leaves its capture stream current when a capture fails: give the caller
            # its stream back and let what was queued finish. Nor may a failed capture move
            # the generator: the eager fallback then draws the dropout masks an uncaptured
            # run would.
            torch.cuda.set_stream(caller)
            torch.cuda.synchronize(device)
            torch.cuda.set_rng_state(rng, device)
            raise

    def __call__(self, args: list[Tensor | None]) -> Any:
        """Copy ``args`` into the static inputs and replay; the static outputs."""
        with torch.cuda.device(self.device):
            for s, a in zip(self.static, args, strict=True):
                if s is not None:
                    s.copy_(a)
            self.graph.replay()
        return self.out


class GraphedCore:
    """A :class:`Core` whose calls on CUDA tensors replay CUDA graphs, one per spec and
    input shapes (see the module docstring). Calls on other devices go to ``inner``."""

    def __init__(self, inner: Core):
        self.inner = inner
        self.graphs: dict[tuple, _Graph] = {}

    def _run(self, key: tuple, fn: Callable[[list[Tensor | None]], Any],
             args: list[Tensor | None]) -> Any:
        """``fn(args)`` through the graph for ``key`` (captured on first use), or eagerly
        once a capture has failed (one notice line when it does)."""
        global _capture_failed
        if _capture_failed:
            return fn(args)
        if key not in self.graphs:
            try:
                with warnings.catch_warnings():
                    # An empty capture would replay nothing: a failure, not a warning.
                    warnings.filterwarnings("error", message=".*CUDA Graph is empty.*")
                    self.graphs[key] = _Graph(fn, args)
            except (RuntimeError, UserWarning) as e:
                _capture_failed = True
                print(f"fbtrain: CUDA graph capture of the core failed ({first_line(e)}); running "
                      "it eagerly from now on", file=sys.stderr, flush=True)
                return fn(args)
        return self.graphs[key](args)

    def core_forward(self, spec: CoreSpec, inputs: CoreInputs,
                     keep_tape: bool = False) -> CoreOutputs:
        """``Core.core_forward``, graphed; the outputs are clones (see the module docstring)."""
        flat = list(inputs.flat())

        def forward(args: list[Tensor | None]) -> CoreOutputs:
            return self.inner.core_forward(spec, CoreInputs.from_flat(args), keep_tape)

        out = self._run(("forward", spec, keep_tape, _signature(flat)), forward, flat)
        return CoreOutputs(*(t.clone() for t in out[:4]), [t.clone() for t in out.tape])

    def core_backward(self, spec: CoreSpec, d_top: Tensor, outputs: CoreOutputs, mix: Tensor,
                      wkv: Tensor, layers: Sequence[Tensor]) -> CoreInputs:
        """``Core.core_backward``, graphed; the gradients are the graph's own buffers (the
        autograd Function clones them)."""
        n_tape = len(outputs.tape)
        flat = list(BackwardInputs(d_top, outputs, mix, wkv, layers).flat())

        def backward(args: list[Tensor | None]) -> CoreInputs:
            return self.inner.core_backward(spec, *BackwardInputs.from_flat(args, n_tape))

        return self._run(("backward", spec, _signature(flat)), backward, flat)


_graphed: dict[int, GraphedCore] = {}
_said: set[str] = set()  # notices printed (once per process each)
# A capture failed in this process: every call runs eagerly from then on, whatever
# release() forgets (torch can leave a failed capture's allocator state behind).
_capture_failed = False
_suspended = False  # inside a whole-step graph's run or capture (suspended())


def _eager_because(why: str) -> None:
    """The notice that graphs were asked for but the core runs eagerly, once per ``why``."""
    if why not in _said:
        _said.add(why)
        print(f"fbtrain: {GRAPHS_ENV} is set, but {why}; running the core eagerly",
              file=sys.stderr, flush=True)


def maybe_graphed(core: Core, like: Tensor) -> Core:
    """``core`` itself unless ``$FBTRAIN_CUDA_GRAPHS`` is on and ``like`` is a CUDA tensor;
    then its :class:`GraphedCore` (one per core, so graphs are captured once per process).
    Only the C++ core and cores marked ``capturable`` are captured, and not under
    torch.distributed (module docstring), nor inside a whole-step graph (:func:`suspended`)."""
    if _suspended or not (like.is_cuda and graphs_requested()):
        return core
    if core is not NativeCore and not getattr(core, "capturable", False):
        _eager_because("CUDA graphs need the C++ core (the PyTorch core syncs with the host)")
        return core
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        _eager_because("CUDA graphs are not used under torch.distributed")
        return core
    if id(core) not in _graphed:
        _graphed[id(core)] = GraphedCore(core)
    return _graphed[id(core)]


def release() -> None:
    """Forget every captured graph (and let the allocator hand their memory back): each
    shape's graphs hold their own pools, about three times the shape's tape. A failed
    capture is not forgotten."""
    _graphed.clear()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def note_capture_failed() -> None:
    """A capture outside this module (a whole step's) failed: the core's graphs are not
    tried after it either (it can leave the allocator's capture state behind it)."""
    global _capture_failed
    _capture_failed = True


def capture_status() -> dict[str, int | bool]:
    """Graphs captured so far in this process, and whether a capture failed."""
    return {"captured": sum(len(g.graphs) for g in _graphed.values()),
            "failed": _capture_failed}
