"""Kernel launches and host syncs of one training step on the ATen path (the GPU's), counted
on the CPU with torch.profiler.

The C++ core runs its step loops as ATen calls on any device but the CPU; on the CPU it has
vectorised loops of its own, and ``FBTRAIN_CORE_ATEN=1`` (set here) forces the ATen calls
instead, so the calls a GPU would issue can be counted without one. One shard is used (the
GPU's: the CPU path splits the batch into one shard per thread).

What counts as a launch (a model, from the profiler's op tree): an ATen op that does work of
its own, i.e. one that is not a view or allocation (``NO_KERNEL``) and either calls no
launching op below it or is a matmul (which runs its own gemm whatever it calls first). A
GPU may run a few ops as two kernels, or one cuBLAS call as several; the order of magnitude
is what matters (CUDA's softmax backward, for one, multiplies its two inputs in a kernel
of its own first: one more a token-layer than counted here). Below a call that is one
kernel on CUDA but several ops on a CPU nothing is counted (``ONE_KERNEL``). Host syncs:
``aten::item`` / ``aten::_local_scalar_dense`` and device-to-host copies
(``aten::to``/``copy_`` calls to the CPU device are what a GPU would sync on;
on a CPU run they show as ``fbtrain::host_sync`` markers where the core reads a tensor on the
host, and as ``aten::item`` anywhere).

Sections: ``forward sweep`` and ``backward sweep`` (the core's step loops, marked in the
C++ by ``fbtrain::forward_sweep`` / ``fbtrain::backward_sweep``), ``core other`` (the rest
of the core's ops: set-up, recorded LayerNorms, the weight-gradient matmuls) and ``rest``
(embedding, logits, loss, autograd's copies, the optimizer step).

Whole-step graphs (``--step-graph``): with ``FBTRAIN_CUDA_GRAPHS=1``
(``fbtrain.train.step_graph.StepGraphs``, what the trainer's step runs through) one graph
per shape holds the whole step - forward, loss, backward, clipping, AdamW - and the host
queues the learning rate's fill, the batch's copies into the graph's inputs, one replay and
the step's one read of its figures. A CPU has no graphs, so the count runs StepGraphs itself
on a run set up as training does, with a stand-in for the captured step
(:class:`StepReplayStandIn`: the step under a ``fbtrain::graph_replay`` mark that counts one
host launch for every kernel below it), and counts a replayed step (the third: the first of
a shape runs eagerly and is captured). ``launches`` (what the GPU runs) and ``host
launches`` (what the host queues) differ there; eager, the two are the same. Not counted:
the sampler's one host-to-device copy of the batch (before the step, as eager), and what
``CUDAGraph.replay`` does inside (with dropout, two small fills of the generator's seed and
offset per replay).

    python scripts/launch_count.py                      # feedback_kv, B 16, T 64, D 128, L 4
    python scripts/launch_count.py --kind feedback --dropout 0.1 --json counts.json
    python scripts/launch_count.py --step-graph --tiny
    python scripts/launch_count.py --table              # both kinds, with and without dropout
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import random
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fbtrain.config import ModelConfig, TrainConfig  # noqa: E402
from fbtrain.models import build_model  # noqa: E402
from fbtrain.train.optim import build_optimizer  # noqa: E402

VOCAB = 65
SIZES = dict(d_model=128, n_heads=4, d_ff=512, n_layers=4, max_rel_pos=4096)
# Ops that launch no kernel: views, allocations, metadata.
NO_KERNEL = frozenset(f"aten::{n}" for n in (
    "as_strided", "view", "reshape", "_reshape_alias", "_unsafe_view", "resolve_conj",
    "resolve_neg", "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided",
    "select", "narrow", "slice", "transpose", "t", "permute", "expand", "expand_as",
    "unsqueeze", "squeeze", "alias", "detach", "detach_", "lift_fresh", "contiguous",
    "unbind", "split", "chunk", "view_as", "flatten", "unflatten", "diagonal", "movedim",
    "numpy_T", "set_", "resize_", "_has_compatible_shallow_copy_type", "result_type",
    "is_nonzero", "item", "size", "stride", "to", "_to_copy", "clone", "linear", "matmul",
    "layer_norm", "dropout", "zeros", "zeros_like", "ones", "ones_like", "einsum",
    "cross_entropy_loss", "log_softmax", "softmax", "embedding", "index_select_backward",
))
# Matmuls run their own gemm even where they first copy (a bias into the output, say).
OWN_KERNEL = frozenset(f"aten::{n}" for n in (
    "mm", "bmm", "addmm", "addmm_", "baddbmm", "baddbmm_", "addbmm", "addmv", "mv", "dot",
    "_addmm_activation"))
# Calls that are one kernel on CUDA (aten/src/ATen/native/cuda/Blas.cpp) but several ops on
# a CPU, whose ops below them are not counted:
# - an in-place batched matmul into a strided output (the core's key/value window
#   gradients): a CPU runs one small matmul per batch entry; CUDA's baddbmm_out_cuda_impl
#   one strided-batched gemm where each matrix has a unit stride and a leading stride at
#   least its other size, as every operand and output the core passes it has (the copy_
#   below it is the structured kernel's copy of the output onto itself, which does nothing);
# - a matmul with bias and relu (_addmm_activation): a CPU runs the relu apart; CUDA puts it
#   in cuBLASLt's epilogue (addmm_out_cuda_impl's Lt path: 1-D bias, contiguous output,
#   more than one row, as the core's feed-forward matmul has at batch 2 and up).
# (aten::addmm with a 1-D bias is one cuBLASLt call with a bias epilogue on CUDA; a CPU
# copies the bias into the output first.)
ONE_KERNEL = frozenset({"aten::baddbmm_", "aten::_addmm_activation", "aten::addmm"})
# Ops whose CPU kernel reads scalars on the host (fused AdamW's CPU kernel reads each step
# count, a tensor rate and found_inf with item()) where CUDA's reads them on the device
# (aten/src/ATen/native/cuda/fused_adam_utils.cuh): syncs below them are not counted.
DEVICE_READS = frozenset({"aten::_fused_adamw_", "aten::_fused_adam_"})
# (aten::item calls aten::_local_scalar_dense: counting both would count each sync twice)
SYNC_OPS = frozenset({"aten::_local_scalar_dense", "fbtrain::host_sync"})
SECTIONS = ("forward sweep", "backward sweep", "core other", "rest")
SWEEP_MARKS = {"fbtrain::forward_sweep": "forward sweep",
               "fbtrain::backward_sweep": "backward sweep"}
CORE_OPS = ("fbtrain::core_forward", "fbtrain::core_backward")
GRAPH_REPLAY = "fbtrain::graph_replay"  # the CPU stand-in of one cudaGraphLaunch
TINY_WIDTHS = dict(d_model=16, n_heads=2, d_ff=32)


def count_events(events) -> dict:
    """Launches per (section, op) and host syncs per section, from profiler events (the
    list ``prof.events()`` gives, whose ``cpu_children`` / ``cpu_parent`` form the op tree).

    Returns ``{"launches": {section: Counter(op -> n)}, "host_launches": {...},
    "syncs": {section: Counter}}``: the kernels the device runs, what the host queues (the
    same, except that a GRAPH_REPLAY is one host launch for every kernel below it), and the
    host syncs."""
    launches = {s: collections.Counter() for s in SECTIONS}
    host = {s: collections.Counter() for s in SECTIONS}
    syncs = {s: collections.Counter() for s in SECTIONS}

    def section_of(event) -> str:
        in_core = False
        node = event
        while node is not None:
            if node.name in SWEEP_MARKS:
                return SWEEP_MARKS[node.name]
            in_core |= node.name in CORE_OPS
            node = node.cpu_parent
        return "core other" if in_core else "rest"

    def count(event, replayed: bool) -> None:
        section = section_of(event)
        launches[section][event.name] += 1
        if not replayed:
            host[section][event.name] += 1

    def launching(event, inside: bool = False, replayed: bool = False,
                  device_reads: bool = False) -> bool:
        """Counts ``event``'s own launch where it has one; True if it or an op below does.
        ``inside``: the event runs inside one of ONE_KERNEL (not counted); ``replayed``:
        inside a GRAPH_REPLAY (a kernel, but no host launch); ``device_reads``: inside one
        of DEVICE_READS (no sync counted)."""
        if inside:
            return True
        name = event.name
        if name == GRAPH_REPLAY:
            host[section_of(event)][name] += 1
            replayed = True
        device_reads |= name in DEVICE_READS
        below = False
        for child in event.cpu_children:
            below |= launching(child, name in ONE_KERNEL, replayed, device_reads)
        if name in SYNC_OPS:
            if not device_reads:
                syncs[section_of(event)][name] += 1
            return below
        if not name.startswith("aten::") or name in NO_KERNEL:
            return below
        if not below or name in OWN_KERNEL:
            count(event, replayed)
        return True

    for event in events:
        if event.cpu_parent is None:
            launching(event)
    return {"launches": launches, "host_launches": host, "syncs": syncs}


class StepReplayStandIn:
    """``step_graph._StepGraph`` on a CPU, for counting: no capture; each replay runs the
    captured step under GRAPH_REPLAY (the kernels one ``cudaGraphLaunch`` would run) and
    writes its figures into the first replay's output, as a graph rewrites its own."""

    def __init__(self, body, device, stream):
        self.body, self.out = body, None

    def replay(self) -> None:
        with torch.profiler.record_function(GRAPH_REPLAY):
            fresh = self.body()
            if self.out is None:
                self.out = fresh
            else:
                self.out.copy_(fresh)


