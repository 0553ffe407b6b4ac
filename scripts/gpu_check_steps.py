"""Sections b (correctness on the device) and c (training-step speed) of
scripts/gpu_check.py, and the helpers both use.

b decides whether anything after it can be trusted: feedback_kv and feedback in float64
against tests/reference.py (logits, loss, every gradient) on the ATen path, and whole-step
graphed training against eager training bit for bit.

c decides the GPU design: ms/step and tokens/s of the trainer's feedback_kv step at the
main job's and configs/gpu.yaml's sizes (each at its last curriculum length), batch 32 and
512, bf16 autocast (the core's float32 matmuls on TF32) and fp32 (IEEE), eager and through
whole-step CUDA graphs, with the host's launch calls and the kernels the GPU ran per step
(torch.profiler), and what fake CUDA predicts here (tests/test_fake_cuda.py,
``make gpu-memory``) checked on the real thing: the host syncs of a step
(``torch.cuda.set_sync_debug_mode``: one is designed) and its peak memory
(``torch.cuda.max_memory_allocated``, beside docs/performance.md's fake-CUDA table).
Rows run in the order of what they decide (gpu.yaml first, bf16 first), so a budget that
runs out cuts the least decisive ones.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import benchmark
import torch
from gpu_check_report import NEEDS_CUDA, SKIPPED, Budget

from fbtrain.config import load_config

ROOT = Path(__file__).resolve().parents[1]
GPU_CONFIG = ROOT / "configs" / "gpu.yaml"
MAIN_CONFIG = ROOT / "configs" / "tiny_shakespeare.yaml"
# The CPU stand-in's sizes: every unit at these, on the CPU.
TOY_SIZES = dict(d_model=32, n_heads=2, d_ff=64, n_layers=2, dropout=0.0, max_rel_pos=64)
# Host-side CUDA runtime/driver calls that queue work on the GPU (torch.profiler records
# them as CPU events): what a launch-bound step spends its host time on.
LAUNCH_CALLS = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel",
                          "cuLaunchKernelEx", "cudaGraphLaunch", "cudaMemcpyAsync",
                          "cudaMemsetAsync"})
PATHS = ("aten_eager", "aten_step_graph")  # c's: the step eager, and whole-step graphed


def config_sizes(path: Path) -> tuple[dict, int, int]:
    """A config's model sizes (its dropout included), batch and last curriculum length."""
    cfg = load_config(path)
    m = cfg.model
    sizes = dict(d_model=m.d_model, n_heads=m.n_heads, d_ff=m.d_ff, n_layers=m.n_layers,
                 dropout=m.dropout, max_rel_pos=m.max_rel_pos)
    return sizes, cfg.train.batch_size, cfg.curriculum[-1].seq_len


