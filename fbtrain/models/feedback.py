"""The Feedback Transformer (Fan et al. 2020): every layer at step t attends to m_0..m_{t-1}.

``m_t = sum_l softmax(w)_l h_t^l`` mixes the embedding and all layer outputs of step t, so
the lowest layer sees the highest representations of the past. ``kind: feedback`` gives every
layer its own key/value projection of memory (computed for all layers in one matmul when the
slot is created); ``kind: feedback_kv`` shares one pair, so each step adds one key/value.
With ``memory_norm: layernorm`` keys and values project ``LayerNorm(m_t)`` (as the paper's
code does): each layer's own pre-attention LayerNorm for ``feedback``, one shared
``mem_norm`` for ``feedback_kv``. The step loop itself is in ``core/`` (C++, or the
PyTorch fallback).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fbtrain.config import ModelConfig
from fbtrain.config.kinds import model_kind
from fbtrain.models.core.autograd import FeedbackCoreFunction, flatten_layers
from fbtrain.models.core.select import core
from fbtrain.models.core.spec import CoreInputs, CoreSpec
from fbtrain.models.layers import Layer, init_weights
from fbtrain.models.state import MemoryState, kept_sources

# memory_init: embedding: the embedding's share of m_t at step 0 (the layers share the rest).
EMBEDDING_SHARE = 0.95


def initial_memory_logits(n_layers: int, memory_init: str) -> Tensor:
    """The memory-mix logits w ``[n_layers + 1]`` a model starts from.

    ``uniform``: all equal (the seed's ones; softmax 1 / (n_layers + 1) each). ``embedding``:
    softmax(w)_0 = EMBEDDING_SHARE, the rest shared equally by the layers, so at first memory
    holds the tokens (what a transformer's first layer reads) rather than a mix dominated
    by the layers' untrained outputs, which with carried memory fold the whole history into
    every slot; training then sets the mix (the weights are trainable, never decayed).
    """
    logits = torch.ones(n_layers + 1)  # build_model has checked memory_init is a known one
    if memory_init == "embedding":
        share = EMBEDDING_SHARE
        logits[0] += math.log(share / (1 - share) * n_layers)
    return logits


class FeedbackTransformer(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        # The core is chosen (and the C++ one built, on first use) now, not at the first
        # step: a bad $FBTRAIN_CORE is an error before training starts, and a build is
        # waited for while Ctrl-C still interrupts (the trainer defers it in its loop).
        core()
        self.cfg = cfg
        self.shared_kv = model_kind(cfg.kind).shared_kv  # feedback_kv: one set for all
        d = cfg.d_model
        self.embed = nn.Embedding(vocab_size, d)
        self.layers = nn.ModuleList(
            Layer(d, cfg.n_heads, cfg.d_ff, cfg.max_rel_pos, own_kv=not self.shared_kv)
            for _ in range(cfg.n_layers)
        )
        self.memory_norm = cfg.memory_norm == "layernorm"
        if self.shared_kv:
            self.key = nn.Linear(d, d, bias=False)
            self.value = nn.Linear(d, d, bias=False)
            if self.memory_norm:
                self.mem_norm = nn.LayerNorm(d)
        self.mem_weights = nn.Parameter(initial_memory_logits(cfg.n_layers, cfg.memory_init))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab_size)
        init_weights(self, cfg.position_init)
        # Folded tables by window size, inside a frozen_weights() block (None outside).
        self._folded: dict[int, tuple] | None = None

    def memory_weights(self) -> Tensor:
        """softmax(w): [n_layers + 1], the share of the embedding and each layer in memory."""
        return torch.softmax(self.mem_weights, dim=0)

    def empty_state(self, batch: int, like: Tensor) -> MemoryState:
        n_sets = 1 if self.shared_kv else self.cfg.n_layers
        dk = self.cfg.d_model // self.cfg.n_heads
        empty = like.new_zeros(n_sets, batch * self.cfg.n_heads, 0, dk)
        return MemoryState(empty, empty, 0)

    def core_params(self, n_pos: int) -> tuple[list[dict[str, Tensor]], Tensor, Tensor | None]:
        """Per-layer tensors for the core (constants folded; see RelativeAttention.folded),
        the memory key/value projection ``wkv`` [D, 2*n_sets*D] and its bias (or None).

        With memory norm the core projects the affine-free ``norm(m)``, and the LayerNorm's
        weight g and bias b are folded in here: ``(norm(m) * g + b) @ W = norm(m) @ (g W) +
        b @ W``, so the core needs no per-set LayerNorm parameters."""
        layers = []
        for layer in self.layers:
            fa = layer.attn.folded(n_pos)
            layers.append({
                "ln1_w": layer.ln1.weight, "ln1_b": layer.ln1.bias,
                "wq": fa.wq, "uq": fa.uq, "rt": fa.rt, "c": fa.c,
                "wo_t": layer.attn.out.weight.t(), "bo": layer.attn.out.bias,
                "ln2_w": layer.ln2.weight, "ln2_b": layer.ln2.bias,
                "w1_t": layer.ff1.weight.t(), "b1": layer.ff1.bias,
                "w2_t": layer.ff2.weight.t(), "b2": layer.ff2.bias,
            })
        if self.shared_kv:
            wkv = torch.cat([self.key.weight.t(), self.value.weight.t()], 1)  # [D, 2D]
            if not self.memory_norm:
                return layers, wkv, None
            norm = self.mem_norm
            return layers, norm.weight[:, None] * wkv, norm.bias @ wkv
        attns = [layer.attn for layer in self.layers]
        w_k = [a.key.weight.t() for a in attns]  # [D, D] each
        w_v = [a.value.weight.t() for a in attns]
        b_k = [w.new_zeros(self.cfg.d_model) for w in w_k]
        b_v = [a.value.bias for a in attns]
        if self.memory_norm:  # each layer's keys/values read memory through its own ln1
            norms = [layer.ln1 for layer in self.layers]
            b_k = [n.bias @ w for n, w in zip(norms, w_k, strict=True)]
            b_v = [n.bias @ w + b for n, w, b in zip(norms, w_v, b_v, strict=True)]
            w_k = [n.weight[:, None] * w for n, w in zip(norms, w_k, strict=True)]
            w_v = [n.weight[:, None] * w for n, w in zip(norms, w_v, strict=True)]
        return layers, torch.cat(w_k + w_v, 1), torch.cat(b_k + b_v)

    @contextmanager
    def frozen_weights(self) -> Iterator[None]:
        """Promise that the weights do not change inside the block: no-grad calls then fold
        the constants (:meth:`core_params`) once per window size and reuse them. Decoding
        calls the model once per character, and re-folding every table each time would cost
        as much as the step itself. (A key on the tensors' version counters would not do:
        fused optimizers update weights in place without bumping them.)"""
        outer, self._folded = self._folded, {}
        try:
            yield
        finally:
            self._folded = outer

    def _no_grad_params(self, n_pos: int) -> tuple[list[dict[str, Tensor]], Tensor,
                                                   Tensor | None]:
        if self._folded is None:
            return self.core_params(n_pos)
        if n_pos not in self._folded:
            self._folded[n_pos] = self.core_params(n_pos)
        return self._folded[n_pos]

    def forward(self, tokens: Tensor, state: MemoryState | None = None
                ) -> tuple[Tensor, MemoryState]:
        """tokens: [B, T] -> logits [B, T, vocab] and the memory after the last token.

        Feeding a sequence in chunks, carrying ``state``, gives the logits of one call.
        """
        batch, steps = tokens.shape
        x0 = self.embed(tokens)
        if state is None:
            state = self.empty_state(batch, x0)
        window = self.cfg.memory_window
        n_pos = max(1, min(state.slots + steps, window))
        spec = CoreSpec(
            n_layers=self.cfg.n_layers, n_heads=self.cfg.n_heads, shared_kv=self.shared_kv,
            window=window, dropout=self.cfg.dropout if self.training else 0.0,
            memory_norm=self.memory_norm,
        )
        # The core runs in the embedding's dtype even under autocast: its hand-written
        # backward and the memory it accumulates over many steps want one precision. So do
        # the tables folded for it (a bias @ weight is a matmul, which autocast would lower).
        with torch.autocast(device_type=x0.device.type, enabled=False):
            if torch.is_grad_enabled():
                layers, wkv, bkv = self.core_params(n_pos)
            else:  # a power of two, so one-token decoding calls reuse the cached tables
                n_pos = min(window, 1 << (n_pos - 1).bit_length())
                layers, wkv, bkv = self._no_grad_params(n_pos)
            mem_k, mem_v = self._carried_keys_values(state, x0.dtype, wkv, bkv, spec.eps)
            top, keys, values, memory = self._core(spec, x0, mem_k, mem_v, layers, wkv, bkv)
        logits = self.head(self.ln_f(top))
        sources = kept_sources(state, memory.unsqueeze(0), window)
        return logits, MemoryState(keys, values, state.steps + steps, sources)

    def _carried_keys_values(self, state: MemoryState, dtype: torch.dtype, wkv: Tensor,
                             bkv: Tensor | None, eps: float) -> tuple[Tensor, Tensor]:
        """Keys and values [n_sets, B*H, n0, d_k] of the carried slots: projected from the
        state's memory vectors with the current weights (as the core projects a new slot)
        when it has them, else as carried (see MemoryState)."""
        if state.sources is None or not state.slots:
            return state.keys.to(dtype), state.values.to(dtype)
        memory = state.sources[0].to(dtype)  # [B, n0, D]
        if self.memory_norm:  # affine-free: the LayerNorm's affine part is folded into wkv
            memory = F.layer_norm(memory, memory.shape[-1:], eps=eps)
        kv = memory @ wkv if bkv is None else torch.addmm(bkv, memory.flatten(0, 1), wkv)
        batch, n0 = memory.shape[:2]
        heads, n_sets = self.cfg.n_heads, state.keys.shape[0]
        # [B, n0, (key|value), set, H, dk] -> [(key|value), set, B, H, n0, dk]
        kv = kv.view(batch, n0, 2, n_sets, heads, -1).permute(2, 3, 0, 4, 1, 5)
        return (kv[0].reshape(n_sets, batch * heads, n0, -1),
                kv[1].reshape(n_sets, batch * heads, n0, -1))

    def _core(self, spec: CoreSpec, x0: Tensor, mem_k: Tensor, mem_v: Tensor,
              layers: list[dict[str, Tensor]], wkv: Tensor, bkv: Tensor | None
              ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Last layer's output [B, T, D], the newest ``window`` memory keys/values and this
        call's memory vectors [B, T, D]."""
        inputs = CoreInputs(x0, mem_k, mem_v, self.memory_weights(), wkv, bkv,
                            flatten_layers(layers))
        if torch.is_grad_enabled():
            return FeedbackCoreFunction.apply(spec, *inputs.flat())
        hidden, memory, keys, values, _ = core().core_forward(spec, inputs)
        window = spec.window
        return (hidden[:, -1].transpose(0, 1), keys[:, :, -window:], values[:, :, -window:],
                memory.transpose(0, 1))
