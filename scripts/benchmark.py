"""Training-step speed of fbtrain's models against the slow reference, side by side.

Measures, in one process and interleaved (so machine noise hits every entry alike), full
training steps (forward, cross-entropy, backward, AdamW step) of:

  reference_kv / reference  the seed design's algorithm (tests/reference.py) for
                            feedback_kv / feedback, on the same weights as fbtrain's
  feedback_kv / feedback    fbtrain's models, the exact path ``fbtrain train`` uses
  transformer               fbtrain's parallel baseline of the same sizes
  gpt                       a standard GPT of the same sizes (pre-LayerNorm blocks, causal
                            attention through scaled_dot_product_attention, learned
                            absolute positions, GELU feed-forward): the yardstick a reader
                            knows; reported apart, as feedback_kv's and the transformer's
                            step times over its
  feedback_kv_1slot         (--profile only) feedback_kv with a one-slot memory window
                            (max_rel_pos 1): the same matmuls, LayerNorms and sweeps, almost
                            none of the window attention, so its step over the GPT's is
                            where feedback_kv would stand if its attention cost nothing

and reports median ms per step, tokens/s, the ratios fbtrain/reference,
fbtrain/transformer, feedback_kv/gpt and transformer/gpt, and the peak memory of a training
step at several lengths. Before timing it checks that fbtrain's loss and gradients equal the
reference's (float64, same weights), so a fast wrong model cannot pass. Exits 1 if a target
is missed. With ``--profile`` it also times feedback_kv_1slot and splits one step of
feedback_kv, the transformer and the GPT (torch.profiler, self CPU time summed over
threads) into the C++ core's sweeps' own time (its loops outside any ATen call: the self
time of the core's per-shard marks), matmuls, copies and everything else.

    python scripts/benchmark.py                 # the full run (a few minutes on 2 cores)
    python scripts/benchmark.py --json out.json
    python scripts/benchmark.py --no-reference --memory-seq-lens --profile
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
# This checkout's fbtrain (it need not be installed) and the reference beside its tests.
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from reference import reference_forward  # noqa: E402

from fbtrain.config import ModelConfig, TrainConfig  # noqa: E402
from fbtrain.device import resolve_device  # noqa: E402
from fbtrain.models import build_model  # noqa: E402
from fbtrain.train.optim import build_optimizer  # noqa: E402

VOCAB = 65
SIZES = dict(d_model=128, n_heads=4, d_ff=512, n_layers=4, dropout=0.0, max_rel_pos=4096)
BATCH = 16
TARGET_VS_REFERENCE = 5.0
AIM_VS_TRANSFORMER = 2.5
# The parts of a profiled step (--profile), by the ops' names: the C++ core's per-shard marks
# (their self time is the sweeps' own time: csrc/feedback_core.cpp, for_each_shard), the
# matmul kernels and the copies; the rest is "other" (elementwise ops, LayerNorm, softmax,
# AdamW, autograd and Python).
SWEEP_MARKS = frozenset({"fbtrain::forward_shard", "fbtrain::backward_shard"})
MATMULS = frozenset({"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm",
                     "aten::baddbmm_", "aten::_addmm_activation", "aten::addbmm", "aten::mv",
                     "aten::addmv", "aten::dot"})
COPIES = frozenset({"aten::copy_", "aten::cat"})
PROFILED = ("feedback_kv", "transformer", "gpt")
ONE_SLOT = "feedback_kv_1slot"


def model_config(kind: str, sizes: dict | None = None) -> ModelConfig:
    """``kind`` at the benchmark's SIZES (or at ``sizes``: the ModelConfig fields to use)."""
    return ModelConfig(kind=kind, **(sizes or SIZES))


