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

The launch-bound floor printed is ``launches x per-launch cost``: a model of a GPU whose
host can queue one kernel every ``--us-per-launch`` microseconds, not a GPU measurement.

    python scripts/launch_count.py                      # feedback_kv, B 16, T 64, D 128, L 4
    python scripts/launch_count.py --kind feedback --dropout 0.1 --json counts.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

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
ONE_KERNEL = frozenset({"aten::baddbmm_", "aten::_addmm_activation"})
# (aten::item calls aten::_local_scalar_dense: counting both would count each sync twice)
SYNC_OPS = frozenset({"aten::_local_scalar_dense", "fbtrain::host_sync"})
SECTIONS = ("forward sweep", "backward sweep", "core other", "rest")
SWEEP_MARKS = {"fbtrain::forward_sweep": "forward sweep",
               "fbtrain::backward_sweep": "backward sweep"}
CORE_OPS = ("fbtrain::core_forward", "fbtrain::core_backward")


def count_events(events) -> dict:
    """Launches per (section, op) and host syncs per section, from profiler events (the
    list ``prof.events()`` gives, whose ``cpu_children`` / ``cpu_parent`` form the op tree).

    Returns ``{"launches": {section: Counter(op -> n)}, "syncs": {section: Counter}}``."""
    launches = {s: collections.Counter() for s in SECTIONS}
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

    def launching(event, inside: bool = False) -> bool:
        """Counts ``event``'s own launch where it has one; True if it or an op below does.
        ``inside``: the event runs inside one of ONE_KERNEL (not counted)."""
        if inside:
            return True
        name = event.name
        below = False
        for child in event.cpu_children:
            below |= launching(child, name in ONE_KERNEL)
        if name in SYNC_OPS:
            syncs[section_of(event)][name] += 1
            return below
        if not name.startswith("aten::") or name in NO_KERNEL:
            return below
        if not below or name in OWN_KERNEL:
            launches[section_of(event)][name] += 1
        return True

    for event in events:
        if event.cpu_parent is None:
            launching(event)
    return {"launches": launches, "syncs": syncs}


def count_step(kind: str = "feedback_kv", batch: int = 16, seq_len: int = 64,
               dropout: float = 0.0, sizes: dict | None = None,
               optimizer: bool = True) -> dict:
    """Profile one training step (forward, cross-entropy, backward, AdamW step) of ``kind``
    on the CPU's ATen path after one warm-up step; :func:`count_events` of it, plus the
    step's token-layer count under ``"token_layers"``."""
    sizes = {k: v for k, v in {**SIZES, **(sizes or {})}.items() if k != "dropout"}
    saved = os.environ.get("FBTRAIN_CORE_ATEN"), torch.get_num_threads()
    os.environ["FBTRAIN_CORE_ATEN"] = "1"  # read by the C++ core on every call
    torch.set_num_threads(1)  # one shard, as on a GPU
    try:
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

        step()
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        counts = count_events(prof.events())
    finally:
        if saved[0] is None:
            os.environ.pop("FBTRAIN_CORE_ATEN", None)
        else:
            os.environ["FBTRAIN_CORE_ATEN"] = saved[0]
        torch.set_num_threads(saved[1])
    counts["token_layers"] = seq_len * sizes["n_layers"]
    return counts


def summary(counts: dict, us_per_launch: float) -> dict:
    """Totals per section and per token-layer, syncs, and the modelled launch-bound floor."""
    tl = counts["token_layers"]
    per = {s: sum(c.values()) for s, c in counts["launches"].items()}
    total = sum(per.values())
    return {
        "launches": per, "launches_total": total,
        "per_token_layer": {s: n / tl for s, n in per.items()},
        "per_token_layer_total": total / tl,
        "host_syncs": {s: sum(c.values()) for s, c in counts["syncs"].items()},
        "by_op": {s: dict(c.most_common()) for s, c in counts["launches"].items()},
        "us_per_launch": us_per_launch,
        "launch_bound_floor_ms": total * us_per_launch / 1000,
    }


def main() -> int:
    """Print (and optionally write) the counts of one step."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", default="feedback_kv", choices=("feedback_kv", "feedback"))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--us-per-launch", type=float, default=5.0,
                        help="modelled host cost of one kernel launch (microseconds)")
    parser.add_argument("--top", type=int, default=12, help="ops listed per section")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    counts = count_step(args.kind, args.batch, args.seq_len, args.dropout)
    s = summary(counts, args.us_per_launch)
    print(f"{args.kind}, batch {args.batch}, length {args.seq_len}, dropout {args.dropout}, "
          f"sizes {SIZES}: one training step on the ATen path (FBTRAIN_CORE_ATEN=1, 1 shard)")
    print(f"  {'section':16s} {'launches':>9s} {'/token-layer':>13s} {'host syncs':>11s}")
    for sec in SECTIONS:
        print(f"  {sec:16s} {s['launches'][sec]:9d} {s['per_token_layer'][sec]:13.1f} "
              f"{s['host_syncs'][sec]:11d}")
    print(f"  {'total':16s} {s['launches_total']:9d} {s['per_token_layer_total']:13.1f} "
          f"{sum(s['host_syncs'].values()):11d}")
    for sec in SECTIONS:
        top = ", ".join(f"{op.removeprefix('aten::')} {n}"
                        for op, n in list(s["by_op"][sec].items())[:args.top])
        print(f"  {sec}: {top}")
    print(f"MODEL, not a GPU measurement: at {args.us_per_launch:g} us per launch the host "
          f"alone needs >= {s['launch_bound_floor_ms']:.1f} ms per step to queue these kernels")
    if args.json:
        from fbtrain.io import atomic_write_text

        atomic_write_text(args.json, json.dumps(s, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