def count_step(kind: str = "feedback_kv", batch: int = 16, seq_len: int = 64,
               dropout: float = 0.0, sizes: dict | None = None,
               optimizer: bool = True, step_graph: bool = False) -> dict:
    """Profile one training step (forward, cross-entropy, backward, AdamW step) of ``kind``
    on the ATen path (the C++ core with ``FBTRAIN_CORE_ATEN=1``, one shard) after one
    warm-up step; :func:`count_events` of it, plus the step's token-layer count under
    ``"token_layers"``. ``step_graph``: the trainer's step through whole-step graphs
    instead (:func:`whole_step`)."""
    sizes = {k: v for k, v in {**SIZES, **(sizes or {})}.items() if k != "dropout"}
    if step_graph and not optimizer:
        raise ValueError("a whole-step graph holds the optimizer step")
    saved = torch.get_num_threads()
    torch.set_num_threads(1)  # one shard, as on a GPU
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(mock.patch.dict(
                os.environ, {"FBTRAIN_CORE_ATEN": "1", "FBTRAIN_CORE": "auto"}))
            if step_graph:
                step = whole_step(stack, kind, batch, seq_len, dropout, sizes)
                step()  # the first step of the shape: eager, then "captured"
            else:
                step = eager_step(kind, batch, seq_len, dropout, sizes, optimizer)
            step()  # warm-up (whole step: a replay)
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step()
        counts = count_events(prof.events())
    finally:
        torch.set_num_threads(saved)
    counts["token_layers"] = seq_len * sizes["n_layers"]
    return counts


