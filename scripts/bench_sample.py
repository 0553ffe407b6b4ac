"""Sampling speed: cached incremental generation against re-running the whole prefix.

The reference design sampled by calling the model on the whole prefix for every new
character (``logits, _ = model(prefix[None])``, keep the last position), so producing n
characters costs O(n^2) model steps. ``fbtrain.sample.generate`` reads the prompt once and
then makes one single-token call per character on the carried ``MemoryState``: O(n) steps.

Both loops run here side by side, in one process, on the same model (random weights: speed
does not depend on training), with the same seed and the same sampling code, on the CPU.
The target is a ratio of at least 50x for feedback_kv; the script exits with status 1 below
that (the figures are printed either way). It also reports the inference cache each past
character costs, measured from the MemoryState tensors left after generation: feedback_kv
keeps one key/value pair (2 * d_model floats) per past step shared by all layers, while
feedback and the transformer keep one pair per layer (2 * d_model * n_layers floats).

    .venv/bin/python scripts/bench_sample.py              # 500 chars, feedback_kv + transformer
    .venv/bin/python scripts/bench_sample.py --kinds feedback_kv feedback transformer \
        --threads 1 --json out.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's fbtrain: it need not be installed

from fbtrain.config import MODEL_KINDS, ModelConfig  # noqa: E402
from fbtrain.data.tokenizers import CharTokenizer  # noqa: E402
from fbtrain.models import MemoryState, build_model, count_parameters  # noqa: E402
from fbtrain.sample import generate, next_tokens  # noqa: E402

# Tiny Shakespeare's 65 characters.
VOCAB = ["\n", " ", "!", "$", "&", "'", ",", "-", ".", "3", ":", ";", "?"] + [
    chr(c) for c in range(ord("A"), ord("Z") + 1)] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
TARGET_RATIO = 50.0
TARGET_CHARS = 500
PROMPT = "\n"


class StateKeeper(nn.Module):
    """Passes calls through to a model and keeps the last MemoryState (to measure it)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.state: MemoryState | None = None

    def forward(self, tokens: Tensor, state: MemoryState | None = None
                ) -> tuple[Tensor, MemoryState]:
        logits, self.state = self.model(tokens, state)
        return logits, self.state


@torch.inference_mode()
def naive_generate(model: nn.Module, tokenizer: CharTokenizer, prompt: str, length: int,
                   temperature: float, generator: torch.Generator) -> str:
    """The reference design's loop: the whole prefix through the model for every character."""
    prefix = tokenizer.encode(prompt)  # [P]
    for _ in range(length):
        logits, _ = model(prefix[None])  # [1, len(prefix), V]: every step recomputed
        token, _ = next_tokens(logits[:, -1], temperature, generator=generator)  # [1]
        prefix = torch.cat([prefix, token])
    return tokenizer.decode(prefix[len(prompt):])


