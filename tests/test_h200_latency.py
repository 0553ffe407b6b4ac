"""scripts/h200_model.py's latency term (issue 37): each fused kernel's serial memory round
trips counted from its loops, a launch the larger of its throughput and latency terms,
and ``kernel_predictions`` as scripts/gpu_check.py reads it. A model: the figures here are
its arithmetic, worked by hand."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import h200_model as m  # noqa: E402

# D 64 (two chunks of 32), F 128 (four), two heads of 32 (window chunks of 128 / 32 = 4
# slots), two layers, three steps, window 2: steps attend 0, 1, 2 slots.
TOY = m.Sizes(d_model=64, n_heads=2, d_ff=128, n_layers=2, batch=16, seq_len=3, window=2)


def test_round_trips_follow_each_kernels_loops():
    """nk = 2 width chunks, nf = 4 d_ff chunks; one window chunk a split on the two steps
    that attend (nw 1); one split a step (sp 1); the memory (one key/value set: 2 parts)
    on layer 0 of 2: (2 mix + 2 x 2 norm + 2 x 2 projection chunks) / 2 = 5 in attend,
    its gradient's 128 / 32 = 4 chunks / 2 layers = 2 in q_back."""
    assert m.round_trips(TOY) == {
        "attend": 5 + 3 * 2 + 2 * 1 + 1,  # memory, LN1 x 2 and the query, two passes
        "out_proj": 2 * (2 * 1 + 1) + 1,  # a chunk: the splits' maxima, then their sums
        "ff_in": 3 * 2 + 1, "ff_out": 4 + 1, "ffo_back": 2 * 2 + 2, "ffi_back": 4 + 1,
        "att_back": 2 * 2 + 1 + 2 * 1, "q_back": 2 * 1 + 2 + 1}


def test_pipelined_matmul_loops_wait_once_per_stages_less_one_chunks():
    """num_stages 3: the matmul loops (the query's and the memory's projection chunks in
    attend, ff_in's and ffo_back's matmul, ff_out, ffi_back, q_back's memory chunks) wait
    once every two chunks; out_proj and att_back, which Triton does not pipeline, and every
    other loop keep theirs. num_stages 2 overlaps only the arithmetic: no change."""
    assert m.round_trips(TOY, 2) == m.round_trips(TOY)
    assert m.round_trips(TOY, 3) == {
        "attend": (2 + 2 * 2 + 2 * 1) / 2 + 2 * 2 + 1 + 2 * 1 + 1,
        "out_proj": 2 * (2 * 1 + 1) + 1,
        "ff_in": 2 * 2 + 1 + 1, "ff_out": 2 + 1, "ffo_back": 2 + 1 + 2, "ffi_back": 2 + 1,
        "att_back": 2 * 2 + 1 + 2 * 1, "q_back": 2 * 1 + 1 + 1}


def test_a_launch_waits_its_round_trips_per_wave():
    lo, hi = m.ROUND_TRIP_US
    assert m.launch_latency_s(1, 10, lo) == pytest.approx((1.0 + 10 * lo) * 1e-6)
    full = m.SMS * m.RESIDENT  # programs resident at once
    assert m.launch_latency_s(full, 10, hi) == pytest.approx((1.0 + 10 * hi) * 1e-6)
    assert m.launch_latency_s(full + 1, 10, hi) == pytest.approx((1.0 + 20 * hi) * 1e-6)


def test_kernel_predictions_give_both_terms_per_kernel():
    """What gpu_check puts beside each kernel's measured time: the throughput term (the
    model's launch_s with an even share of the records) and the latency term at the middle
    of the round trip's range, its ends beside it."""
    got = m.kernel_predictions(TOY)
    assert list(got) == ["attend", "out_proj", "ff_in", "ff_out", "ffo_back", "ffi_back",
                         "att_back", "q_back"]
    trips = m.round_trips(TOY)
    records = m.step_hbm_bytes(TOY)["records"] / (8 * 3 * 2)
    for k in m.fused_kernels(TOY):
        p = got[k.name]
        assert p["throughput_s"] == pytest.approx(m.launch_s(k, records))
        assert p["latency_s"] == pytest.approx((1.0 + trips[k.name] * 0.25) * 1e-6)
        assert p["latency_lo_s"] < p["latency_s"] < p["latency_hi_s"]
        assert p["round_trips"] == trips[k.name] and p["programs"] == k.programs


def test_a_fused_step_takes_the_larger_term_per_launch(monkeypatch):
    """With the latency made negligible the step is the throughput model's; with a round
    trip of 1 ms every launch is latency-bound: the step is the launches' latencies."""
    counts = m.Counts(kernels=60, host=8, replays=2, triton=48)  # 8 a token-layer x 6
    monkeypatch.setattr(m, "ROUND_TRIP_US", (0.0, 0.0))
    monkeypatch.setattr(m, "LAUNCH_LATENCY_US", 0.0)
    row = m.fused_row("fused graphed", TOY, counts)
    assert row.latency_ms[0] == pytest.approx(row.device_ms)
    assert row.step_ms == row.step_hi_ms == max(row.host_ms, row.device_ms)
    monkeypatch.setattr(m, "ROUND_TRIP_US", (1000.0, 2000.0))
    row = m.fused_row("fused graphed", TOY, counts)
    trips = sum(m.round_trips(TOY).values())
    other = row.device_ms - sum(6 * m.launch_s(k, m.step_hbm_bytes(TOY)["records"] / 48)
                                for k in m.fused_kernels(TOY)) * 1000
    assert row.latency_ms[0] == pytest.approx(6 * trips * 1.0 + other)
    assert row.latency_ms[1] == pytest.approx(6 * trips * 2.0 + other)
    assert row.bound == "latency" and row.step_hi_ms == pytest.approx(row.latency_ms[1])


def test_gpu_yaml_step_by_the_latency_term_is_what_the_issue_counted():
    """At configs/gpu.yaml's last stage (batch 32, 256 steps, 6 layers): about 580 round
    trips a token-layer (issue 37 counted ~593), and with the counted launches the fused
    step is latency-bound, about 155-345 ms (the issue: 150-330) against the throughput
    model's ~57 ms."""
    s = m.Sizes(d_model=512, n_heads=8, d_ff=2048, n_layers=6, batch=32, seq_len=256,
                window=256, dropout=0.2)
    assert 550 < sum(m.round_trips(s).values()) < 620
    triton = 8 * 256 * 6
    row = m.fused_row("fused graphed", s, m.Counts(kernels=triton + 60, host=20,
                                                    replays=2, triton=triton))
    assert row.device_ms < 70 and row.bound == "latency"
    assert 140 < row.step_ms < row.step_hi_ms < 360


def test_aten_rows_keep_their_floor():
    """An ATen kernel's latency term (a launch and two round trips: 1.3-1.7 us) stays under
    the 2 us floor the throughput term already charges it: the ATen rows do not move."""
    c = m.Counts(kernels=1000, host=1000)
    row = m.aten_row("aten eager", replace(TOY, batch=16), c)
    assert row.latency_ms == pytest.approx((1.3, 1.7))
    assert row.device_ms > row.latency_ms[1] and row.bound == "host"
