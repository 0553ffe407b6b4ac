"""The ATen path's launch count (scripts/launch_count.py) and its freedom from host syncs, and
what the host queues for a step through whole-step CUDA graphs."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import launch_count  # noqa: E402

from fbtrain.config import ModelConfig  # noqa: E402
from fbtrain.models import build_model  # noqa: E402
from fbtrain.models.core.autograd import flatten_layers  # noqa: E402
from fbtrain.models.core.native import NativeCore  # noqa: E402
from fbtrain.models.core.spec import CoreInputs, CoreSpec  # noqa: E402

TINY = dict(d_model=8, n_heads=2, d_ff=16, n_layers=1, max_rel_pos=16)

# One attending token-layer of feedback_kv (one layer, no dropout, no key/value bias) on the
# ATen path, counted by hand from csrc/feedback_core.cpp. Forward: LayerNorm, folded query
# projection into scratch (addmm with its bias), content + position scores (baddbmm, which
# first copies the position scores: copy_), the queries copied into the tape (copy_),
# softmax, probabilities @ values (bmm), output projection (addmm_) + residual (add_),
# LayerNorm, W1 with its bias and relu (_addmm_activation), W2 (addmm_) + residual (add_);
# per step: the memory mix and its
# keys/values (2 mm), the latter written straight into the slot-major key/value buffer.
FORWARD_STEP = {"native_layer_norm": 2, "addmm": 1, "addmm_": 2, "_addmm_activation": 1,
                "baddbmm": 1, "_softmax": 1, "bmm": 1, "add_": 2, "mm": 2, "copy_": 2}
# Backward: d_memory from the slot's key/value gradients (mm), the top gradient + mix *
# d_memory (addcmul); W2^T (mm), relu (threshold_backward), W1^T (mm), LayerNorm backward,
# + residual (add); Wo^T (mm), d_prob (bmm), softmax backward and its copy into the folded
# query gradient (copy_), d_qu (bmm), back through the folded projection (mm), LayerNorm
# backward, + residual (add), + mix * d_memory (addcmul_); per step, the window's key and
# value gradients from all layers (one key/value set: 2 baddbmm_).
BACKWARD_STEP = {"mm": 5, "copy_": 1, "addcmul": 1, "threshold_backward": 1,
                 "native_layer_norm_backward": 2, "add": 2, "bmm": 2, "addcmul_": 1,
                 "baddbmm_": 2, "_softmax_backward_data": 1}
# Core launches per token-layer with dropout (see the budget test). Bool dropout masks (a
# quarter of float masks' memory) cost a scale multiply where a float mask was one multiply:
# docs/performance.md gives the count before and after.
BUDGET = 43
# What the host queues for a whole-step graph (FBTRAIN_CUDA_GRAPHS=1), whatever the sizes:
# the rate's fill, the batch's two copies into the graph, the replay, the figures' copy to
# the host.
STEP_GRAPH_HOST = {"aten::fill_": 1, "aten::copy_": 3, launch_count.GRAPH_REPLAY: 1}
STEP_GRAPH_TARGET = 8  # "at most a handful of launches a step"


def sweep_counts(seq_len: int) -> dict[str, collections.Counter]:
    """Launches per op of each sweep of one tiny feedback_kv step (no optimizer)."""
    counts = launch_count.count_step(batch=2, seq_len=seq_len, sizes=TINY, optimizer=False)
    return {sec: counts["launches"][sec] for sec in ("forward sweep", "backward sweep")}


def test_launch_counter_matches_a_hand_count_of_one_token_layer():
    """One more step (one layer) adds exactly the hand-counted calls to each sweep."""
    short, long = sweep_counts(2), sweep_counts(3)
    for sec, expected in (("forward sweep", FORWARD_STEP), ("backward sweep", BACKWARD_STEP)):
        added = {op.removeprefix("aten::"): n for op, n in (long[sec] - short[sec]).items()}
        assert added == expected, sec
        assert not short[sec] - long[sec]


def test_a_cpu_per_batch_matmul_counts_as_the_one_gemm_cuda_runs():
    """At sizes where the CPU runs each in-place batched matmul of the key/value window
    gradients as one small matmul per (row, head), and the feed-forward relu apart from
    its matmul, each still counts once (CUDA's strided-batched gemm, cuBLASLt's relu
    epilogue): two per attending step, and no matmul or relu below them."""
    sizes = dict(d_model=32, n_heads=1, d_ff=64, n_layers=2, max_rel_pos=32)
    seq_len = 12  # windows of 7 and more: past the CPU's small-matmul kernel
    counts = launch_count.count_step(batch=4, seq_len=seq_len, sizes=sizes, optimizer=False)
    back, fwd = counts["launches"]["backward sweep"], counts["launches"]["forward sweep"]
    assert back["aten::baddbmm_"] == 2 * (seq_len - 1) and "aten::addmm_" not in back
    assert fwd["aten::_addmm_activation"] == 2 * seq_len
    assert not {"aten::relu_", "aten::clamp_min_", "aten::clamp_min"} & set(fwd)


def test_launch_summary_is_per_token_layer():
    counts = {"launches": {s: collections.Counter() for s in launch_count.SECTIONS},
              "syncs": {s: collections.Counter() for s in launch_count.SECTIONS},
              "token_layers": 8}
    counts["launches"]["forward sweep"]["aten::mm"] = 40
    counts["launches"]["rest"]["aten::add"] = 8
    s = launch_count.summary(counts)
    assert s["launches_total"] == 48 and s["per_token_layer_total"] == 6.0
    assert s["per_token_layer"]["forward sweep"] == 5.0
    assert s["host_launches_total"] == 48  # eager: every launch from the host


def test_training_step_on_the_aten_path_stays_under_its_launch_budget():
    """The restructured ATen path's core (both sweeps and its set-up) per token-layer, with
    dropout (49.9 calls before the restructuring at these sizes), and no host syncs."""
    sizes = {**TINY, "n_layers": 4}
    counts = launch_count.count_step(batch=2, seq_len=16, sizes=sizes, dropout=0.1)
    s = launch_count.summary(counts)
    per = s["per_token_layer"]
    assert per["forward sweep"] + per["backward sweep"] + per["core other"] < BUDGET
    assert s["host_syncs"]["forward sweep"] == s["host_syncs"]["backward sweep"] == 0
    assert s["host_syncs"]["core other"] == 0


@pytest.mark.parametrize("kind", ["feedback_kv", "feedback"])
def test_aten_path_reads_no_tensor_on_the_host(kind):
    """The whole core (forward with dropout, backward) runs on the meta device, where any
    read of a tensor's values on the host (``.item()``, ``.cpu()``, ``data_ptr`` loops)
    fails: on a GPU each would be a sync."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(kind=kind, dropout=0.1, memory_norm="layernorm",
                                    **{**TINY, "n_layers": 2}), 11)
    B, T = 2, 3
    layers, wkv, bkv = model.core_params(T)
    n_kv = 1 if kind == "feedback_kv" else 2
    H, dk = TINY["n_heads"], TINY["d_model"] // TINY["n_heads"]

    def meta(t):
        return None if t is None else t.detach().to("meta")

    inputs = CoreInputs(torch.empty(B, T, 8, device="meta"),
                        torch.empty(n_kv, B * H, 0, dk, device="meta"),
                        torch.empty(n_kv, B * H, 0, dk, device="meta"),
                        meta(model.memory_weights()), meta(wkv), meta(bkv),
                        [meta(t) for t in flatten_layers(layers)])
    spec = CoreSpec(n_layers=2, n_heads=H, shared_kv=kind == "feedback_kv", window=16,
                    dropout=0.1, memory_norm=True)
    outputs = NativeCore.core_forward(spec, inputs, keep_tape=True)
    grads = NativeCore.core_backward(spec, torch.empty(B, T, 8, device="meta"), outputs,
                                     inputs.mix, inputs.wkv, inputs.layers)
    assert grads.x0.shape == (B, T, 8) and grads.x0.is_meta
    assert [g.shape for g in grads.layers] == [t.shape for t in inputs.layers]


