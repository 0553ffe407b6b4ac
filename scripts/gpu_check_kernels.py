"""Section d of scripts/gpu_check.py: each fused-core kernel alone at configs/gpu.yaml's
sizes, beside what scripts/h200_model.py predicts for it.

What it decides: whether the model's per-kernel figures (a throughput term, FLOPs and bytes
over the GPU's rates, and a latency term, the kernel's serial memory round trips) describe
the kernels, and which term does. One float32 training step of feedback_kv through the
fused core (eager launches, no graphs) is run at gpu.yaml's batch and last curriculum
length with every launch recorded as it runs; for each kernel, SAMPLES of its launches
spread over the step (the attention kernels' work grows with the window) are each timed
alone with ``triton.testing.do_bench`` (median), and their mean is the kernel's time per
launch, set beside the model's average launch.

On the CPU stand-in the launches are recorded without a device (meta tensors) to list the
kernels and their launches per step; the timings say ``needs CUDA``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import benchmark
import torch
from gpu_check_report import NEEDS_CUDA, SKIPPED, Budget
from gpu_check_steps import GPU_CONFIG, config_sizes, fused_unavailable, path_env

SAMPLES = 8  # launches of each kernel timed alone, spread over the step
BENCH_MS = {"warmup": 10, "rep": 40}  # do_bench's warm-up and repetition times (ms)


def model_predictions(config: Path) -> dict[str, Any] | str:
    """scripts/h200_model.py's ``kernel_predictions`` at ``config``'s sizes: per kernel
    {throughput_s, latency_s}; or why they are unavailable (one line)."""
    try:
        import h200_model

        return dict(h200_model.kernel_predictions(h200_model.config_sizes(config)))
    except Exception as e:  # an older model without the function: the timings still stand
        return f"model: unavailable ({type(e).__name__}: {str(e)[:200]})"


def recorded_launches(device: torch.device, sizes: dict, batch: int, seq_len: int
                      ) -> tuple[list, float]:
    """Every fused-core kernel launch of one training step (forward and backward) of
    feedback_kv (seed 0) on ``device``, in order, each run as it is recorded; and the
    step's loss."""
    from fbtrain.models import build_model
    from fbtrain.models.core.fused import core as fused_core

    launches: list = []
    run = fused_core._launch

    def record(name: str, grid: tuple[int, ...], args: dict, constexprs: dict) -> None:
        launches.append(fused_core.Launch(name, grid, args, constexprs))
        run(name, grid, args, constexprs)

    with path_env("fused", "0"):
        torch.manual_seed(0)
        model = build_model(benchmark.model_config("feedback_kv", sizes),
                            benchmark.VOCAB).to(device).train()
        x = torch.randint(0, benchmark.VOCAB, (batch, seq_len), device=device)
        fused_core._launch = record
        try:
            logits = model(x)[0]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, benchmark.VOCAB),
                                                     x.reshape(-1))
            loss.backward()
        finally:
            fused_core._launch = run
    return launches, loss.item()


def time_launch(launch: Any) -> float:
    """Microseconds of one recorded launch run alone (do_bench's median)."""
    import triton.testing

    from fbtrain.models.core.fused.launch import _JIT, launch_options

    kernel = _JIT[launch.name][launch.grid]
    opts = launch_options(launch.name)
    ms = triton.testing.do_bench(lambda: kernel(**launch.args, **launch.constexprs, **opts),
                                 return_mode="median", **BENCH_MS)
    return ms * 1000


def meta_counts(sizes: dict, batch: int, seq_len: int) -> dict[str, int]:
    """Launches per kernel of one training step's core call, recorded without a device."""
    from fbtrain.models.core.fused import core_launches, meta_inputs
    from fbtrain.models.core.spec import CoreSpec

    spec = CoreSpec(n_layers=sizes["n_layers"], n_heads=sizes["n_heads"], shared_kv=True,
                    window=min(sizes["max_rel_pos"], seq_len), dropout=sizes["dropout"],
                    memory_norm=False)
    forward, backward = core_launches(spec, meta_inputs(spec, batch, seq_len,
                                                        sizes["d_model"], sizes["d_ff"]))
    counts: dict[str, int] = {}
    for launch in (*forward, *backward):
        counts[launch.name] = counts.get(launch.name, 0) + 1
    return counts


def run(data: dict, device: torch.device, budget: Budget) -> tuple[str, str]:
    """Fill section d's ``data``; its status and one-line summary."""
    sizes, batch, seq_len = config_sizes(GPU_CONFIG)
    data.update(sizes=sizes, batch=batch, seq_len=seq_len)
    predictions = model_predictions(GPU_CONFIG)
    data["model"] = predictions
    why = fused_unavailable(device) if device.type == "cuda" else None
    if why is not None:
        data["kernels"] = f"not run: {why}"
        return "FAIL", f"fused core not run ({why})"
    if device.type != "cuda":
        try:
            counts = meta_counts(sizes, batch, seq_len)
        except ImportError as e:  # no Triton: nothing to list
            data["kernels"] = f"not run: {e}"
            return NEEDS_CUDA, f"fused core not importable ({e})"
        data["kernels"] = {name: {"launches_per_step": n, "us_per_launch": NEEDS_CUDA,
                                  "model": _prediction(predictions, name)}
                           for name, n in counts.items()}
        return NEEDS_CUDA, (f"{len(counts)} kernels, {sum(counts.values())} launches a step "
                            "(recorded on meta tensors); timings need CUDA"
                            + ("" if isinstance(predictions, dict) else "; " + predictions))
    if not budget.allows(30.0):
        data["kernels"] = SKIPPED
        return SKIPPED, "not run"
    launches, _ = recorded_launches(device, sizes, batch, seq_len)
    by_name: dict[str, list] = {}
    for launch in launches:
        by_name.setdefault(launch.name, []).append(launch)
    kernels: dict[str, Any] = {}
    for name, group in by_name.items():
        if not budget.allows(5.0):
            kernels[name] = SKIPPED
            continue
        picks = [group[round(i * (len(group) - 1) / max(1, SAMPLES - 1))]
                 for i in range(min(SAMPLES, len(group)))]
        times = [time_launch(launch) for launch in picks]
        kernels[name] = {"launches_per_step": len(group), "grids": [p.grid for p in picks],
                         "us_samples": times, "us_per_launch": sum(times) / len(times),
                         "us_step_total": sum(times) / len(times) * len(group),
                         "model": _prediction(predictions, name)}
        print(f"  {name}: {len(group)} launches a step, {kernels[name]['us_per_launch']:.1f} "
              f"us a launch{_vs_model(kernels[name]['model'])}", flush=True)
    data["kernels"] = kernels
    timed = {n: k for n, k in kernels.items() if isinstance(k, dict)}
    parts = [f"{n} {k['us_per_launch']:.1f} us" + _vs_model(k["model"]) for n, k in timed.items()]
    return "ok", "; ".join(parts) or "no kernel timed"


def _prediction(predictions: dict | str, name: str) -> Any:
    """The model's figures for kernel ``name`` (microseconds), or why there are none."""
    if isinstance(predictions, str):
        return predictions
    p = predictions.get(name)
    if not isinstance(p, dict):
        return "model: no prediction for this kernel"
    return {f"{k.removesuffix('_s')}_us": v * 1e6 for k, v in p.items()
            if isinstance(v, (int, float))}


def _vs_model(model: Any) -> str:
    """The model's terms for a kernel, for a printed line ("" without a model)."""
    if not isinstance(model, dict):
        return ""
    return " (model " + ", ".join(f"{k} {v:.1f}" for k, v in model.items()) + ")"
