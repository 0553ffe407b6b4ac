"""What sampling needs in memory, checked before it starts: the output and its decoded text
on the host, the prompt pass and the carried memory on the model's device
(:func:`sampling_bytes`), against what this process may use (:func:`check_memory`): a
request that can never finish is one line, not an allocation failure minutes in.
"""

from __future__ import annotations

import torch
from torch import nn

from fbtrain.config.budget import available_memory
from fbtrain.config.kinds import model_kind
from fbtrain.config.limits import MACHINE
from fbtrain.data.tokenizers import Tokenizer
from fbtrain.errors import ArgumentError
from fbtrain.messages import format_bytes

# Bytes the sampling loop keeps per generated token outside the model: the int64 output
# tensor, plus the decoded text (a Python str stores up to 4 bytes per character).
_OUT_BYTES = 8
_CHAR_BYTES = 4
_FLOAT_BYTES = 4  # the model runs in float32 when sampling


def sampling_bytes(model: nn.Module, tokenizer: Tokenizer, prompt_tokens: int,
                   num_samples: int, length: int) -> tuple[int, int]:
    """About how much memory :func:`generate` needs: ``(host bytes, model bytes)``.

    Host: the output ids and their decoded text (``num_samples x length`` tokens). Model
    (on the model's device): the larger of the prompt pass (the kind's own count,
    :attr:`~fbtrain.config.kinds.ModelKind.prompt_pass`: linear in the prompt for the
    feedback models, which read it a token at a time; the transformer's attention scores
    grow with its square) and the decoding that follows, which holds per sample the
    carried memory window (keys and values, twice while a step builds the next window).
    Meant to refuse only what cannot work: scripts/sample_memory.py holds it against the
    real peak (docs/performance.md). A model without a ``cfg`` (not built by fbtrain)
    counts as needing no model memory.
    """
    widest = max((len(t) for t in tokenizer.tokens), default=1) + len(tokenizer.joiner)
    host = num_samples * length * (_OUT_BYTES + _CHAR_BYTES * widest)
    cfg = getattr(model, "cfg", None)
    if cfg is None:
        return host, 0
    kind = model_kind(cfg.kind)
    state = num_samples * 2 * 2 * kind.key_value_sets(cfg) * cfg.memory_window * cfg.d_model
    prompt = kind.prompt_pass(cfg, num_samples, max(prompt_tokens, 1), tokenizer.vocab_size)
    return host, max(state, prompt) * _FLOAT_BYTES


def memory_bytes(device: torch.device | str = "cpu") -> int | None:
    """The memory of ``device``: for the CPU what this process may use (the least of the
    machine's physical memory, RLIMIT_AS and the cgroup limit), the card's for CUDA; None
    when the platform does not say."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    limit = available_memory()
    return limit.size if limit is not None else None


def _host_name() -> str:
    """Whose memory :func:`memory_bytes` gives for the CPU, as a message names it."""
    limit = available_memory()
    if limit is None or limit.holder == MACHINE:
        return "this machine"
    return f"this process's memory limit{limit.how}"


def check_memory(model: nn.Module, tokenizer: Tokenizer, prompt_tokens: int,
                 num_samples: int, length: int, device: torch.device | str) -> None:
    """Raise ArgumentError (one line) when ``num_samples x length`` tokens after a prompt of
    ``prompt_tokens`` cannot fit in memory, naming the prompt when it alone is too long.

    The bound is the memory there is (what this process may use for the output, the model's
    device's for its state; both the process's on a CPU), not what happens to be free: a
    request over it can never finish, one under it may still have to wait for other programs
    to give way.
    """
    over = _over_memory(model, tokenizer, prompt_tokens, num_samples, length, device)
    if over is None:
        return
    need, have, where = over
    if prompt_tokens > 1 and _over_memory(model, tokenizer, 1, num_samples, length,
                                          device) is None:
        what = (f"a prompt of {prompt_tokens:,} {tokenizer.unit}s x num_samples = "
                f"{num_samples}")
        fix = "shorten the prompt" + (" or lower num_samples" if num_samples > 1 else "")
    else:
        what, fix = f"num_samples = {num_samples} x length = {length}", \
            "lower num_samples or length"
    raise ArgumentError(f"{what}: sampling needs about {format_bytes(need)} of memory, more "
                        f"than the {format_bytes(have)} of {where}; {fix}")


def _over_memory(model: nn.Module, tokenizer: Tokenizer, prompt_tokens: int,
                 num_samples: int, length: int, device: torch.device | str
                 ) -> tuple[int, int, str] | None:
    """(bytes needed, bytes there, whose) of the first memory sampling would not fit in;
    None when it fits (or the platform does not say)."""
    host, on_model = sampling_bytes(model, tokenizer, prompt_tokens, num_samples, length)
    device = torch.device(device)
    needs = [(host + on_model, memory_bytes("cpu"), _host_name())]
    if device.type == "cuda":
        needs = [(host, memory_bytes("cpu"), _host_name()),
                 (on_model, memory_bytes(device), str(device))]
    for need, have, where in needs:
        if have is not None and need > have:
            return need, have, where
    return None


def model_device(model: nn.Module) -> torch.device:
    """Where ``model``'s weights are (the CPU for a model without any)."""
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")
