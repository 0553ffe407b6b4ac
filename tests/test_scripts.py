"""The benchmark scripts run end to end at toy lengths: figures, JSON and exit codes agree."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_training_benchmark_reports_exactness_ratios_memory_and_exit_code(tmp_path: Path):
    out = tmp_path / "bench.json"
    proc = run_script("benchmark.py", "--seq-lens", "8", "--repeats", "1", "--warmup", "0",
                      "--memory-seq-lens", "64", "--json", str(out))
    report = json.loads(out.read_text())
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