def bench_kind(kind: str, args: argparse.Namespace, tokenizer: CharTokenizer) -> dict:
    torch.manual_seed(args.seed)
    cfg = ModelConfig(kind=kind, d_model=args.d_model, n_heads=args.n_heads, d_ff=args.d_ff,
                      n_layers=args.n_layers, max_rel_pos=args.max_rel_pos)
    model = build_model(cfg, tokenizer.vocab_size).eval()
    keeper = StateKeeper(model)
    # Warm-up (allocator, first-call costs) for both loops, outside the timings.
    generate(model, tokenizer, PROMPT, 8, generator=torch.Generator().manual_seed(0))
    naive_generate(model, tokenizer, PROMPT, 8, 1.0, torch.Generator().manual_seed(0))

    t0 = time.perf_counter()
    fast = generate(keeper, tokenizer, PROMPT, args.chars, temperature=args.temperature,
                    generator=torch.Generator().manual_seed(args.seed))[0]
    fast_s = time.perf_counter() - t0
    state = keeper.state
    assert state is not None

    t0 = time.perf_counter()
    slow = naive_generate(model, tokenizer, PROMPT, args.chars, args.temperature,
                          torch.Generator().manual_seed(args.seed))
    slow_s = time.perf_counter() - t0

    # Cache per past character, from the tensors themselves: [n_sets, batch*heads, slots, dk].
    rows = state.keys.shape[1] // cfg.n_heads  # batch
    floats = (state.keys.numel() + state.values.numel()) / (rows * state.slots)
    return {
        "kind": kind,
        "parameters": count_parameters(model),
        "chars": args.chars,
        "incremental_s": fast_s,
        "naive_s": slow_s,
        "incremental_chars_per_s": args.chars / fast_s,
        "naive_chars_per_s": args.chars / slow_s,
        "ratio": slow_s / fast_s,
        "same_text": fast == slow,
        "state_shape": list(state.keys.shape),
        "state_slots": state.slots,
        "cache_floats_per_char": floats,
        "cache_bytes_per_char": floats * state.keys.element_size(),
        "cache_floats_per_char_in_d_model": floats / cfg.d_model,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chars", type=int, default=500, help="characters to generate (default 500)")
    # feedback is left out by default: its naive loop alone takes about 2 minutes on a CPU.
    p.add_argument("--kinds", nargs="+", default=["feedback_kv", "transformer"],
                   choices=MODEL_KINDS, help="model kinds (default: feedback_kv transformer)")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--d-ff", type=int, default=512)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--max-rel-pos", type=int, default=4096)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    if args.chars < 1:
        p.error("--chars must be >= 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    tokenizer = CharTokenizer(VOCAB)
    print(f"sampling {args.chars} chars on CPU ({platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}); vocab "
          f"{len(VOCAB)}, d_model {args.d_model}, {args.n_heads} heads, d_ff {args.d_ff}, "
          f"{args.n_layers} layers, max_rel_pos {args.max_rel_pos}", flush=True)
    header = (f"{'kind':<12} {'incremental':>14} {'naive':>12} {'ratio':>8} "
              f"{'same text':>9} {'cache/char':>22}")
    print(header)
    results = []
    for kind in args.kinds:
        r = bench_kind(kind, args, tokenizer)
        results.append(r)
        cache = (f"{r['cache_floats_per_char']:.0f} floats "
                 f"({r['cache_floats_per_char_in_d_model']:.0f}*d)")
        print(f"{kind:<12} {r['incremental_chars_per_s']:>8.1f} char/s "
              f"{r['naive_chars_per_s']:>6.2f} char/s {r['ratio']:>7.1f}x "
              f"{'yes' if r['same_text'] else 'no':>9} {cache:>22}", flush=True)
    by_kind = {r["kind"]: r for r in results}
    if "feedback_kv" in by_kind and "transformer" in by_kind:
        share = (by_kind["transformer"]["cache_floats_per_char"]
                 / by_kind["feedback_kv"]["cache_floats_per_char"])
        print(f"feedback_kv's cache per past character is 1/{share:.0f} of the transformer's "
              f"({by_kind['feedback_kv']['cache_bytes_per_char']:.0f} vs "
              f"{by_kind['transformer']['cache_bytes_per_char']:.0f} bytes in fp32)")
    # The naive loop costs O(n^2) steps and the cached one O(n), so the ratio grows with n:
    # the target is set for 500 characters and judged only at that length or more.
    judged = "feedback_kv" in by_kind and args.chars >= TARGET_CHARS
    ok = not judged or by_kind["feedback_kv"]["ratio"] >= TARGET_RATIO
    if judged:
        verdict = "meets" if ok else "MISSES"
        print(f"feedback_kv speed-up {by_kind['feedback_kv']['ratio']:.1f}x {verdict} the "
              f"target of {TARGET_RATIO:.0f}x")
    elif "feedback_kv" in by_kind:
        print(f"(the {TARGET_RATIO:.0f}x target is judged at --chars {TARGET_CHARS} or more)")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "device": "cpu", "threads": torch.get_num_threads(), "torch": torch.__version__,
            "config": {k: getattr(args, k) for k in ("chars", "d_model", "n_heads", "d_ff",
                                                     "n_layers", "max_rel_pos", "temperature",
                                                     "seed")},
            "vocab_size": len(VOCAB), "target_ratio": TARGET_RATIO,
            "target_judged": judged, "meets_target": ok,
            "results": results,
        }, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