def check_exact(kind: str, seed: int = 0, device: torch.device | str = "cpu",
                sizes: dict | None = None, shape: tuple[int, int] = (4, 24)) -> float:
    """Largest |difference| of logits, loss and every gradient between fbtrain and the
    reference, float64 on ``device``, same weights (randomised position tables and memory
    weights included), on a batch of ``shape`` [batch, steps]."""
    torch.manual_seed(seed)
    model = build_model(model_config(kind, sizes), VOCAB).double().to(device)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    x = torch.randint(0, VOCAB, shape).to(device)
    y = torch.randint(0, VOCAB, shape).to(device)
    results = []
    for forward in (lambda: reference_forward(model, x), lambda: model(x)[0]):
        model.zero_grad(set_to_none=True)
        logits = forward()
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        results.append((logits.detach(), loss.detach(),
                        {n: p.grad.clone() for n, p in model.named_parameters()}))
    (ref_logits, ref_loss, ref_grads), (logits, loss, grads) = results
    worst = max((logits - ref_logits).abs().max().item(), (loss - ref_loss).abs().item())
    for name, g in ref_grads.items():
        worst = max(worst, (grads[name] - g).abs().max().item())
    return worst


def trainer_optimizer(model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer ``fbtrain train`` builds, for every entry alike (reference included)."""
    return build_optimizer(model, TrainConfig(lr=1e-4), device)


class Entry:
    """One model + its optimizer, and a function that runs one full training step."""

    # What a step is timed by: the wall clock, or (--cpu-time) the process's CPU time.
    clock: Callable[[], float] = time.perf_counter

    def __init__(self, name: str, model: torch.nn.Module,
                 forward: Callable[[torch.Tensor], torch.Tensor], device: torch.device,
                 precision: torch.dtype | None):
        self.name, self.model, self.forward = name, model, forward
        self.device, self.precision = device, precision
        self.optimizer = trainer_optimizer(model, device)
        self.times: list[float] = []

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        start = self.clock()
        with torch.autocast(self.device.type, dtype=self.precision or torch.float32,
                            enabled=self.precision is not None):
            logits = self.forward(x)
            loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        sync()
        return self.clock() - start


class GPT(torch.nn.Module):
    """A standard GPT: token + learned absolute position embeddings, pre-LayerNorm blocks of
    causal self-attention (``scaled_dot_product_attention``) and a GELU feed-forward, a
    final LayerNorm and a linear head. Sizes as ModelConfig's (d_model, n_heads, d_ff,
    n_layers, dropout); ``max_len`` positions."""

    def __init__(self, cfg: ModelConfig, vocab: int, max_len: int):
        super().__init__()
        D = cfg.d_model
        self.n_heads, self.dropout = cfg.n_heads, cfg.dropout
        self.embed = torch.nn.Embedding(vocab, D)
        self.pos = torch.nn.Embedding(max_len, D)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict({
            "ln1": torch.nn.LayerNorm(D), "qkv": torch.nn.Linear(D, 3 * D),
            "out": torch.nn.Linear(D, D), "ln2": torch.nn.LayerNorm(D),
            "ff1": torch.nn.Linear(D, cfg.d_ff), "ff2": torch.nn.Linear(cfg.d_ff, D),
        }) for _ in range(cfg.n_layers))
        self.ln_f = torch.nn.LayerNorm(D)
        self.head = torch.nn.Linear(D, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, vocab]."""
        B, T = tokens.shape
        x = self.embed(tokens) + self.pos(torch.arange(T, device=tokens.device))
        drop = self.dropout if self.training else 0.0
        for b in self.blocks:
            q, k, v = b["qkv"](b["ln1"](x)).view(B, T, 3, self.n_heads, -1).unbind(2)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), dropout_p=drop,
                                               is_causal=True)
            x = x + F.dropout(b["out"](a.transpose(1, 2).reshape(B, T, -1)), drop,
                              self.training)
            h = F.dropout(F.gelu(b["ff1"](b["ln2"](x))), drop, self.training)
            x = x + F.dropout(b["ff2"](h), drop, self.training)
        return self.head(self.ln_f(x))


