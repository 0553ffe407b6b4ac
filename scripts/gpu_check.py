"""One-shot check of fbtrain on a CUDA GPU: one report, in at most about 8 minutes.

Sections, in order (each timed; the report ends with a summary line per check):

  tests    the CUDA-marked tests (``pytest -m cuda``)
  exact    float64 on the device against tests/reference.py: logits, loss and every
           gradient of feedback_kv and feedback (memory_norm none and layernorm), on the
           default core and on the fused core (FBTRAIN_CORE=fused)
  bench    training steps (forward, cross-entropy, backward, AdamW; bf16 autocast on CUDA)
           of feedback_kv, feedback and transformer at configs/gpu.yaml's sizes and at the
           CPU benchmark's (scripts/benchmark.py), T = 64 and 256: ms/step, tokens/s, peak
           CUDA memory of a step
  train    200 steps of configs/gpu.yaml (``fbtrain train``, bf16) on --data or a generated
           text: first and last logged loss, which must fall
  sample   cached generation (fbtrain.sample.generate), characters/s, at both sizes
  graphs   feedback_kv and feedback at configs/gpu.yaml's sizes, T = 64, batch gpu.yaml's,
           16, 128 and 512, fp32: per step the host's launch calls (cudaLaunchKernel and
           kin; a graph replay is one cudaGraphLaunch) and the kernels the GPU ran (both
           from torch.profiler), ATen eager, ATen CUDA-graphed (FBTRAIN_CUDA_GRAPHS=1) and
           the fused core (FBTRAIN_CORE=fused, graphs asked for) ms/step and tokens/s, the
           GPU-busy share of each, whether the graphs were captured, and whether graphed
           and eager steps agree bitwise (loss and every gradient, dropout 0.1). On the CPU
           stand-in: the ATen path's launches (scripts/launch_count.py), the eager step and
           the fused core's step in Triton's interpreter; no graphs
  fused    the fused core against the ATen path's eager step in float32 (logits, loss and
           every gradient of one training step at configs/gpu.yaml's sizes, dropout 0):
           logits within 1e-4, each gradient within 1e-4 of its largest entry (the bound
           tests/test_fused_core.py holds the fused core to against the C++ core)
  profile  one feedback_kv training step at configs/gpu.yaml's sizes (T = 64) under
           torch.profiler: the share of its wall time the GPU is busy. Well below 1 means the
           step is launch-bound (the GPU waits for the CPU to queue thousands of small
           kernels), which is what CUDA graphs would address

Without CUDA it runs the same path on the CPU at toy sizes and says so (CI runs it that way:
the figures then mean nothing, the code paths are exercised; the fused core then runs in
Triton's interpreter, and is left out where Triton is missing), unless --require-cuda (what
``make gpu-check`` passes) makes that a failure. Exits 1 if a check fails.

    python scripts/gpu_check.py --require-cuda        # on a CUDA machine (make gpu-check)
    python scripts/gpu_check.py --data input.txt --json gpu_check.json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_sample  # noqa: E402
import benchmark  # noqa: E402
import launch_count  # noqa: E402

from fbtrain.config import load_config  # noqa: E402
from fbtrain.data.tokenizers import CharTokenizer  # noqa: E402
from fbtrain.device import autocast_dtype  # noqa: E402
from fbtrain.models import build_model  # noqa: E402
from fbtrain.models.core import graphs  # noqa: E402
from fbtrain.sample import generate  # noqa: E402

GPU_CONFIG = ROOT / "configs" / "gpu.yaml"
KINDS = ("feedback_kv", "feedback", "transformer")
BUDGET_S = 480.0  # 8 minutes
# The CPU stand-in: every section at these sizes, on the CPU.
TOY_SIZES = dict(d_model=32, n_heads=2, d_ff=64, n_layers=2, dropout=0.0, max_rel_pos=64)
TOY_BATCH, TOY_SEQ_LENS, TOY_TRAIN_STEPS, TOY_CHARS = 4, (8,), 12, 20
GRAPH_BATCHES = (16, 128, 512)  # with gpu.yaml's own, for the graphs section
# Host-side CUDA runtime/driver calls that queue work on the GPU (torch.profiler records
# them as CPU events): what a launch-bound step spends its host time on.
LAUNCH_CALLS = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel",
                          "cuLaunchKernelEx", "cudaGraphLaunch", "cudaMemcpyAsync",
                          "cudaMemsetAsync"})


class Budget:
    """Wall-clock budget of the whole run: later sections shrink or skip when it runs out."""

    def __init__(self, seconds: float):
        self.start, self.seconds = time.perf_counter(), seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()


def gpu_sizes() -> tuple[dict, int]:
    """configs/gpu.yaml's model sizes (dropout off, as in the CPU benchmark) and batch."""
    cfg = load_config(GPU_CONFIG)
    m = cfg.model
    sizes = dict(d_model=m.d_model, n_heads=m.n_heads, d_ff=m.d_ff, n_layers=m.n_layers,
                 dropout=0.0, max_rel_pos=m.max_rel_pos)
    return sizes, cfg.train.batch_size


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


