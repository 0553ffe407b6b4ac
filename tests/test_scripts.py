"""The benchmark scripts run end to end at toy lengths: figures, JSON and exit codes agree."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_training_benchmark_reports_exactness_ratios_memory_and_exit_code(tmp_path: Path):
    out = tmp_path / "bench.json"
    proc = run_script("benchmark.py", "--seq-lens", "8", "--repeats", "1", "--warmup", "0",
                      "--memory-seq-lens", "64", "--profile", "--cpu-time", "--json", str(out))
    report = json.loads(out.read_text())
    assert report["clock"] == "process CPU time" and "process CPU time clock" in proc.stdout
    assert proc.returncode == (0 if report["all_targets_met"] else 1), proc.stderr
    assert ("ALL TARGETS MET" if report["all_targets_met"] else "SOME TARGETS MISSED") \
        in proc.stdout
    assert all(diff < 1e-9 for diff in report["exactness_max_abs_diff"].values())
    timings = report["timings"]["8"]
    assert set(timings) == {"reference_feedback_kv", "feedback_kv", "reference_feedback",
                            "feedback", "transformer"}
    for kind in ("feedback_kv", "feedback"):
        ratio = timings[f"reference_{kind}"]["ms_per_step"] / timings[kind]["ms_per_step"]
        assert timings[kind]["speedup_vs_reference"] == pytest.approx(ratio)
        assert f"{ratio:5.2f}x faster than its reference" in proc.stdout
    gpt = report["gpt"]["8"]
    for kind in ("feedback_kv", "transformer"):
        ratio = timings[kind]["ms_per_step"] / gpt["ms_per_step"]
        assert gpt[f"{kind}_over_gpt"] == pytest.approx(ratio)
        assert f"{kind:12s} {ratio:5.2f}x the GPT's step time" in proc.stdout
    # --profile: one step of each split by op; only the C++ core has sweeps of its own
    splits = {name: r["profile_ms"] for name, r in [*timings.items(), ("gpt", gpt)]
              if "profile_ms" in r}
    assert set(splits) == {"feedback_kv", "transformer", "gpt"}
    for name, split in splits.items():
        parts = ("sweeps_own", "matmuls", "copies", "other")
        assert split["total"] == pytest.approx(sum(split[p] for p in parts))
        assert split["matmuls"] > 0 and (split["sweeps_own"] > 0) == (name == "feedback_kv")
        assert re.search(rf"^  {name:12s}\s+{split['sweeps_own']:.1f} \(", proc.stdout, re.M)
    # (64, not 8: a step at 8 can fit in memory the warm-up step freed, and show 0 growth)
    assert all(report["memory_mb"][kind]["64"] > 0
               for kind in ("feedback_kv", "feedback", "transformer"))


def test_sampling_benchmark_same_text_and_cache_sizes(tmp_path: Path):
    out = tmp_path / "sample.json"
    proc = run_script("bench_sample.py", "--chars", "20", "--d-model", "32", "--n-heads", "2",
                      "--d-ff", "64", "--n-layers", "2", "--max-rel-pos", "64",
                      "--json", str(out))
    assert proc.returncode == 0, proc.stderr  # the 50x target is judged at 500 chars only
    report = json.loads(out.read_text())
    assert not report["target_judged"]
    by_kind = {r["kind"]: r for r in report["results"]}
    assert all(r["same_text"] and r["state_slots"] == 20 for r in by_kind.values())
    # feedback_kv: one shared key/value pair per past character; transformer: one per layer.
    assert by_kind["feedback_kv"]["cache_floats_per_char"] == 2 * 32
    assert by_kind["transformer"]["cache_floats_per_char"] == 2 * 32 * 2


def test_corpus_load_reports_first_and_cached_runs(tmp_path: Path):
    out = tmp_path / "load.json"
    proc = run_script("corpus_load.py", "--size", "20000", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    for run in ("first", "cached"):
        assert report[run]["splits"] == {"train": 17999, "val": 999, "test": 999}
        assert report[run]["dtype"] == "torch.uint8" and report[run]["peak_rss_mb"] > 0
        assert f"{run}: load " in proc.stdout


def _h200_model():
    sys.path.insert(0, str(ROOT / "scripts"))
    import h200_model

    return h200_model


def test_h200_model_recomputes_one_row_by_hand(monkeypatch):
    """A toy step (D 2, F 4, one layer, 3 steps, window 2, vocab 3, batch 16), its FLOPs,
    bytes and modelled times worked out by hand from the model's stated rules."""
    m = _h200_model()
    s = m.Sizes(d_model=2, n_heads=1, d_ff=4, n_layers=1, batch=16, seq_len=3, window=2,
                vocab=3)
    # Slots attended: 0 + 1 + 2 = 3, on 2 steps with memory. Forward matmuls per row:
    # 2 x (4 D^2 = 16) + 3 x (4 D F = 32) + 3 x (4 D^2 = 16) = 176, x 16 rows = 2816;
    # window terms 16 x 3 x 6 D = 576; the sweep 2816 + 576 + 2816 + 2 x 576 = 7360;
    # logits: forward, backward and weight gradient, 3 x 16 rows x 3 steps x 2 D V = 1728.
    assert m.step_flops(s) == {"sweep": 7360.0, "weight_grads": 2816.0, "rest": 1728.0}
    # Records 3 x 16 x (3 x (8 D + 2 F = 24) + 3) x 4 B = 14400; weights (2 D^2 + 2 D F = 24,
    # + 2 D^2 + 2 V D = 20: 44 floats) fit in L2: 176 B; the optimizer 7 x 176 = 1232.
    assert m.step_hbm_bytes(s) == {"records": 14400.0, "weights": 176.0, "optimizer": 1232.0}
    with monkeypatch.context() as mp:  # weights that do not fit: read 2 T + 1 = 7 times
        mp.setattr(m, "L2_BYTES", 100)
        assert m.step_hbm_bytes(s)["weights"] == 7 * 176.0
    # ATen eager, 100 kernels: host 100 x 5 us = 0.5 ms; device 100 x 2 us plus the larger
    # of 11904 FLOP at 989 TFLOP/s and 15808 B at 4.8 TB/s (the bytes).
    row = m.aten_row("aten eager", s, m.Counts(kernels=100, host=100))
    assert row.host_ms == pytest.approx(0.5)
    assert row.device_ms == pytest.approx(0.2 + 15808 / 4.8e12 * 1000)
    assert row.step_ms == pytest.approx(0.5) and row.bound == "host"
    assert row.tokens_per_s == pytest.approx(48 / 0.5 * 1000)
    # Fused, graphed, without the 2 us floor: the eight kernels of a token-layer, one
    # program each (one batch tile; one head; one column tile), the window averaged to 1
    # slot a step, the memory's projection (C = 4 columns) in attend and q_back. attend:
    # 2 x 16 x D^2 = 128 FLOP for the query + 16 x 6 D = 192 for the window + 2 x 16 x D x C
    # = 256 for the memory; L2: Wq and Wkv (4 + 8 floats) + 2 x 16 x D keys and values
    # (64 floats) = 304 B. q_back: 128 + 256 FLOP; Wq and Wkv (12 floats) and its rows
    # (16 x (D + C) = 96) = 432 B.
    kernels = {k.name: k for k in m.fused_kernels(s)}
    assert list(kernels) == ["attend", "out_proj", "ff_in", "ff_out", "ffo_back", "ffi_back",
                             "att_back", "q_back"]
    assert kernels["attend"] == m.Launch("attend", 1, 576.0, 304.0, 0.0)
    assert kernels["q_back"] == m.Launch("q_back", 1, 384.0, 432.0, 0.0)
    l2 = {"out_proj": 144, "ff_in": 160, "ff_out": 288, "ffo_back": 672, "ffi_back": 288,
          "att_back": 528}
    assert {k: kernels[k].l2_bytes for k in l2} == l2
    with monkeypatch.context() as mp:  # windows split by 1 slot: (1 + 1 + 2) / 3 splits a
        mp.setattr(m, "SPLIT", 1)      # step, each computing the query again
        split = m.fused_kernels(s)[0]
        assert split.flops == pytest.approx(128 * 4 / 3 + 192 + 256)
        assert split.l2_bytes == pytest.approx((4 * 4 / 3 + 8) * 4 + 256)
    # Each launch uses 1/132 of the GPU and is L2-bound (the bytes beat the FLOPs at 67
    # TFLOP/s / 132 and the records' 14400 / 12 B at 4.8 TB/s): 12 launches, 12/8 of each
    # kind, then 8 other kernels at no floor and the optimizer's 1232 B at 4.8 TB/s.
    monkeypatch.setattr(m, "DEVICE_FLOOR_US", 0.0)
    row = m.fused_row("fused graphed", s, m.Counts(kernels=20, host=8, replays=2, triton=12))
    sweep = 12 / 8 * sum(k.l2_bytes for k in kernels.values()) / (10e12 / 132)
    assert row.device_ms == pytest.approx((sweep + 1232 / 4.8e12) * 1000)
    assert row.host_ms == pytest.approx(0.05) and row.bound == "host"
    # Batch 48: three batch tiles, each reading the weights; the window's bytes follow the
    # rows: attend 3 x 12 x 4 + 2 x 48 x 2 x 4 = 912 B over three programs.
    wide = {k.name: k for k in m.fused_kernels(m.Sizes(**{**asdict(s), "batch": 48}))}
    assert wide["attend"].programs == 3 and wide["attend"].l2_bytes == 912.0
    assert m.launch_s(wide["attend"], 0.0) == pytest.approx(912 / (10e12 * 3 / 132))


