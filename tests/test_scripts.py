"""The benchmark scripts run end to end at toy lengths: figures, JSON and exit codes agree."""

from __future__ import annotations

import dataclasses
import json
import re
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
                      "--memory-seq-lens", "64", "--profile", "--cpu-time", "--json", str(out))
    report = json.loads(out.read_text())
    assert report["clock"] == "process CPU time" and "process CPU time clock" in proc.stdout
    assert proc.returncode == (0 if report["all_targets_met"] else 1), proc.stderr
    assert ("ALL TARGETS MET" if report["all_targets_met"] else "SOME TARGETS MISSED") \
        in proc.stdout
    assert all(diff < 1e-9 for diff in report["exactness_max_abs_diff"].values())
    timings = report["timings"]["8"]
    # --profile adds feedback_kv at a one-slot window (its step without the window attention)
    assert set(timings) == {"reference_feedback_kv", "feedback_kv", "reference_feedback",
                            "feedback", "transformer", "feedback_kv_1slot"}
    for kind in ("feedback_kv", "feedback"):
        ratio = timings[f"reference_{kind}"]["ms_per_step"] / timings[kind]["ms_per_step"]
        assert timings[kind]["speedup_vs_reference"] == pytest.approx(ratio)
        assert f"{ratio:5.2f}x faster than its reference" in proc.stdout
    gpt = report["gpt"]["8"]
    for kind in ("feedback_kv", "transformer", "feedback_kv_1slot"):
        ratio = timings[kind]["ms_per_step"] / gpt["ms_per_step"]
        assert gpt[f"{kind}_over_gpt"] == pytest.approx(ratio)
        assert f"{kind:12s} {ratio:5.2f}x the GPT's step time" in proc.stdout
    share = 1 - timings["feedback_kv_1slot"]["ms_per_step"] / timings["feedback_kv"]["ms_per_step"]
    assert f"(which is {share:.0%} of its step)" in proc.stdout
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


def test_bpe_speed_learns_and_encodes_the_repeated_text(tmp_path: Path):
    unit = tmp_path / "unit.txt"
    unit.write_text("the king and the queen of the kingdom\n" * 40 + "café\n", encoding="utf-8")
    out = tmp_path / "bpe.json"
    proc = run_script("bpe_speed.py", "--path", str(unit), "--mb", "0.02", "--vocab-size",
                      "40", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    repeats = -(-20_000 // len(unit.read_bytes()))
    assert report["bytes"] == repeats * len(unit.read_bytes())
    assert report["vocab_size"] == 40 and report["dtype"] == "torch.uint16"
    assert report["pieces"] < report["characters"] / 3  # whole words became pieces
    assert report["learn_s"] > 0 and report["encode_s"] > 0 and report["peak_rss_mib"] > 0


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux's /proc")
def test_text_memory_reports_the_peak_per_byte_of_each_script(tmp_path: Path):
    out = tmp_path / "text.json"
    proc = run_script("text_memory.py", "--mb", "0.2", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert [r["kind"] for r in report] == ["ascii", "2-byte", "3-byte"]
    for r in report:
        assert abs(r["bytes"] - 200_000) <= 2  # cut at a character's end
        assert r["tokens"] > 0
        assert r["rss_per_byte"] == pytest.approx(r["rss_growth"] / r["bytes"])
    assert report[0]["tokens"] == 200_000  # ASCII: one character a byte
    worst = max(max(r["rss_per_byte"], r["address_per_byte"]) for r in report)
    assert proc.stdout.splitlines()[-1] == f"most per byte: {worst:.1f}"


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux's /proc")
def test_sample_memory_holds_the_estimate_to_the_real_peak(tmp_path: Path):
    """The estimate sample refuses by is not above what sampling really takes (a 50 KB
    prompt was refused as needing 55.9 GiB), for a kind linear in the prompt and for the
    quadratic one."""
    out = tmp_path / "sample.json"
    proc = run_script("sample_memory.py", "--kinds", "feedback_kv", "transformer",
                      "--prompts", "3000", "--length", "2", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert [(r["kind"], r["prompt"]) for r in report] == [("feedback_kv", 3000),
                                                          ("transformer", 3000)]
    for r in report:
        assert 0 < r["estimate"] <= r["growth"], r
        assert f"{r['kind']:>11} prompt   3,000: peak +" in proc.stdout


def test_eta_accuracy_sets_each_eta_against_the_time_that_remained(tmp_path: Path):
    """A log and a run's TensorBoard events with set wall times: each line's ETA against the
    time from its record to the last evaluation's, counted from 20% of the run's time on."""
    from torch.utils.tensorboard import SummaryWriter

    run = tmp_path / "run"
    for folder, points in ((run / "val", {0: 100.0, 4: 200.0}),
                           (run, {1: 110.0, 2: 130.0, 3: 150.0, 4: 190.0})):
        with SummaryWriter(str(folder)) as writer:
            for step, wall in points.items():
                writer.add_scalar("loss", 1.0, step, walltime=wall)
    log = tmp_path / "train.log"
    log.write_text("run directory: run\n"
                   "step 1/4 | loss 2.0000 | 9 tok/s | eta 1m30s\n"  # 10% gone: not counted
                   "step 2/4 | loss 2.0000 | 9 tok/s | eta 1m00s\n"  # 70 s remained: within
                   "step 3/4 | loss 2.0000 | 9 tok/s | eta 10s\n"  # 50 s remained: not
                   "step 4/4 | loss 2.0000 | 9 tok/s | eta 5s\n")  # the last: not counted
    proc = run_script("eta_accuracy.py", "--log", str(log), "--run", str(run))
    assert proc.returncode == 1, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[1].split() == ["step", "2", "30.0%", "gone", "eta", "60s", "remained",
                                "70.0s", "ratio", "0.86"]
    assert lines[-1] == ("from 20% of the run's time on: 1 of 2 ETAs within 25% of the time "
                         "that remained")


def test_one_slot_entry_is_feedback_kv_with_a_one_slot_window():
    sys.path.insert(0, str(ROOT / "scripts"))
    import benchmark

    entries = {e.name: e for e in benchmark.make_entries(torch.device("cpu"), None, False,
                                                         with_one_slot=True)}
    full, one = entries["feedback_kv"].model.cfg, entries[benchmark.ONE_SLOT].model.cfg
    assert one.memory_window == 1 < full.memory_window
    assert dataclasses.replace(one, max_rel_pos=full.max_rel_pos) == full