@contextlib.contextmanager
def env_vars(**values: str) -> Iterator[None]:
    """The environment variables ``values`` set for the block, restored after it."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def device_work(events) -> dict:
    """From ``prof.key_averages()`` of a CUDA run: ``kernels`` the GPU ran, the host's
    ``launch_calls`` (LAUNCH_CALLS; a graph replay is one call for all its kernels) and
    ``busy_ms``, the kernels' own time. Each kernel is its own device event; the CPU ops
    that launched them carry the same time again, so only kernel events are summed, and
    user annotations (``Optimizer.step#...`` spans) are not kernels."""
    kernels = [e for e in events if str(getattr(e, "device_type", "")).endswith("CUDA")
               and not getattr(e, "is_user_annotation", False)]
    return {"kernels": sum(e.count for e in kernels),
            "launch_calls": sum(e.count for e in events if e.key in LAUNCH_CALLS),
            "busy_ms": sum(e.self_device_time_total or 0 for e in kernels) / 1000}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- section b ------------------------------------------------------------------------------


def step_graph_agree(precision: str, device: torch.device) -> dict:
    """scripts/step_graph_check.py's comparison: whole-step graphs against eager training,
    bit for bit, at the main job's widths (dropout 0.1, a shape change, clipping)."""
    import step_graph_check

    with tempfile.TemporaryDirectory() as tmp:
        row = step_graph_check.check(Path(tmp), device, precision, step_graph_check.MAIN)
    row["ok"] = bool(row["bitwise_equal"] and row["captured"])
    return row


def run_correctness(data: dict, device: torch.device, budget: Budget) -> tuple[str, str]:
    """Fill section b's ``data``: each check a unit (budget-checked); status and summary."""
    cuda = device.type == "cuda"
    sizes = benchmark.SIZES if cuda else TOY_SIZES
    cases = ([(k, n) for k in ("feedback_kv", "feedback") for n in ("none", "layernorm")]
             if cuda else [("feedback_kv", "none"), ("feedback", "layernorm")])
    units: list[tuple[str, Callable[[], dict], float]] = []
    shape = (4, 24) if cuda else (2, 6)
    for kind, norm in cases:
        units.append((f"aten_float64/{kind}/memory_norm={norm}", lambda k=kind, n=norm:
                      _exact(k, n, device, sizes, shape), 3.0))
    if cuda:
        for precision in ("fp32", "bf16"):
            units.append((f"step_graph_bitwise/{precision}", lambda p=precision:
                          step_graph_agree(p, device), 15.0))
    else:
        data["step_graph_bitwise"] = NEEDS_CUDA
    passed = failed = 0
    for name, fn, need in units:
        if not budget.allows(need):
            data[name] = SKIPPED
            continue
        start = time.perf_counter()
        try:
            result = fn()
        except Exception as e:  # a failed check is reported; the rest still run
            result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        data[name] = {**result, "seconds": round(time.perf_counter() - start, 2)}
        ok = result["ok"]
        passed += bool(ok)
        failed += not ok
    skipped = sum(v == SKIPPED for v in data.values())
    summary = f"{passed} checks passed, {failed} failed, {skipped} skipped: budget"
    return ("FAIL" if failed else "PASS"), summary


def _exact(kind: str, norm: str, device: torch.device, sizes: dict,
           shape: tuple[int, int]) -> dict:
    """Largest |fbtrain - reference| in float64 of ``kind`` on the C++ core's ATen path (its
    CPU loops on the stand-in) on a batch of ``shape``, against 1e-9."""
    with env_vars(FBTRAIN_CORE="auto"):
        diff = benchmark.check_exact(kind, device=device, sizes={**sizes, "memory_norm": norm},
                                     shape=shape)
    return {"max_abs_diff": diff, "ok": diff < 1e-9}


# --- section c ------------------------------------------------------------------------------


@contextlib.contextmanager
def step_fn(sizes: dict, batch: int, seq_len: int, device: torch.device, precision: str,
            path: str) -> Iterator[tuple[Callable[[], object], Callable[[], dict]]]:
    """A run of ``feedback_kv`` at ``sizes`` (dropout, window) set up as training does
    (scripts/step_graph_check.py's), a function that trains it one step on a
    ``[batch, seq_len]`` batch through ``train_step`` on ``path``, and one that says whether
    the step graph was captured (a failed capture runs eagerly: the row must say so).
    Without CUDA the graph is the check's CPU stand-in (the code paths run)."""
    import step_graph_check

    from fbtrain.device import matmul_precision
    from fbtrain.train import step_graph
    from fbtrain.train.signals import StopSignals
    from fbtrain.train.step import train_step

    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        if device.type != "cuda":
            stack.enter_context(mock.patch.object(step_graph, "_StepGraph",
                                                  step_graph_check.ReplayStandIn))
        run = step_graph_check.make_run(tmp, "speed", device, precision,
                                        {**sizes, "batch": batch, "lengths": (seq_len,) * 2})
        stack.enter_context(matmul_precision(precision, device))  # as trainer.run sets it
        graphs = step_graph.StepGraphs(run) if path == "aten_step_graph" else None
        index = iter(range(10**9))
        signals, last = StopSignals(), tmp / "last.pt"
        yield ((lambda: train_step(run, next(index), signals, last, graphs)),
               (lambda: {} if graphs is None else
                {"step_graph_captured": graphs.graph is not None and not graphs.failed}))


def speed_row(sizes: dict, batch: int, seq_len: int, device: torch.device, precision: str,
              path: str, repeats: int, profile: bool) -> dict:
    """One row of section c: median ms/step over ``repeats`` steps after warm-up (and the
    capture), tokens/s, and (``profile``, CUDA) the host's launch calls and the GPU's
    kernels in one more step."""
    with step_fn(sizes, batch, seq_len, device, precision, path) as (step, captured):
        for _ in range(3):  # warm-up: allocations, the first step of a capture
            step()
        times = []
        for _ in range(repeats):
            sync(device)
            t0 = time.perf_counter()
            step()
            sync(device)
            times.append(time.perf_counter() - t0)
        ms = statistics.median(times) * 1000
        row: dict = {"ms_per_step": ms, "tokens_per_sec": batch * seq_len / ms * 1000,
                     "steps_timed": repeats}
        row.update(captured())
        if device.type == "cuda":
            row.update(host_syncs_and_peak(step, device))
        if profile and device.type == "cuda":
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                step()
                sync(device)
            work = device_work(p.key_averages())
            row.update(host_launches=work["launch_calls"], kernels=work["kernels"],
                       busy_share=work["busy_ms"] / ms if work["kernels"] else None)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # this row's graph pool and activations
    return row


def host_syncs_and_peak(step: Callable[[], object], device: torch.device) -> dict:
    """One more step, watched: the host syncs CUDA reports for it (sync debug mode "warn":
    one warning a sync; fake CUDA's tests hold the design to one) and its peak allocated
    memory (fake CUDA's MemTracker predicts this figure, less the CUDA context)."""
    import warnings

    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sync(device)
    syncs = [str(w.message).splitlines()[0][:120] for w in caught
             if "synchroniz" in str(w.message)]
    return {"host_syncs": len(syncs), "host_sync_messages": syncs[:5],
            "peak_mib": torch.cuda.max_memory_allocated(device) / 2**20,
            "held_before_mib": before / 2**20}


def run_speed(data: dict, device: torch.device, budget: Budget, repeats: int,
              reserve_s: float = 0.0) -> tuple[str, str]:
    """Fill section c's ``data`` (rows keyed config/batch/precision/path); status, summary.
    A row starts only while more than ``reserve_s`` (the later sections' share) would be
    left after it. Launches and kernels are profiled at the first batch only (they do not
    depend on the batch; a profile of tens of thousands of kernels takes seconds)."""
    cuda = device.type == "cuda"
    if cuda:
        configs = {"gpu.yaml": config_sizes(GPU_CONFIG),
                   "main job": config_sizes(MAIN_CONFIG)}
        batches, precisions = (32, 512), ("bf16", "fp32")
    else:
        configs = {"toy": (TOY_SIZES, 2, 8)}
        batches, precisions = (2,), ("fp32",)
    rows = data.setdefault("rows", {})
    for label, (sizes, _, seq_len) in configs.items():
        for batch in batches:
            for precision in precisions:
                for path in PATHS:
                    key = f"{label}/T={seq_len}/batch={batch}/{precision}/{path}"
                    if not budget.allows((15.0 if cuda else 1.0) + reserve_s):
                        rows[key] = SKIPPED
                        continue
                    try:
                        rows[key] = speed_row(sizes, batch, seq_len, device, precision, path,
                                              repeats, profile=batch == batches[0])
                    except Exception as e:  # e.g. out of memory: the rest still run
                        rows[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                    print(f"  {key}: {row_line(rows[key])}", flush=True)
    timed = {k: r for k, r in rows.items() if isinstance(r, dict) and "ms_per_step" in r}
    if not timed:
        return "FAIL", "no row timed"
    best = min(timed, key=lambda k: timed[k]["ms_per_step"] / _tokens(k))
    errors = sum(isinstance(r, dict) and "error" in r for r in rows.values())
    skipped = sum(r == SKIPPED for r in rows.values())
    first = next(iter(timed))
    return ("FAIL" if errors else "ok"), (
        f"{len(timed)} rows timed, {errors} errors, {skipped} skipped: budget; first "
        f"{first}: {timed[first]['ms_per_step']:.1f} ms; most tokens/s {best}: "
        f"{timed[best]['tokens_per_sec']:.0f}")


def row_line(row: dict) -> str:
    """A row of section c in a few words (printed as it finishes)."""
    if "ms_per_step" not in row:
        return f"ERROR {row.get('error')}"
    line = f"{row['ms_per_step']:.1f} ms/step, {row['tokens_per_sec']:.0f} tokens/s"
    if "host_syncs" in row:
        line += f", {row['host_syncs']} host syncs, peak {row['peak_mib'] / 1024:.2f} GiB"
    if "kernels" in row:
        share = row["busy_share"]
        line += (f", {row['host_launches']} host launches, {row['kernels']} kernels, busy "
                 + ("n/a" if share is None else f"{share:.0%}"))
    captured = row.get("step_graph_captured", True)
    return line + ("" if captured else ", NOT CAPTURED (ran eagerly)")


def _tokens(key: str) -> int:
    """Tokens a step of row ``key`` trains (its batch times its length)."""
    fields = dict(p.split("=") for p in key.split("/") if "=" in p)
    return int(fields["batch"]) * int(fields["T"])