def run_cuda_tests(paths: list[str], budget: Budget) -> dict:
    """``pytest -m cuda`` in a subprocess: its summary line and exit status."""
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-p", "no:cacheprovider", *paths]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              timeout=max(30.0, min(180.0, budget.left())))
    except subprocess.TimeoutExpired:
        return {"ok": False, "summary": "timed out"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    summary = lines[-1] if lines else proc.stderr.strip()[-200:]
    # Exit 5: nothing selected/run (every test skipped or deselected) is not a failure.
    return {"ok": proc.returncode in (0, 5), "summary": summary, "exit_code": proc.returncode}


# The fused core's float32 bound against the ATen path (tests/test_fused_core.py's, against
# the C++ core): logits absolute, gradients relative to each one's largest entry.
FUSED_FP32_TOL = 1e-4


def check_exactness(device: torch.device, sizes: dict | None,
                    cases: tuple[tuple[str, str], ...] | None = None) -> dict[str, float]:
    """Largest |fbtrain - reference| (logits, loss, gradients; float64) per kind and norm
    (``cases``: (kind, memory_norm) pairs; default all four), on the core that
    $FBTRAIN_CORE selects."""
    out = {}
    for kind, norm in cases or [(k, n) for k in ("feedback_kv", "feedback")
                                for n in ("none", "layernorm")]:
        out[f"{kind}/memory_norm={norm}"] = benchmark.check_exact(
            kind, device=device, sizes={**(sizes or benchmark.SIZES), "memory_norm": norm})
    return out


def fused_unavailable(device: torch.device) -> str | None:
    """Why the fused core cannot run on ``device`` in this process (one line), or None."""
    from fbtrain.models.core import select

    if not hasattr(select, "fused_unavailable"):
        return "this fbtrain has no fused core"
    if device.type != "cuda" and not os.environ.get("TRITON_INTERPRET"):
        return "no CUDA and no TRITON_INTERPRET"
    return select.fused_unavailable()


def fused_runs() -> bool:
    """Whether $FBTRAIN_CORE=fused gives the fused core here (not its fallback)."""
    from fbtrain.models.core import select

    return type(select.core()).__name__ == "FusedCore"


def grads_of_step(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Logits and every gradient of one cross-entropy step of ``model`` on ``x``."""
    model.zero_grad(set_to_none=True)
    logits = model(x)[0]
    torch.nn.functional.cross_entropy(logits.reshape(-1, benchmark.VOCAB),
                                      x.reshape(-1)).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def fused_agreement(device: torch.device, sizes: dict, batch: int, seq_len: int) -> dict:
    """The fused core's float32 training step against the ATen path's eager one (same
    weights, dropout 0): the largest logit difference and the largest gradient difference
    relative to that gradient's largest entry, each against FUSED_FP32_TOL."""
    results = []
    for core in ("auto", "fused"):
        with env_var("FBTRAIN_CORE", core), cuda_graphs(False):
            torch.manual_seed(0)
            model = build_model(benchmark.model_config("feedback_kv", sizes),
                                benchmark.VOCAB).to(device).train()
            x = torch.randint(0, benchmark.VOCAB, (batch, seq_len), device=device)
            results.append(grads_of_step(model, x))
    (logits, grads), (f_logits, f_grads) = results
    logit_diff = (f_logits - logits).abs().max().item()
    grad_rel = max(((f_grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item()
                   for n, g in grads.items())
    return {"logits_max_abs_diff": logit_diff, "grads_max_rel_diff": grad_rel,
            "tolerance": FUSED_FP32_TOL,
            "ok": logit_diff <= FUSED_FP32_TOL and grad_rel <= FUSED_FP32_TOL}


def bench_steps(device: torch.device, precision: torch.dtype | None, sizes: dict,
                batch: int, seq_lens: tuple[int, ...], repeats: int, budget: Budget) -> dict:
    """benchmark.time_steps (no reference) plus the peak CUDA memory of one step per kind."""
    out: dict = {}
    for seq_len in seq_lens:
        if budget.left() < 60:
            out[seq_len] = "skipped: time budget"
            continue
        # Two warm-up steps: a new model's first two steps pay one-time costs (allocator,
        # kernels' first calls, the optimizer's state).
        result = benchmark.time_steps(seq_len, repeats, 2, device, precision, False, sizes,
                                      batch)
        if device.type == "cuda":
            for kind in KINDS:
                result[kind]["peak_cuda_mb"] = benchmark.peak_step_memory_mb(
                    kind, seq_len, device, sizes, batch, precision)
        out[seq_len] = result
    return out


def generated_text(path: Path, chars: int = 400_000, seed: int = 0) -> Path:
    """A text with learnable structure (words from a small lexicon, in lines), for training
    where no data file is given (the check must not need the network)."""
    rng = random.Random(seed)
    words = ["the", "king", "shall", "speak", "of", "love", "and", "war", "my", "lord",
             "to", "be", "or", "not", "good", "night", "sweet", "prince", "what", "is"]
    lines, size = [], 0
    while size < chars:
        line = " ".join(rng.choice(words) for _ in range(rng.randint(4, 10))).capitalize()
        lines.append(line + rng.choice([".", ",", "!", "?"]))
        size += len(lines[-1]) + 1
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def train_run(device: torch.device, data: Path | None, steps: int, toy: bool,
              budget: Budget) -> dict:
    """``fbtrain train --config configs/gpu.yaml`` for ``steps`` steps: the logged losses."""
    with tempfile.TemporaryDirectory() as tmp:
        text = data or generated_text(Path(tmp) / "text.txt", 40_000 if toy else 400_000)
        sets = [f"data.path={text}", f"run.out_dir={tmp}/runs", f"train.max_steps={steps}",
                # 10% warm-up: the config's 200 would be the whole run
                f"train.warmup_steps={max(1, steps // 10)}", f"train.eval_every={steps}",
                "train.eval_windows=8", f"checkpoint.every={steps}", "logging.tensorboard=false",
                f"train.log_every={max(1, steps // 20)}"]
        if toy:
            sets += [f"model.{k}={v}" for k, v in TOY_SIZES.items()]
            sets += [f"train.batch_size={TOY_BATCH}", f"curriculum={TOY_SEQ_LENS[-1]}"]
        cmd = [sys.executable, "-m", "fbtrain", "train", "--config", str(GPU_CONFIG),
               "--device", str(device), "--quiet"]
        for item in sets:
            cmd += ["--set", item]
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                                  timeout=max(60.0, budget.left() - 60))
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": "timed out"}
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            return {"ok": False, "error": proc.stderr.strip().splitlines()[-1:]}
        records = [json.loads(line) for line in
                   (Path(tmp) / "runs" / "gpu" / "metrics.jsonl").read_text().splitlines()]
    losses = [(r["step"], r["loss"]) for r in records if "loss" in r]
    (first_step, first), (last_step, last) = losses[0], losses[-1]
    rates = [r["tokens_per_sec"] for r in records if r.get("tokens_per_sec") is not None]
    return {"ok": last < first, "first": [first_step, first], "last": [last_step, last],
            "seconds": seconds, "tokens_per_sec": statistics.median(rates) if rates else None,
            "data": str(data) if data else "generated"}


def sample_speed(device: torch.device, sizes: dict, chars: int) -> float:
    """Characters/s of cached incremental generation (random weights: speed does not depend
    on training), after a short warm-up."""
    tokenizer = CharTokenizer(bench_sample.VOCAB)
    torch.manual_seed(0)
    cfg = benchmark.model_config("feedback_kv", sizes)
    model = build_model(cfg, tokenizer.vocab_size).to(device).eval()
    generate(model, tokenizer, bench_sample.PROMPT, 8, generator=torch.Generator().manual_seed(0))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    generate(model, tokenizer, bench_sample.PROMPT, chars,
             generator=torch.Generator().manual_seed(1))
    sync()
    return chars / (time.perf_counter() - start)


def busy_share(device: torch.device, precision: torch.dtype | None, sizes: dict, batch: int,
               seq_len: int) -> dict:
    """One feedback_kv training step: the time the device spends in kernels (from
    torch.profiler) over the step's wall time (the median of three steps run without the
    profiler, whose own overhead would inflate it). On the CPU there is no such share (the
    profiled op time includes the profiler's overhead): ``share`` is None there."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = build_model(benchmark.model_config("feedback_kv", sizes), benchmark.VOCAB)
    model = model.to(device)
    entry = benchmark.Entry("feedback_kv", model, lambda x: model(x)[0], device, precision)
    x = torch.randint(0, benchmark.VOCAB, (batch, seq_len), device=device)
    entry.step(x, x)  # warm-up: allocations, first-call costs, the optimizer's state
    wall_s = statistics.median(entry.step(x, x) for _ in range(3))
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        entry.step(x, x)
    events = prof.key_averages()
    if device.type == "cuda":
        work = device_work(events)
        busy_ms, count = work["busy_ms"], work["kernels"]
    else:
        busy_ms = sum(e.self_cpu_time_total for e in events) / 1000
        count = sum(e.count for e in events)
    # No kernels seen (no CUPTI, say) is no measurement, not a launch-bound step.
    share = busy_ms / (wall_s * 1000) if device.type == "cuda" and count else None
    return {"step_ms": wall_s * 1000, "busy_ms": busy_ms, "share": share,
            "launches_or_ops": count, "seq_len": seq_len, "batch": batch,
            "launch_bound": None if share is None else share < 0.5}


@contextlib.contextmanager
def env_var(name: str, value: str) -> Iterator[None]:
    """``$name`` set to ``value`` for the block."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def cuda_graphs(on: bool) -> contextlib.AbstractContextManager[None]:
    """``$FBTRAIN_CUDA_GRAPHS`` set to ``on`` for the block."""
    return env_var(graphs.GRAPHS_ENV, "1" if on else "0")


# The modes of the graphs section: name -> ($FBTRAIN_CORE, CUDA graphs asked for).
MODES = {"eager": ("auto", False), "graphed": ("auto", True), "fused": ("fused", True)}


def _entry(kind: str, sizes: dict, batch: int, seq_len: int, device: torch.device,
           dropout: float = 0.0) -> tuple[benchmark.Entry, torch.Tensor]:
    """A fresh fp32 model of ``kind`` (seed 0) in a benchmark Entry, and a batch for it."""
    torch.manual_seed(0)
    model = build_model(benchmark.model_config(kind, {**sizes, "dropout": dropout}),
                        benchmark.VOCAB).to(device).train()
    x = torch.randint(0, benchmark.VOCAB, (batch, seq_len), device=device)
    return benchmark.Entry(kind, model, lambda t: model(t)[0], device, None), x


def _profiled_step(entry: benchmark.Entry, x: torch.Tensor) -> dict:
    """:func:`device_work` of one training step on the GPU."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        entry.step(x, x)
    return device_work(prof.key_averages())


def graphs_agree(kind: str, sizes: dict, batch: int, seq_len: int,
                 device: torch.device) -> bool:
    """Two forward/backward steps (dropout 0.1, same seed) eager and graphed: the same
    loss and gradients bit for bit (fp32), the graphed ones from graphs that were
    captured (a failed capture runs eagerly, which would agree trivially)."""
    results = []
    for on in (False, True):
        graphs.release()
        with cuda_graphs(on):
            entry, x = _entry(kind, sizes, batch, seq_len, device, dropout=0.1)
            torch.manual_seed(1)
            got = []
            for _ in range(2):
                entry.model.zero_grad(set_to_none=True)
                loss = torch.nn.functional.cross_entropy(
                    entry.forward(x).reshape(-1, benchmark.VOCAB), x.reshape(-1))
                loss.backward()
                got += [loss.detach()] + [p.grad.clone() for p in entry.model.parameters()
                                          if p.grad is not None]
            results.append(got)
    status = graphs.capture_status()
    captured = status["captured"] > 0 and not status["failed"]
    return captured and all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def graph_steps(device: torch.device, sizes: dict, batches: tuple[int, ...], seq_len: int,
                repeats: int, budget: Budget, fused: bool = False) -> dict:
    """The graphs section (see the module docstring): per kind and batch, launches per
    step, eager, graphed and (``fused``) fused-core ms/step and tokens/s, busy shares and
    bitwise agreement."""
    out: dict = {}
    cuda = device.type == "cuda"
    names = [n for n in MODES if (cuda or n != "graphed") and (fused or n != "fused")]
    for kind in ("feedback_kv", "feedback"):
        for batch in batches:
            key = f"{kind}/batch={batch}"
            if budget.left() < 60:
                out[key] = "skipped: time budget"
                continue
            row: dict = {"kind": kind, "batch": batch, "seq_len": seq_len}
            for name in names:
                core, on = MODES[name]
                graphs.release()  # this row's captures alone
                with cuda_graphs(on and cuda), env_var("FBTRAIN_CORE", core):
                    entry, x = _entry(kind, sizes, batch, seq_len, device)
                    # Warm-up (and, graphed, the captures; fused, Triton's compiles). The
                    # interpreted fused core on the CPU is slow: one warm-up step there.
                    for _ in range(3 if cuda or name != "fused" else 1):
                        entry.step(x, x)
                    ms = statistics.median(entry.step(x, x) for _ in range(repeats)) * 1000
                    row[f"{name}_ms"] = ms
                    row[f"{name}_tokens_per_sec"] = batch * seq_len / ms * 1000
                    if cuda:
                        work = _profiled_step(entry, x)
                        row[f"{name}_launches"] = work["launch_calls"]
                        row[f"{name}_kernels"] = work["kernels"]
                        row[f"{name}_busy_share"] = (work["busy_ms"] / ms if work["kernels"]
                                                     else None)
                    if on and cuda:  # a failed capture runs eagerly: the row must say so
                        row["graphs" if name == "graphed" else f"{name}_graphs"] = \
                            graphs.capture_status()
            if cuda:
                row["bitwise_equal"] = graphs_agree(kind, sizes, min(batch, 16), seq_len,
                                                    device)
                graphs.release()  # each shape's graphs hold memory pools of their own
            else:  # the ATen path's count, on the CPU (what a GPU would launch)
                counts = launch_count.count_step(kind, batch, seq_len, sizes=sizes)
                row["eager_launches"] = launch_count.summary(counts, 5.0)["launches_total"]
            out[key] = row
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, help="text to train on (default: generated)")
    parser.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per benchmark entry")
    parser.add_argument("--chars", type=int, default=300, help="characters to sample")
    parser.add_argument("--tests", nargs="*", default=["tests"],
                        help="what pytest -m cuda collects (default: tests)")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds (default 480)")
    parser.add_argument("--json", type=Path, help="also write the report here")
    parser.add_argument("--require-cuda", action="store_true",
                        help="fail at once without CUDA instead of running the CPU stand-in")
    args = parser.parse_args(argv)
    budget = Budget(args.budget)
    cuda = torch.cuda.is_available()
    if args.require_cuda and not cuda:
        print(f"error: no CUDA device (torch {torch.__version__}, CUDA build "
              f"{torch.version.cuda or 'none'}); this check is for a CUDA machine",
              file=sys.stderr)
        return 1
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda and importlib.util.find_spec("triton") and "triton" not in sys.modules:
        # The fused core in Triton's interpreter: set before Triton is first imported (its
        # mode is fixed then).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    fused_why = fused_unavailable(device)
    precision = autocast_dtype("auto", device)  # what training uses: bf16 where the GPU has it
    if cuda:
        sizes_gpu, batch_gpu = gpu_sizes()
        size_sets = {"gpu.yaml": (sizes_gpu, batch_gpu),
                     "cpu-benchmark": (benchmark.SIZES, benchmark.BATCH)}
        seq_lens, steps, chars = (64, 256), args.steps, args.chars
        where = f"CUDA: {torch.cuda.get_device_name(device)}"
    else:
        size_sets = {"toy": (TOY_SIZES, TOY_BATCH)}
        seq_lens = TOY_SEQ_LENS
        steps, chars = min(args.steps, TOY_TRAIN_STEPS), min(args.chars, TOY_CHARS)
        where = "no CUDA: a toy run on the CPU (same code paths; the figures mean nothing)"
    report: dict = {"device": where, "torch": torch.__version__,
                    "machine": platform.processor() or platform.machine(), "checks": {}}
    print(f"fbtrain GPU check: {where}; torch {torch.__version__}, "
          f"{'bf16 autocast' if precision else 'fp32'}", flush=True)

    def section(name: str) -> None:
        print(f"\n== {name} (at {budget.elapsed():.0f} s)", flush=True)

    section("tests: pytest -m cuda")
    # The C++ core is built (first run: about a minute) before the tests, whose time limit
    # is for the tests.
    from fbtrain.models.core import native

    try:
        native.native_ops()
    except native.CoreBuildError as e:
        print(f"  the C++ core does not build here: {e}")
    tests = run_cuda_tests(args.tests, budget)
    report["tests"] = tests
    report["checks"]["cuda tests"] = tests["ok"]
    print(f"  {tests['summary']}")

    section("exact: float64 on the device vs tests/reference.py (logits, loss, gradients)")
    exact = check_exactness(device, None if cuda else TOY_SIZES)
    report["exactness_max_abs_diff"] = exact
    report["checks"]["float64 exactness"] = all(d < 1e-9 for d in exact.values())
    for name, diff in exact.items():
        print(f"  {name:32s} {diff:.2e}  {'PASS' if diff < 1e-9 else 'FAIL'}")
    if fused_why is None:
        with env_var("FBTRAIN_CORE", "fused"):
            runs = fused_runs()
            # On the CPU the interpreter is slow: one case of each kind there.
            fused_exact = check_exactness(device, None if cuda else TOY_SIZES, None if cuda
                                          else (("feedback_kv", "none"),
                                                ("feedback", "layernorm"))) if runs else {}
        report["fused_exactness_max_abs_diff"] = fused_exact
        report["checks"]["fused float64 exactness"] = runs and all(
            d < 1e-9 for d in fused_exact.values())
        if not runs:
            print("  fused core: FBTRAIN_CORE=fused ran another core here: FAIL")
        for name, diff in fused_exact.items():
            print(f"  fused {name:26s} {diff:.2e}  {'PASS' if diff < 1e-9 else 'FAIL'}")
    else:
        print(f"  fused core: not run ({fused_why})")
        if cuda:  # on a GPU it must run
            report["checks"]["fused float64 exactness"] = False

    section("bench: training step (forward, loss, backward, AdamW)")
    report["bench"] = {}
    for label, (sizes, batch) in size_sets.items():
        result = bench_steps(device, precision, sizes, batch, seq_lens, args.repeats, budget)
        report["bench"][label] = result
        print(f"  {label}: d_model {sizes['d_model']}, {sizes['n_layers']} layers, "
              f"batch {batch}, median of {args.repeats}")
        for seq_len, rows in result.items():
            if isinstance(rows, str):
                print(f"    T={seq_len}: {rows}")
                continue
            for kind, r in rows.items():
                mem = f"{r['peak_cuda_mb']:9.1f} MiB" if "peak_cuda_mb" in r else ""
                print(f"    T={seq_len:<4d} {kind:12s} {r['ms_per_step']:9.1f} ms/step "
                      f"{r['tokens_per_sec']:10.0f} tokens/s {mem}")

    section(f"train: {steps} steps of configs/gpu.yaml")
    train = train_run(device, args.data, steps, not cuda, budget)
    report["train"] = train
    report["checks"]["training loss falls"] = train["ok"]
    if "first" in train:
        print(f"  loss {train['first'][1]:.3f} at step {train['first'][0]} -> "
              f"{train['last'][1]:.3f} at step {train['last'][0]} "
              f"({'falls' if train['ok'] else 'DOES NOT FALL'}); {train['seconds']:.0f} s, "
              f"{train['tokens_per_sec'] or 0:.0f} tokens/s; data: {train['data']}")
    else:
        print(f"  FAILED: {train['error']}")

    section("sample: cached generation, feedback_kv")
    report["sample_chars_per_s"] = {}
    for label, (sizes, _) in size_sets.items():
        rate = sample_speed(device, sizes, chars)
        report["sample_chars_per_s"][label] = rate
        print(f"  {label}: {rate:.1f} characters/s ({chars} characters)")

    section("graphs: launches, eager vs CUDA-graphed steps (fp32)")
    sizes, batch = next(iter(size_sets.values()))
    batches = tuple(dict.fromkeys((batch, *GRAPH_BATCHES))) if cuda else (batch,)
    graph_rows = graph_steps(device, sizes, batches, seq_lens[0], args.repeats, budget,
                             fused=fused_why is None)
    report["graphs"] = graph_rows
    if cuda:
        rows = [r for r in graph_rows.values() if isinstance(r, dict)]
        report["checks"]["graphs captured"] = bool(rows) and all(
            r["graphs"]["captured"] > 0 and not r["graphs"]["failed"] for r in rows)
        report["checks"]["graphed = eager"] = all(r["bitwise_equal"] for r in rows)
    for key, r in graph_rows.items():
        if isinstance(r, str):
            print(f"  {key}: {r}")
            continue
        line = (f"  {key:24s} eager {r['eager_ms']:8.1f} ms {r['eager_tokens_per_sec']:9.0f} "
                f"tok/s {r['eager_launches']:6d} launches")
        if cuda:
            def busy(share: float | None) -> str:
                return "n/a" if share is None else f"{share:.0%}"

            captured = ("graphs captured" if r["graphs"]["captured"] and not r["graphs"]["failed"]
                        else "CAPTURE FAILED (graphed = eager)")
            line += (f" ({r['eager_kernels']} kernels) busy {busy(r['eager_busy_share'])}; "
                     f"graphed {r['graphed_ms']:8.1f} ms {r['graphed_tokens_per_sec']:9.0f} "
                     f"tok/s {r['graphed_launches']:6d} launches ({r['graphed_kernels']} "
                     f"kernels) busy {busy(r['graphed_busy_share'])}; {captured}; bitwise "
                     f"{'equal' if r['bitwise_equal'] else 'DIFFERENT'}")
        else:
            line += " (ATen path, counted on the CPU; no CUDA graphs here)"
        if "fused_ms" in r:
            line += (f"; fused {r['fused_ms']:8.1f} ms {r['fused_tokens_per_sec']:9.0f} tok/s")
            if cuda:
                fg = r["fused_graphs"]
                line += (f" {r['fused_launches']:6d} launches ({r['fused_kernels']} kernels) "
                         f"busy {busy(r['fused_busy_share'])}; "
                         + ("graphs captured" if fg["captured"] and not fg["failed"] else
                            "not graphed"))
        print(line)

    section("fused: the fused core's float32 step against the ATen path's eager one")
    if fused_why is None:
        sizes, batch = next(iter(size_sets.values()))
        agree = fused_agreement(device, sizes, min(batch, 16), seq_lens[0])
        report["fused_fp32"] = agree
        report["checks"]["fused = eager (fp32)"] = agree["ok"]
        print(f"  logits max |diff| {agree['logits_max_abs_diff']:.2e}, gradients max "
              f"|diff| / max|grad| {agree['grads_max_rel_diff']:.2e} (tolerance "
              f"{agree['tolerance']:g}): {'PASS' if agree['ok'] else 'FAIL'}")
    else:
        print(f"  not run ({fused_why})")
        if cuda:
            report["checks"]["fused = eager (fp32)"] = False

    section("profile: share of a training step the device is busy")
    sizes, batch = next(iter(size_sets.values()))
    prof = busy_share(device, precision, sizes, batch, seq_lens[0])
    report["profile"] = prof
    head = f"  feedback_kv T={prof['seq_len']} batch {prof['batch']}: step {prof['step_ms']:.1f} ms"
    if cuda and prof["share"] is None:
        print(f"{head}; the profiler saw no kernels (is CUPTI available?): no busy share")
    elif cuda:
        verdict = "launch-bound" if prof["launch_bound"] else "not launch-bound"
        print(f"{head}, GPU busy {prof['busy_ms']:.1f} ms = {prof['share']:.0%} "
              f"({prof['launches_or_ops']} kernels: {verdict})")
    else:
        print(f"{head}; {prof['launches_or_ops']} ops profiled (busy share: n/a on the CPU)")

    report["seconds"] = budget.elapsed()
    ok = all(report["checks"].values())
    print(f"\n== summary ({report['seconds']:.0f} s; {where})")
    for name, passed in report["checks"].items():
        print(f"  {name:22s} {'PASS' if passed else 'FAIL'}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
