"""Peak memory of sampling from a long prompt, against the estimate ``fbtrain sample``
refuses by (``fbtrain.sample_budget.sampling_bytes``).

    python scripts/sample_memory.py --prompts 10000 50000 100000
    python scripts/sample_memory.py --config configs/tiny_shakespeare.yaml --prompts 20000

For each model kind at the config's sizes (random weights, a 65-character vocabulary) and
each prompt length, a fresh process (``--child``) builds the model, resets its peak
resident size (Linux's ``/proc/self/clear_refs``), then generates ``--length`` characters
after the prompt; the report is the growth of the peak resident size (VmHWM) beside the
estimate, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

KINDS = ("feedback_kv", "feedback", "transformer")
ROOT = Path(__file__).resolve().parents[1]


def vm(key: str) -> int:
    """This process's ``key`` (VmRSS, VmHWM) from /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def child(config: str, kind: str, prompt_tokens: int, length: int) -> None:
    """Sample once; print one JSON line: the peak growth and the estimate, in bytes."""
    import dataclasses

    import torch

    import fbtrain.sample
    from fbtrain.config import load_config
    from fbtrain.data.tokenizers import CharTokenizer
    from fbtrain.models import build_model
    from fbtrain.sample import generate
    from fbtrain.sample_budget import sampling_bytes

    fbtrain.sample.check_memory = lambda *args: None  # measured, not refused

    torch.set_num_threads(1)
    cfg = load_config(config, [])
    tokenizer = CharTokenizer([chr(32 + i) for i in range(65)])
    model = build_model(dataclasses.replace(cfg.model, kind=kind, dropout=0.0), 65).eval()
    prompt = "".join(tokenizer.tokens[i % 65] for i in range(prompt_tokens))
    host, on_model = sampling_bytes(model, tokenizer, prompt_tokens, 1, length)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux 4.0+)
    before = vm("VmRSS")
    generate(model, tokenizer, prompt, length, generator=torch.Generator().manual_seed(0))
    print(json.dumps({"growth": vm("VmHWM") - before, "estimate": host + on_model}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "tiny.yaml"),
                        help="the model's sizes (its model: section)")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--prompts", type=int, nargs="+", default=[10_000, 50_000, 100_000],
                        help="prompt lengths, in tokens")
    parser.add_argument("--length", type=int, default=10, help="tokens generated after it")
    parser.add_argument("--json", metavar="FILE", help="also write the report here")
    parser.add_argument("--child", nargs=3, metavar=("KIND", "PROMPT", "LENGTH"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, prompt, length = args.child
        child(args.config, kind, int(prompt), int(length))
        return 0
    report = []
    for kind in args.kinds:
        for prompt in args.prompts:
            proc = subprocess.run([sys.executable, __file__, "--config", args.config,
                                   "--child", kind, str(prompt), str(args.length)],
                                  capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                print(proc.stderr, file=sys.stderr)
                return 1
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            r.update(kind=kind, prompt=prompt, ratio=r["estimate"] / max(1, r["growth"]))
            report.append(r)
            print(f"{kind:>11} prompt {prompt:>7,}: peak +{r['growth'] / 2**20:8.1f} MiB, "
                  f"estimate {r['estimate'] / 2**20:8.1f} MiB ({r['ratio']:.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