def eager_step(kind: str, batch: int, seq_len: int, dropout: float, sizes: dict,
               optimizer: bool) -> Callable[[], None]:
    """A function that trains a fresh model of ``kind`` (seed 0) one step on one batch
    ``[batch, seq_len]``: forward, cross-entropy, backward and (``optimizer``) the trainer's
    AdamW step."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(kind=kind, dropout=dropout, **sizes), VOCAB)
    model.train()
    opt = build_optimizer(model, TrainConfig(lr=1e-4), torch.device("cpu"))
    x = torch.randint(0, VOCAB, (batch, seq_len))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        logits = model(x)[0]
        F.cross_entropy(logits.reshape(-1, VOCAB), x.reshape(-1)).backward()
        if optimizer:
            opt.step()

    return step


def whole_step(stack: contextlib.ExitStack, kind: str, batch: int, seq_len: int,
               dropout: float, sizes: dict) -> Callable[[], None]:
    """A function that trains one step of a run set up as training does (on a generated
    text in a temporary folder that ``stack`` removes; clipping at 1) through its
    ``StepGraphs``, the captured step run by :class:`StepReplayStandIn`, and reads the
    step's figures as ``train_step`` does. The batch is drawn beforehand: the sampler's
    work on the CPU is no kernel of the step's."""
    from fbtrain.checkpoint.files import CheckpointManager
    from fbtrain.config import config_from_dict
    from fbtrain.distributed import DistContext
    from fbtrain.train import step_graph
    from fbtrain.train.setup import set_up
    from fbtrain.train.signals import StopSignals
    from fbtrain.train.step import read_figures

    stack.enter_context(mock.patch.object(step_graph, "_StepGraph", StepReplayStandIn))
    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
    text = tmp / "text.txt"
    rng = random.Random(0)
    chars = 20 * (batch + 1) * (seq_len + 1)  # windows for the batch and validation
    text.write_text("".join(rng.choice("abcdefgh \n") for _ in range(chars)))
    raw = {"run": {"name": "count", "out_dir": str(tmp / "runs"), "device": "cpu",
                   "precision": "fp32"},
           "data": {"path": str(text)},
           "model": {"kind": kind, "dropout": dropout, **sizes},
           "train": {"batch_size": batch, "lr": 1e-4, "warmup_steps": 0,
                     "schedule": "constant", "grad_clip": 1.0, "eval_windows": 1,
                     "constant_tokens": False},
           "curriculum": [{"seq_len": seq_len}],
           "logging": {"tensorboard": False, "progress": False}}
    run, _, _ = set_up(config_from_dict(raw), DistContext(torch.device("cpu")),
                       CheckpointManager(tmp / "runs" / "count", 1), None)
    ((x, y, _),) = run.batches.micro_batches(seq_len, batch, torch.device("cpu"))
    graphs = step_graph.StepGraphs(run)
    return lambda: read_figures(run, graphs([(x, y, None)], 1e-4), StopSignals())


