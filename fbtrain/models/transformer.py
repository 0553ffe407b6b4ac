"""The parallel baseline: the same layers, run over all positions at once with a causal mask.

Layer l attends to the *previous layer's outputs* at earlier positions (offsets 1..mem_len;
a position never attends to itself, as in the feedback model) through its own key/value
projections, with the same relative positions. With ``memory_norm: layernorm`` keys and
values project the layer's normalised input ``ln1(x)`` (the usual pre-norm transformer).
Its parameter names match the feedback models', so a transformer checkpoint can warm-start
them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fbtrain.config import ModelConfig
from fbtrain.models.layers import Layer, init_weights
from fbtrain.models.state import MemoryState, kept_sources


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.embed = nn.Embedding(vocab_size, d)
        self.layers = nn.ModuleList(
            Layer(d, cfg.n_heads, cfg.d_ff, cfg.max_rel_pos, own_kv=True)
            for _ in range(cfg.n_layers)
        )
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab_size)
        init_weights(self, cfg.position_init)

    def empty_state(self, batch: int, like: Tensor) -> MemoryState:
        dk = self.cfg.d_model // self.cfg.n_heads
        empty = like.new_zeros(self.cfg.n_layers, batch * self.cfg.n_heads, 0, dk)
        return MemoryState(empty, empty, 0)

    def forward(self, tokens: Tensor, state: MemoryState | None = None
                ) -> tuple[Tensor, MemoryState]:
        """tokens: [B, T] -> logits [B, T, vocab] and the per-layer key/value cache."""
        B, T = tokens.shape
        H, D = self.cfg.n_heads, self.cfg.d_model
        dk, window = D // H, self.cfg.memory_window
        x = self.embed(tokens)  # [B, T, D]
        if state is None:
            state = self.empty_state(B, x)
        n0 = state.slots
        S = n0 + T
        n_pos = max(1, min(S, window))
        # offset[i, j] = (n0 + i) - j between query i of this call and memory slot j.
        offset = (n0 + torch.arange(T, device=x.device))[:, None] - torch.arange(S, device=x.device)
        allowed = (offset >= 1) & (offset <= window)  # [T, S]
        attends = allowed.any(-1)  # [T]: False only for the very first position
        # Rows that see nothing keep finite scores (no NaN); their output is zeroed below.
        blocked = ~allowed & attends[:, None]
        pos_index = (n_pos - offset).clamp(0, n_pos - 1).expand(B, H, T, S)
        new_keys, new_values, inputs = [], [], []  # inputs: each layer's, [B, T, D]
        # Carried layer inputs are re-projected with the current weights (Transformer-XL;
        # see MemoryState).
        reproject = state.sources is not None and n0 > 0
        drop = self.cfg.dropout if self.training else 0.0
        memory_norm = self.cfg.memory_norm == "layernorm"
        for li, layer in enumerate(self.layers):
            attn = layer.attn
            fa = attn.folded(n_pos)
            inputs.append(x)
            a = layer.ln1(x)
            if reproject:
                kv_in = torch.cat([state.sources[li].to(x.dtype), x], 1)  # [B, n0 + T, D]
                kv_in = layer.ln1(kv_in) if memory_norm else kv_in
                keys = attn.key(kv_in).view(B, S, H, dk).transpose(1, 2)  # [B, H, S, dk]
                values = attn.value(kv_in).view(B, S, H, dk).transpose(1, 2)
            else:
                kv_in = a if memory_norm else x  # as the feedback models' memory_norm
                k = attn.key(kv_in).view(B, T, H, dk).transpose(1, 2)  # [B, H, T, dk]
                v = attn.value(kv_in).view(B, T, H, dk).transpose(1, 2)
                keys = torch.cat([state.keys[li].view(B, H, n0, dk).to(x.dtype), k], dim=2)
                values = torch.cat([state.values[li].view(B, H, n0, dk).to(x.dtype), v], dim=2)
            qu = torch.addmm(fa.uq, a.view(B * T, D), fa.wq).view(B, T, H, dk).transpose(1, 2)
            scores = qu @ keys.transpose(2, 3)  # [B, H, T, S]
            by_offset = qu @ fa.rt + fa.c  # [B, H, T, n_pos], largest offset first
            scores = scores + by_offset.gather(-1, pos_index)
            prob = F.dropout(torch.softmax(scores.masked_fill(blocked, float("-inf")), -1),
                             drop, self.training)
            o = (prob @ values).transpose(1, 2).reshape(B, T, D)
            z = attn.out(o) * attends[:, None].to(x.dtype)  # attention skipped on empty memory
            y = x + F.dropout(z, drop, self.training)
            h = F.dropout(F.relu(layer.ff1(layer.ln2(y))), drop, self.training)
            new_keys.append(keys[:, :, -window:].reshape(B * H, -1, dk))
            new_values.append(values[:, :, -window:].reshape(B * H, -1, dk))
            x = y + F.dropout(layer.ff2(h), drop, self.training)
        logits = self.head(self.ln_f(x))
        sources = kept_sources(state, torch.stack(inputs), window)
        return logits, MemoryState(torch.stack(new_keys), torch.stack(new_values),
                                   state.steps + T, sources)
