"""The benchmark scripts run end to end at toy lengths: figures, JSON and exit codes agree."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


def test_gpu_check_runs_its_cpu_stand_in(tmp_path: Path):
    """Without CUDA, scripts/gpu_check.py runs every section on the CPU at toy sizes and
    says so (the CUDA tests it collects are skipped; one is named to keep this short)."""
    out = tmp_path / "gpu_check.json"
    proc = run_script("gpu_check.py", "--tests", "tests/test_models.py::test_cuda_matches_cpu",
                      "--steps", "6", "--repeats", "1", "--chars", "10", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["device"].startswith("no CUDA: a toy run on the CPU")
    assert "no CUDA: a toy run on the CPU" in proc.stdout.splitlines()[0]
    assert all(report["checks"].values()) and len(report["checks"]) == 3
    assert "skipped" in report["tests"]["summary"]
    assert len(report["exactness_max_abs_diff"]) == 4
    assert all(d < 1e-9 for d in report["exactness_max_abs_diff"].values())
    rows = report["bench"]["toy"]["8"]
    assert set(rows) == {"feedback_kv", "feedback", "transformer"}
    assert all(r["ms_per_step"] > 0 and r["tokens_per_sec"] > 0 for r in rows.values())
    train = report["train"]
    assert train["last"][0] == 6 and train["last"][1] < train["first"][1]
    assert report["sample_chars_per_s"]["toy"] > 0
    assert report["profile"]["busy_ms"] > 0 and report["profile"]["launch_bound"] is None
    for section in ("== tests", "== exact", "== bench", "== train", "== sample",
                    "== profile", "== summary"):
        assert section in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")
def test_gpu_check_required_cuda_fails_at_once_without_it():
    """``make gpu-check`` (--require-cuda) on a machine without CUDA (a CPU build of torch,
    say) fails in one line instead of passing on the CPU stand-in."""
    proc = run_script("gpu_check.py", "--require-cuda")
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("error: no CUDA device (torch ")
    assert proc.stderr.strip().endswith("this check is for a CUDA machine")


def test_gpu_check_counts_kernels_launch_calls_and_busy_time_once():
    """The profile's device work: each kernel's time once (not again through the CPU op
    that launched it), no user annotation counted as a kernel, and the host's launch
    calls apart from the kernels they ran (a graph replay: one call, many kernels)."""
    from types import SimpleNamespace as Event

    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check

    events = [
        Event(key="aten::mm", device_type="DeviceType.CPU", count=10,
              self_device_time_total=900.0),  # the launching op, carrying its kernels' time
        Event(key="ampere_sgemm", device_type="DeviceType.CUDA", count=10,
              self_device_time_total=900.0),
        Event(key="Optimizer.step#AdamW.step", device_type="DeviceType.CUDA", count=1,
              self_device_time_total=5000.0, is_user_annotation=True),
        Event(key="cudaLaunchKernel", device_type="DeviceType.CPU", count=4,
              self_device_time_total=0.0),
        Event(key="cudaGraphLaunch", device_type="DeviceType.CPU", count=2,
              self_device_time_total=0.0),
    ]
    assert gpu_check.device_work(events) == {"kernels": 10, "launch_calls": 6,
                                             "busy_ms": 0.9}


def test_corpus_load_reports_first_and_cached_runs(tmp_path: Path):
    out = tmp_path / "load.json"
    proc = run_script("corpus_load.py", "--size", "20000", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    for run in ("first", "cached"):
        assert report[run]["splits"] == {"train": 17999, "val": 999, "test": 999}
        assert report[run]["dtype"] == "torch.uint8" and report[run]["peak_rss_mb"] > 0
        assert f"{run}: load " in proc.stdout