def test_h200_model_fit_is_exact_on_its_points():
    m = _h200_model()
    values = {(t, layers): 7 * t * layers + 3 * t + 5 * layers + 11
              for t, layers in m.FIT_POINTS}
    coef = m.fit(values)
    assert coef == pytest.approx((7, 3, 5, 11))
    assert m.predict(coef, 64, 4) == pytest.approx(7 * 256 + 3 * 64 + 5 * 4 + 11)


def test_h200_model_script_prints_a_labelled_table(tmp_path: Path):
    """From saved coefficients (no counting): every path at batch 16, 128, 512 and the
    config's own, for both configs, labelled a model."""
    paths = {"aten eager": {"kernels": [28, 1, 10, 200], "host": [28, 1, 10, 200],
                            "replays": [0, 0, 0, 0], "triton": [0, 0, 0, 0]},
             "aten graphed": {"kernels": [28, 1, 10, 250], "host": [0, 0, 60, 250],
                              "replays": [0, 0, 0, 2], "triton": [0, 0, 0, 0]},
             "fused graphed": {"kernels": [2, 2, 0, 250], "host": [0, 0, 60, 250],
                               "replays": [0, 0, 0, 2], "triton": [2, 2, 0, 0]}}
    counts = tmp_path / "counts.json"
    counts.write_text(json.dumps({"feedback_kv/dropout=0": paths,
                                  "feedback_kv/dropout=0.2": paths}))
    out = tmp_path / "model.json"
    proc = run_script("h200_model.py", "--counts", str(counts), "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("MODEL of an H200 training step, not a measurement")
    report = json.loads(out.read_text())
    main, gpu = report.values()
    assert [(r["path"], r["batch"]) for r in main["rows"]] == [
        (p, b) for b in (16, 128, 512) for p in ("aten eager", "aten graphed", "fused graphed")]
    assert [r["batch"] for r in gpu["rows"]][-3:] == [32] * 3  # gpu.yaml's own batch
    assert main["counts"]["aten eager"]["kernels"] == 28 * 256 + 64 + 40 + 200
    assert "| fused graphed | 512 |" in proc.stdout