def _queued(counts: dict, key: str) -> dict[str, collections.Counter]:
    """The sections of ``counts[key]`` that hold anything."""
    return {sec: c for sec, c in counts[key].items() if c}


def test_whole_step_graph_queues_a_handful_of_launches_and_reads_once():
    """The trainer's whole-step graphs (FBTRAIN_CUDA_GRAPHS=1, its StepGraphs with the CPU
    stand-in of the captured step), with dropout: every kernel of the step - the core's
    sweeps, embedding, loss, backward, clipping, AdamW - runs inside the one replay, and the
    host queues 5 launches and reads the device once (the step's figures), at any length
    and depth. (Fused AdamW's CPU kernel reads its step counts with item(); CUDA's does not,
    so those are no syncs.)"""
    for seq_len, n_layers in ((4, 1), (6, 2)):
        counts = launch_count.count_step(batch=2, seq_len=seq_len,
                                         sizes={**TINY, "n_layers": n_layers}, dropout=0.1,
                                         step_graph=True)
        assert _queued(counts, "host_launches") == {"rest": STEP_GRAPH_HOST}
        assert _queued(counts, "syncs") == {"rest": {"fbtrain::host_sync": 1}}
        for sec in ("forward sweep", "backward sweep"):
            assert sum(counts["launches"][sec].values()) > 10 * seq_len * n_layers
        assert counts["launches"]["rest"]["aten::_fused_adamw_"] == 2  # its two groups
    s = launch_count.summary(counts)
    assert s["host_launches_total"] == sum(STEP_GRAPH_HOST.values()) <= STEP_GRAPH_TARGET
