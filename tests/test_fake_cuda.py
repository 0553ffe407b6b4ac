"""The GPU path, proven without a GPU: fbtrain's real trainer, eval and sample on fake CUDA
(scripts/fakecuda: a CPU-only torch dispatching every op as on a GPU, computing nothing).

Each test runs one command of scripts/fakecuda/run.py in a child process (the CUDA
plumbing must be loaded before torch) and checks what a GPU would have seen: no tensor on
the wrong device (a mismatch raises, and the child fails), the training state on cuda:0,
the host syncs by file and line, and the dtype and matmul precision of each watched op.
What fake CUDA cannot check (graph capture, kernels' numerics, speed) waits for
scripts/gpu_check.py on a real GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "scripts" / "fakecuda"
sys.path.insert(0, str(HARNESS))
import build  # noqa: E402  (scripts/fakecuda/build.py: importable before or after torch)

pytestmark = pytest.mark.skipif(build.compiler() is None,
                                reason="fake CUDA needs a C++ compiler (c++ or g++)")


def fake_cuda(*args: str) -> dict[str, Any]:
    """Run scripts/fakecuda/run.py ARGS; its report (the output's last line)."""
    done = subprocess.run([sys.executable, str(HARNESS / "run.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads(done.stdout.splitlines()[-1])


def syncs_by_phase(report: dict[str, Any]) -> dict[str, Counter]:
    """{phase: Counter({(kind, where): count})}."""
    phases: dict[str, Counter] = {}
    for s in report["syncs"]:
        phases.setdefault(s["phase"], Counter())[(s["kind"], s["where"])] += s["count"]
    return phases


def check_dtypes(report: dict[str, Any], precision: str, feedback: bool = True) -> None:
    """The dtype flow: ``auto`` runs the head in bf16 and every float32 matmul (the core's)
    on TF32 tensor cores; ``fp32`` runs everything in IEEE float32. LayerNorm, softmax and
    the loss take float32 either way. A feedback model's core (its matmuls, or under
    inference_mode its whole op) takes float32."""
    rows = report["dtypes"]
    matmuls = [r for r in rows if r["op"] == "matmul"]
    core = [r for r in rows if r["op"] == "core" or
            (r["op"] == "matmul" and r["where"].startswith("fbtrain/models/core/"))]
    assert bool(core) == feedback, core
    assert all(set(r["dtypes"]) <= {"float32", "int64", "bool"} for r in core), core
    for r in rows:
        if r["op"] in ("layer_norm", "softmax", "loss"):
            assert r["dtypes"][0] == "float32", r
    if precision == "fp32":
        assert all(set(r["dtypes"]) <= {"float32", "int64", "bool"} for r in rows), rows
        assert {r["precision"] for r in matmuls + core} == {"ieee"}
    else:
        assert all(r["precision"] == "tf32" for r in core), core
        assert any("bfloat16" in r["dtypes"] for r in matmuls), "the head did not run bf16"


@pytest.mark.parametrize("kind, context, data, precision", [
    ("feedback_kv", "reset", "text", "auto"),
    ("feedback_kv", "reset", "bpe", "auto"),  # the step's characters gathered on the device
    ("feedback", "carry", "text", "fp32"),
    ("transformer", "reset", "algorithmic", "auto"),
    ("feedback_kv", "carry", "algorithmic", "fp32"),
])
def test_training_on_fake_cuda(kind: str, context: str, data: str, precision: str) -> None:
    report = fake_cuda("train", "--kind", kind, "--context", context, "--data", data,
                       "--precision", precision, "--steps", "4")
    assert report["steps"] == [1, 2, 3, 4]
    assert report["checkpoints"] == [2, 4]  # checkpoint.every 2
    assert report["off_device"] == []  # weights and AdamW's moments all on cuda:0
    phases = syncs_by_phase(report)
    # One host sync a training step, in every mode, from one line: logged steps (every
    # step here) add none, a labelled step none, a carried segment's copy none.
    step = phases.pop("step")
    assert len(step) == 1 and sum(step.values()) == 4, step
    assert "trainer" not in phases, phases["trainer"]
    # Evaluation (at step 0, 2 and 4): one read each, however many batches.
    assert sum(phases.pop("eval").values()) == report["evaluations"] == 3
    # The logged sample after each evaluation: one read a generated token (3 tokens).
    assert sum(phases.pop("sample").values()) == 3 * 3
    # A save checks the weights are finite in one read.
    assert sum(phases.pop("save").values()) == 2
    # Set-up copies the model and data to the device, once; nothing else syncs.
    phases.pop("setup")
    assert not phases, phases
    check_dtypes(report, precision, feedback=kind != "transformer")


def test_eval_on_fake_cuda_reads_the_host_once() -> None:
    report = fake_cuda("eval")
    phases = syncs_by_phase(report)
    [(kind, where)] = phases["eval"]  # one place reads, once
    assert kind == "tolist" and where.startswith("fbtrain/scoring.py:"), phases
    assert sum(phases.pop("eval").values()) == 1, phases
    phases.pop("load", None)  # the checkpoint's weights copied to the device, once
    assert not phases, phases
    assert report["tokens"] > 0
    check_dtypes(report, "auto")  # eval runs at the run's precision (auto): TF32, bf16 head


def test_sampling_on_fake_cuda_reads_the_host_once_a_token() -> None:
    report = fake_cuda("sample", "--length", "5")
    phases = syncs_by_phase(report)
    sample = phases.pop("sample")
    assert sum(n for (kind, _), n in sample.items() if kind != "blocking to device") == 5
    assert not [k for k in sample if k[0] == "blocking to device"], sample
    phases.pop("load", None)
    assert not phases, phases


def test_dropout_costs_a_training_step_its_bool_masks_not_float_ones(tmp_path: Path) -> None:
    """The peak of one training step (MemTracker on fake CUDA) with dropout and without:
    the difference is the masks at one byte an element (L layers; T steps, T - 1 of them
    attending; B rows; widths D and F; the attention probabilities' windows) and small
    scratch. Masks of four bytes, or a kept copy of the hidden layer after its dropout,
    would each put it past twice that."""
    L, D, H, F, T, B = 2, 32, 2, 256, 16, 8
    config = tmp_path / "tiny.yaml"
    config.write_text(
        f"model: {{kind: feedback_kv, d_model: {D}, n_heads: {H}, d_ff: {F}, "
        f"n_layers: {L}, max_rel_pos: {T}}}\n"
        f"train: {{batch_size: {B}, eval_windows: 4, constant_tokens: false}}\n"
        f"curriculum: [{{seq_len: {T}}}]\n")
    peaks = {p: fake_cuda("memory", "--config", str(config), "--set", f"model.dropout={p}")
             ["stages"][0]["peak_bytes"] for p in (0.0, 0.2)}
    window_elements = B * H * sum(range(T))  # step t attends to t slots (window >= T)
    mask_bytes = L * ((T - 1) * B * D + window_elements + T * B * F + T * B * D)
    overhead = peaks[0.2] - peaks[0.0]
    assert mask_bytes <= overhead < 2 * mask_bytes, (overhead, mask_bytes)
