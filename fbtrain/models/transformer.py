"""The parallel baseline: the same layers, run over all positions at once with a causal mask.

Layer l attends to the *previous layer's outputs* at earlier positions (offsets 1..mem_len;
a position never attends to itself, as in the feedback model) through its own key/value
projections, with the same relative positions. With ``memory_norm: layernorm`` keys and
values project the layer's normalised input ``ln1(x)`` (the usual pre-norm transformer).
Its parameter names match the feedback models', so a transformer checkpoint can warm-start
them.

Attention runs in blocks of query rows (:func:`row_blocks`), each over just the memory
slots and offsets its rows can see, with the relative-position scores ``qu . r_o + c_o``
skewed from offsets to slots as an additive score mask (``-inf`` where a slot is out of
reach, :class:`SlotScores`). Without gradients the block runs in
``F.scaled_dot_product_attention``; with them the scores, softmax and weighted sum are
explicit ATen calls (that kernel would fall back to its unfused path for a mask that needs
a gradient, which costs more than the explicit calls).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fbtrain.config import ModelConfig
from fbtrain.models.layers import FoldedAttention, Layer, init_weights
from fbtrain.models.state import MemoryState, kept_sources

# Query rows per attention block. A block reads only the slots its rows can see, so a call
# of T rows from empty memory does about (1 + block / T) / 2 of the full T x T work; smaller
# blocks cut more but make smaller matmuls.
ROW_BLOCK = 32


@dataclass(frozen=True)
class Block:
    """Query rows [i0, i1) of a call and the memory slots [lo, hi) they read; their offsets
    are 1..n_off, the last n_off columns of the folded position table."""

    i0: int
    i1: int
    lo: int
    hi: int
    n_off: int

    def slot_of_column(self, n0: int) -> int:
        """``base``: row i' (of the block) reads position column ``j' - i' + base`` at slot
        j' (of the block), as offset ``n0 + i - j`` is column ``n_off - offset``."""
        return self.n_off - n0 - self.i0 + self.lo


def row_blocks(T: int, n0: int, window: int, block: int | None) -> list[Block]:
    """Blocks of ``block`` query rows (one block of all T rows over all n0 + T slots where
    ``block`` is None) for a call of T rows after n0 carried slots; a row sees the slots
    1..window steps before it."""
    if block is None:
        S = n0 + T
        return [Block(0, T, 0, S, min(window, S))]
    out = []
    for i0 in range(0, T, block):
        i1 = min(T, i0 + block)
        lo = max(0, n0 + i0 - window)
        # A block of the first position alone sees no slot; it reads slot 0 all the same (its
        # output is zeroed), so every attention parameter gets its zero gradient.
        hi = max(lo + 1, n0 + i1 - 1)
        out.append(Block(i0, i1, lo, hi, min(window, hi - lo)))
    return out


def padded(x: Tensor, left: int, right: int) -> Tensor:
    """x [..., n] -> a new contiguous [..., left + n + right], zeros either side (F.pad may
    return its input, strides and all, when there is nothing to pad)."""
    out = x.new_empty(*x.shape[:-1], left + x.shape[-1] + right)
    out[..., :left].zero_()
    out[..., left:left + x.shape[-1]].copy_(x)
    out[..., left + x.shape[-1]:].zero_()
    return out


class SlotScores(torch.autograd.Function):
    """Position scores by offset [H, B, rows, n_off] -> by slot [B, H, rows, slots]:
    ``out[b, h, i, j] = pos[h, b, i, j - i + base]``, ``-inf`` where ``blocked``.

    A strided view of the padded scores (each row one column further left: the
    Transformer-XL shift) does the forward; the backward reads the gradient back the same
    way, each position column's one slot per row (no scatter: a slot in reach has one
    offset)."""

    @staticmethod
    def forward(ctx, pos: Tensor, base: int, n_slots: int, blocked: Tensor) -> Tensor:
        H, B, rows, n_off = pos.shape
        left = max(0, -base)
        wide = padded(pos, left, 1)  # [H, B, rows, W]
        W = wide.shape[-1]
        by_slot = wide.as_strided((B, H, rows, n_slots), (rows * W, B * rows * W, W - 1, 1),
                                  left + base)
        ctx.geometry = base, n_off
        out = pos.new_empty(B, H, rows, n_slots)  # contiguous, as the scores' matmul takes it
        # -inf made on the device (new_tensor would copy it from the host, a sync on a GPU)
        return torch.where(blocked, pos.new_full((), float("-inf")), by_slot, out=out)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        base, n_off = ctx.geometry
        B, H, rows, n_slots = grad.shape
        left, right = max(0, base), max(0, n_off + rows - 1 - base - n_slots)
        wide = padded(grad.transpose(0, 1), left, right)  # [H, B, rows, W]
        W = wide.shape[-1]
        by_offset = wide.as_strided((H, B, rows, n_off), (B * rows * W, rows * W, W + 1, 1),
                                    left - base)
        return by_offset.contiguous(), None, None, None