def summary(counts: dict) -> dict:
    """Totals per section and per token-layer, host launches and syncs."""
    tl = counts["token_layers"]
    per = {s: sum(c.values()) for s, c in counts["launches"].items()}
    host = {s: sum(c.values()) for s, c in counts.get("host_launches",
                                                       counts["launches"]).items()}
    return {
        "launches": per, "launches_total": sum(per.values()),
        "per_token_layer": {s: n / tl for s, n in per.items()},
        "per_token_layer_total": sum(per.values()) / tl,
        "host_launches": host, "host_launches_total": sum(host.values()),
        "host_syncs": {s: sum(c.values()) for s, c in counts["syncs"].items()},
        "by_op": {s: dict(c.most_common()) for s, c in counts["launches"].items()},
    }


def core_per_token_layer(s: dict) -> float:
    """The core's kernels per token-layer, forward and backward together (its sweeps and
    its other calls)."""
    per = s["per_token_layer"]
    return per["forward sweep"] + per["backward sweep"] + per["core other"]


TABLE_ROWS = [(kind, dropout) for kind in ("feedback_kv", "feedback") for dropout in (0.0, 0.1)]


def table(batch: int, seq_len: int, sizes: dict | None = None, out=print) -> list[dict]:
    """The table: per kind and dropout, the kernels per token-layer (forward sweep, backward
    sweep, the core, the whole step) and per step. Prints a markdown row per entry as it is
    counted; returns the rows."""
    out("| kind | dropout | fwd sweep / token-layer | bwd sweep / token-layer | "
        "core / token-layer | step / token-layer | kernels / step |")
    out("|---|---|---|---|---|---|---|")
    rows = []
    for kind, dropout in TABLE_ROWS:
        s = summary(count_step(kind, batch, seq_len, dropout, sizes))
        per = s["per_token_layer"]
        rows.append({"kind": kind, "dropout": dropout, **s})
        out(f"| {kind} | {dropout:g} | {per['forward sweep']:.1f} | "
            f"{per['backward sweep']:.1f} | {core_per_token_layer(s):.1f} | "
            f"{s['per_token_layer_total']:.1f} | {s['launches_total']} |")
    return rows


def main() -> int:
    """Print (and optionally write) the counts of one step, or the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", default="feedback_kv", choices=("feedback_kv", "feedback"))
    parser.add_argument("--step-graph", action="store_true",
                        help="host launches with the whole step as one CUDA graph per shape "
                             "(FBTRAIN_CUDA_GRAPHS=1: the trainer's StepGraphs)")
    parser.add_argument("--table", action="store_true",
                        help="both kinds, dropout 0 and 0.1: one markdown row each")
    parser.add_argument("--tiny", action="store_true",
                        help=f"count at tiny widths and batch 2 ({TINY_WIDTHS}): the same "
                             "counts (they follow the steps and layers alone), faster")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--top", type=int, default=12, help="ops listed per section")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.step_graph and args.table:
        parser.error("--step-graph counts one step; it is not --table")
    sizes, batch = ({**SIZES, **TINY_WIDTHS}, 2) if args.tiny else (SIZES, args.batch)
    if args.table:
        print(f"batch {batch}, length {args.seq_len}, sizes {sizes}: one training step")
        result = table(batch, args.seq_len, sizes, out=lambda line: print(line, flush=True))
    else:
        counts = count_step(args.kind, batch, args.seq_len, args.dropout, sizes,
                            step_graph=args.step_graph)
        result = s = summary(counts)
        mode = "the whole step graphed (one replay per step)" if args.step_graph else "eager"
        print(f"{args.kind}, batch {batch}, length {args.seq_len}, dropout "
              f"{args.dropout}, sizes {sizes}: one training step on the ATen path "
              f"(FBTRAIN_CORE_ATEN=1, 1 shard), {mode}")
        print(f"  {'section':16s} {'launches':>9s} {'/token-layer':>13s} {'host launches':>14s} "
              f"{'host syncs':>11s}")
        for sec in SECTIONS:
            print(f"  {sec:16s} {s['launches'][sec]:9d} {s['per_token_layer'][sec]:13.1f} "
                  f"{s['host_launches'][sec]:14d} {s['host_syncs'][sec]:11d}")
        print(f"  {'total':16s} {s['launches_total']:9d} {s['per_token_layer_total']:13.1f} "
              f"{s['host_launches_total']:14d} {sum(s['host_syncs'].values()):11d}")
        for sec in SECTIONS:
            top = ", ".join(f"{op.removeprefix('aten::')} {n}"
                            for op, n in list(s["by_op"][sec].items())[:args.top])
            print(f"  {sec}: {top}")
        if args.step_graph:
            for sec in SECTIONS:
                queued = ", ".join(f"{op.removeprefix('aten::')} {n}"
                                   for op, n in counts["host_launches"][sec].most_common())
                print(f"  host queues, {sec}: {queued or 'nothing'}")
    if args.json:
        from fbtrain.io import atomic_write_text

        atomic_write_text(args.json, json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
