"""AdamW's step on the CPU: fused (one kernel over all tensors, what the trainer builds)
against torch's foreach and per-tensor loops, on a feedback_kv model's parameters at the
benchmark sizes (docs/performance.md), interleaved step by step. Gradients are random:
the step's cost does not depend on them. Prints the median time of each and the
per-tensor/fused ratio.

    .venv/bin/python scripts/bench_optimizer.py              # 20 steps each
    .venv/bin/python scripts/bench_optimizer.py --steps 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fbtrain.config import ModelConfig
from fbtrain.models import build_model
from fbtrain.train.optim import param_groups

SIZES = dict(kind="feedback_kv", d_model=128, n_heads=4, d_ff=512, n_layers=4,
             max_rel_pos=4096)
VARIANTS = {"fused": {"fused": True}, "foreach": {"foreach": True},
            "per-tensor": {"foreach": False}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    args = parser.parse_args()
    model = build_model(ModelConfig(**SIZES), 65)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizers = {name: torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3, **options)
                  for name, options in VARIANTS.items()}
    for optimizer in optimizers.values():
        optimizer.step()  # warm-up: the state tensors are made on the first step
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for _ in range(args.steps):  # interleaved, so the machine's noise hits each alike
        for name, optimizer in optimizers.items():
            start = time.perf_counter()
            optimizer.step()
            times[name].append(time.perf_counter() - start)
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    for name, value in ms.items():
        print(f"{name:10s} {value:8.2f} ms a step")
    print(f"per-tensor / fused: {ms['per-tensor'] / ms['fused']:.1f}x "
          f"({torch.get_num_threads()} threads)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