def profile_split(entry: Entry, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """One training step of ``entry`` under torch.profiler: its self CPU time in ms, summed
    over threads, as the sweeps' own time, matmuls, copies, other and total (SWEEP_MARKS,
    MATMULS, COPIES)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        entry.step(x, y)
    split = dict.fromkeys(("sweeps_own", "matmuls", "copies", "other"), 0.0)
    for event in prof.key_averages():
        part = ("sweeps_own" if event.key in SWEEP_MARKS else "matmuls" if event.key in MATMULS
                else "copies" if event.key in COPIES else "other")
        split[part] += event.self_cpu_time_total / 1000
    split["total"] = sum(split.values())
    return split


def make_entries(device: torch.device, precision: torch.dtype | None,
                 with_reference: bool, sizes: dict | None = None,
                 gpt_len: int = 0, with_one_slot: bool = False) -> list[Entry]:
    """The timed entries (see the module docstring); a GPT with ``gpt_len`` positions
    where that is set, and feedback_kv at a one-slot window with ``with_one_slot``."""
    entries = []
    for kind in ("feedback_kv", "feedback"):
        torch.manual_seed(0)
        fast = build_model(model_config(kind, sizes), VOCAB).to(device)
        if with_reference:
            slow = copy.deepcopy(fast)  # same weights, its own optimizer
            entries.append(Entry(f"reference_{kind}", slow,
                                 lambda x, m=slow: reference_forward(m, x), device, precision))
        entries.append(Entry(kind, fast, lambda x, m=fast: m(x)[0], device, precision))
    if with_one_slot:
        torch.manual_seed(0)
        one_slot = build_model(model_config("feedback_kv", {**(sizes or SIZES), "max_rel_pos": 1}),
                               VOCAB).to(device)
        entries.append(Entry(ONE_SLOT, one_slot, lambda x, m=one_slot: m(x)[0], device,
                             precision))
    torch.manual_seed(0)
    transformer = build_model(model_config("transformer", sizes), VOCAB).to(device)
    entries.append(Entry("transformer", transformer, lambda x, m=transformer: m(x)[0],
                         device, precision))
    if gpt_len:
        torch.manual_seed(0)
        gpt = GPT(model_config("transformer", sizes), VOCAB, gpt_len).to(device)
        entries.append(Entry("gpt", gpt, gpt, device, precision))
    return entries


def time_steps(seq_len: int, repeats: int, warmup: int, device: torch.device,
               precision: torch.dtype | None, with_reference: bool,
               sizes: dict | None = None, batch: int = BATCH,
               with_gpt: bool = False, profile: bool = False) -> dict[str, dict]:
    """Median ms/step and tokens/s of every entry (interleaved), at ``sizes`` and ``batch``
    (default: the benchmark's); ``with_gpt`` adds the GPT entry, ``profile`` the one-slot
    entry and the split of one more step of each entry in PROFILED (``profile_ms``:
    :func:`profile_split`)."""
    entries = make_entries(device, precision, with_reference, sizes,
                           seq_len if with_gpt else 0, with_one_slot=profile)
    gen = torch.Generator().manual_seed(seq_len)
    x = torch.randint(0, VOCAB, (batch, seq_len), generator=gen).to(device)
    y = torch.randint(0, VOCAB, (batch, seq_len), generator=gen).to(device)
    for _ in range(warmup):
        for e in entries:
            e.step(x, y)
    for r in range(repeats):
        # Rotate the order so no entry always runs first (or right after the slowest one).
        for e in entries[r % len(entries):] + entries[:r % len(entries)]:
            e.times.append(e.step(x, y))
    out = {}
    for e in entries:
        ms = statistics.median(e.times) * 1000
        out[e.name] = {"ms_per_step": ms, "tokens_per_sec": batch * seq_len / ms * 1000,
                       "steps_timed": len(e.times)}
        if profile and e.name in PROFILED:
            out[e.name]["profile_ms"] = profile_split(e, x, y)
    return out


def peak_step_memory_mb(kind: str, seq_len: int, device: torch.device,
                        sizes: dict | None = None, batch: int = BATCH,
                        precision: torch.dtype | None = None) -> float:
    """Peak memory a training step adds, in MiB: CUDA allocator stats on a GPU (at ``sizes``,
    ``batch`` and ``precision``); on the CPU the growth of the process's peak RSS during one
    step at the benchmark's sizes, measured in a fresh process."""
    if device.type == "cuda":
        torch.manual_seed(0)
        entry = Entry(kind, build_model(model_config(kind, sizes), VOCAB).to(device),
                      lambda x: None, device, precision)
        entry.forward = lambda x, m=entry.model: m(x)[0]
        x = torch.randint(0, VOCAB, (batch, seq_len), device=device)
        entry.step(x, x)  # optimizer state exists from here on
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        entry.step(x, x)
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    out = subprocess.run([sys.executable, __file__, "--_memory-probe", kind, str(seq_len)],
                         capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _memory_probe(kind: str, seq_len: int) -> None:
    """Child process of peak_step_memory_mb: print the MiB one CPU training step adds."""
    torch.manual_seed(0)
    model = build_model(model_config(kind), VOCAB)
    opt = trainer_optimizer(model, torch.device("cpu"))
    for p in model.parameters():  # allocate the optimizer state before measuring
        p.grad = torch.zeros_like(p)
    opt.step()

    def step(x: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x)[0].reshape(-1, VOCAB), x.reshape(-1)).backward()
        opt.step()

    # A tiny step first: one-time allocations (thread pools, BLAS buffers) are not the step's.
    step(torch.randint(0, VOCAB, (BATCH, 4)))
    # Reset the peak-RSS mark (ru_maxrss would also carry the parent's peak across exec).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base_kib = _proc_status_kib("VmRSS")
    step(torch.randint(0, VOCAB, (BATCH, seq_len)))
    print((_proc_status_kib("VmHWM") - base_kib) / 1024)


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def print_profile(splits: dict[str, dict[str, float]]) -> None:
    """The --profile table: each entry's split of one step (ms and share of its total)."""
    parts = ("sweeps_own", "matmuls", "copies", "other")
    print("  profile of one step, self CPU ms summed over threads (share of the total):")
    print(f"  {'model':12s}" + "".join(f"{p:>16s}" for p in parts) + f"{'total':>9s}")
    for name, split in splits.items():
        cells = "".join(f"{split[p]:9.1f} ({split[p] / split['total']:3.0%})" for p in parts)
        print(f"  {name:12s}{cells}{split['total']:9.1f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="*", default=[64, 256])
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per entry")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per entry")
    parser.add_argument("--memory-seq-lens", type=int, nargs="*", default=[64, 128, 256, 512])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--no-reference", action="store_true", help="skip the slow reference")
    parser.add_argument("--profile", action="store_true",
                        help="split one step of feedback_kv, the transformer and the GPT "
                             "into the core's sweeps' own time, matmuls, copies and other")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time steps by the process's CPU time, not the wall clock (a CPU "
                             "shared with other jobs then does not count their turns; with "
                             "OMP_NUM_THREADS=1 it is the step's own time)")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    parser.add_argument("--_memory-probe", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._memory_probe:
        _memory_probe(args._memory_probe[0], int(args._memory_probe[1]))
        return 0

    device = resolve_device(args.device)
    if args.cpu_time and device.type != "cpu":
        parser.error(f"--cpu-time times the CPU's work only, not {device.type}'s: drop it there")
    Entry.clock = time.process_time if args.cpu_time else time.perf_counter
    precision = torch.bfloat16 if device.type == "cuda" else None
    report: dict = {
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "precision": "bf16 autocast" if precision else "fp32",
        "clock": "process CPU time" if Entry.clock is time.process_time else "wall",
        "sizes": {**SIZES, "vocab": VOCAB, "batch": BATCH}, "timings": {}, "gpt": {},
        "memory_mb": {},
    }
    print(f"device {report['device']} ({report['threads']} threads), {report['precision']}, "
          f"torch {torch.__version__}, {report['clock']} clock; sizes {report['sizes']}")
    exact = {kind: check_exact(kind) for kind in ("feedback_kv", "feedback")}
    report["exactness_max_abs_diff"] = exact
    ok = True
    for kind, diff in exact.items():
        good = diff < 1e-9
        ok &= good
        print(f"exactness {kind:12s} max |fbtrain - reference| (loss, grads, float64) = "
              f"{diff:.2e}  {'PASS' if good else 'FAIL'}")

    for seq_len in args.seq_lens:
        result = time_steps(seq_len, args.repeats, args.warmup, device, precision,
                            not args.no_reference, with_gpt=True, profile=args.profile)
        gpt = result.pop("gpt")
        for kind in ("feedback_kv", "transformer", ONE_SLOT):
            if kind in result:
                gpt[f"{kind}_over_gpt"] = result[kind]["ms_per_step"] / gpt["ms_per_step"]
        report["timings"][seq_len] = result
        report["gpt"][seq_len] = gpt
        print(f"\nseq_len {seq_len}, batch {BATCH}: median of {args.repeats} steps")
        print(f"  {'model':22s} {'ms/step':>9s} {'tokens/s':>10s}")
        for name, r in [*result.items(), ("gpt", gpt)]:
            print(f"  {name:22s} {r['ms_per_step']:9.1f} {r['tokens_per_sec']:10.0f}")
        for kind in ("feedback_kv", "transformer"):
            print(f"  {kind:12s} {gpt[f'{kind}_over_gpt']:5.2f}x the GPT's step time "
                  "(same sizes, causal scaled_dot_product_attention, learned positions)")
        if args.profile:
            attention = 1 - result[ONE_SLOT]["ms_per_step"] / result["feedback_kv"]["ms_per_step"]
            print(f"  {ONE_SLOT} {gpt[f'{ONE_SLOT}_over_gpt']:5.2f}x the GPT's step time: "
                  f"feedback_kv without its window attention (which is {attention:.0%} of "
                  "its step)")
            print_profile({name: r["profile_ms"] for name, r in [*result.items(), ("gpt", gpt)]
                           if "profile_ms" in r})
        for kind in ("feedback_kv", "feedback"):
            ms = result[kind]["ms_per_step"]
            vs_tf = ms / result["transformer"]["ms_per_step"]
            line = f"  {kind:12s} {vs_tf:5.2f}x the transformer's step time"
            if f"reference_{kind}" in result:
                speedup = result[f"reference_{kind}"]["ms_per_step"] / ms
                good = speedup >= TARGET_VS_REFERENCE
                ok &= good
                line += (f"; {speedup:5.2f}x faster than its reference "
                         f"(target >= {TARGET_VS_REFERENCE:g}x: {'PASS' if good else 'FAIL'})")
                result[kind]["speedup_vs_reference"] = speedup
            result[kind]["slowdown_vs_transformer"] = vs_tf
            print(line)
        if seq_len == 64:
            vs_tf = result["feedback_kv"]["slowdown_vs_transformer"]
            print(f"  aim: feedback_kv within {AIM_VS_TRANSFORMER:g}x of the transformer at "
                  f"seq_len 64: {'met' if vs_tf <= AIM_VS_TRANSFORMER else 'not met'} "
                  f"({vs_tf:.2f}x)")

    if args.memory_seq_lens:
        print(f"\npeak memory of one training step (MiB), batch {BATCH}")
        print(f"  {'model':12s}" + "".join(f"{n:>9d}" for n in args.memory_seq_lens)
              + "   MiB per 1k tokens")
        for kind in ("feedback_kv", "feedback", "transformer"):
            mem = {n: peak_step_memory_mb(kind, n, device) for n in args.memory_seq_lens}
            report["memory_mb"][kind] = mem
            per_k = [mem[n] / (BATCH * n) * 1000 for n in args.memory_seq_lens]
            print(f"  {kind:12s}" + "".join(f"{mem[n]:9.1f}" for n in args.memory_seq_lens)
                  + "   " + " ".join(f"{v:.1f}" for v in per_k))

    checked_speed = bool(args.seq_lens) and not args.no_reference
    report["all_targets_met"] = ok if checked_speed else None
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"\nwrote {args.json}")
    if not checked_speed:
        print("\nexactness " + ("passed" if ok else "FAILED") + "; speed targets not checked "
              "(no reference timed)")
    else:
        print("\nALL TARGETS MET" if ok else "\nSOME TARGETS MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