def attend(qu: Tensor, keys: Tensor, values: Tensor, fa: FoldedAttention, n0: int,
           window: int, drop: float, training: bool) -> Tensor:
    """Relative-position attention of T query rows over S = n0 + T memory slots.

    qu: [B, H, T, dk] (1/sqrt(dk) and u folded in: FoldedAttention); keys, values:
    [B, H, S, dk], contiguous; fa's tables [H, dk, n_pos], [H, 1, n_pos] with n_pos >=
    min(S, window). Returns [B, H, T, dk]; a row that sees no slot (the first, from empty
    memory) gets finite nonsense, which the caller zeroes. Dropout of the probabilities
    (training) takes one block over all slots: its mask is drawn as [B, H, T, S], as
    the model always drew it, so a seed drops the same entries.
    """
    B, H, T, dk = qu.shape
    n_pos = fa.rt.shape[-1]
    dropping = training and drop > 0
    explicit = dropping or (torch.is_grad_enabled()
                            and any(t.requires_grad for t in (qu, keys, values)))
    q3, k3, v3 = (t.view(B * H, t.shape[2], dk) for t in (qu, keys, values))
    out = []
    for blk in row_blocks(T, n0, window, None if dropping else ROW_BLOCK):
        rows, n_slots = blk.i1 - blk.i0, blk.hi - blk.lo
        i = torch.arange(n0 + blk.i0, n0 + blk.i1, device=qu.device)[:, None]
        offset = i - torch.arange(blk.lo, blk.hi, device=qu.device)
        # Rows that see nothing keep finite scores (no NaN).
        blocked = ((offset < 1) | (offset > window)) & (i > 0)  # [rows, n_slots]
        q = q3[:, blk.i0:blk.i1]  # [B*H, rows, dk]
        q_by_head = q.view(B, H, rows, dk).transpose(0, 1).reshape(H, B * rows, dk)
        cols = slice(n_pos - blk.n_off, n_pos)
        pos = torch.baddbmm(fa.c[..., cols], q_by_head, fa.rt[..., cols])
        mask = SlotScores.apply(pos.view(H, B, rows, blk.n_off), blk.slot_of_column(n0),
                                n_slots, blocked)  # [B, H, rows, n_slots]
        k, v = k3[:, blk.lo:blk.hi], v3[:, blk.lo:blk.hi]
        if explicit:
            scores = torch.baddbmm(mask.view(B * H, rows, n_slots), q, k.transpose(1, 2))
            prob = F.dropout(torch.softmax(scores, -1), drop, training)
            out.append(torch.bmm(prob, v))
        else:
            o = F.scaled_dot_product_attention(q.view(B, H, rows, dk),
                                               k.view(B, H, n_slots, dk),
                                               v.view(B, H, n_slots, dk), attn_mask=mask,
                                               scale=1.0)
            out.append(o.view(B * H, rows, dk))
    return torch.cat(out, 1).view(B, H, T, dk)


def heads(x: Tensor, H: int) -> Tensor:
    """[B, N, H * dk] -> [B, H, N, dk], contiguous (so B and H merge into one batch dim)."""
    B, N, D = x.shape
    return x.view(B, N, H, D // H).transpose(1, 2).contiguous()


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
        # Only the very first position (no carried memory) attends to nothing; its
        # attention output is zeroed.
        attends = (n0 + torch.arange(T, device=x.device) >= 1).to(x.dtype)[:, None]  # [T, 1]
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
                keys, values = heads(attn.key(kv_in), H), heads(attn.value(kv_in), H)
            else:
                kv_in = a if memory_norm else x  # as the feedback models' memory_norm
                keys, values = heads(attn.key(kv_in), H), heads(attn.value(kv_in), H)
                if n0:  # [B, H, S, dk]
                    keys = torch.cat([state.keys[li].view(B, H, n0, dk).to(x.dtype), keys], 2)
                    values = torch.cat([state.values[li].view(B, H, n0, dk).to(x.dtype), values],
                                       2)
            qu = heads(torch.addmm(fa.uq, a.view(B * T, D), fa.wq).view(B, T, D), H)
            o = attend(qu, keys, values, fa, n0, window, drop, self.training)
            o = o.transpose(1, 2).reshape(B, T, D)
            z = attn.out(o) * attends  # attention skipped on empty memory
            y = x + F.dropout(z, drop, self.training)
            h = F.dropout(F.relu(layer.ff1(layer.ln2(y))), drop, self.training)
            new_keys.append(keys[:, :, -window:].reshape(B * H, -1, dk))
            new_values.append(values[:, :, -window:].reshape(B * H, -1, dk))
            x = y + F.dropout(layer.ff2(h), drop, self.training)
        logits = self.head(self.ln_f(x))
        sources = kept_sources(state, torch.stack(inputs), window)
        return logits, MemoryState(torch.stack(new_keys), torch.stack(new_values),
                                   state.steps + T, sources)
