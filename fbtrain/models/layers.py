"""Parameters shared by every model kind: one pre-norm layer, its attention and its FF block.

The modules here only *hold* parameters (and give them stable names, so a ``transformer``
checkpoint can warm-start a feedback model tensor by tensor); the arithmetic lives in
``core/`` (sequential) and ``transformer.py`` (parallel).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn


class RelativeAttention(nn.Module):
    """Attention parameters of one layer: scores ``((q+u).k_j + q.r_{t-j} + b_{t-j}) / sqrt(d_k)``.

    ``r[max_rel_pos - o]`` and ``b[max_rel_pos - o]`` belong to offset ``o = t - j`` (1 is the
    newest slot), so the rows a window of ``n`` slots needs are the contiguous tail ``r[-n:]``.
    ``key``/``value`` exist when the layer projects memory itself (``feedback``,
    ``transformer``); ``feedback_kv`` shares one pair across layers instead.
    """

    def __init__(self, d_model: int, n_heads: int, max_rel_pos: int, own_kv: bool):
        super().__init__()
        self.n_heads, self.d_head = n_heads, d_model // n_heads
        self.query = nn.Linear(d_model, d_model, bias=False)
        self.u = nn.Parameter(torch.zeros(n_heads, self.d_head))
        self.r = nn.Parameter(torch.zeros(max_rel_pos, n_heads, self.d_head))
        self.b = nn.Parameter(torch.zeros(max_rel_pos, n_heads))
        self.out = nn.Linear(d_model, d_model)
        if own_kv:
            self.key = nn.Linear(d_model, d_model, bias=False)
            self.value = nn.Linear(d_model, d_model, bias=True)

    def folded(self, n_pos: int) -> FoldedAttention:
        """Constants folded for the step loop, for windows of up to ``n_pos`` slots.

        Returns query weight/bias with 1/sqrt(d_k) and ``u`` folded in (``qu = a @ wq + uq``
        is ``(q + u) / sqrt(d_k)``), and since ``q.r = (q+u).r - u.r`` the position term
        becomes ``qu . r_o + c_o`` with ``c_o = (b_o - u.r_o) / sqrt(d_k)``: one key-like
        table ``rt`` [heads, d_k, n_pos] and one bias ``c`` [heads, 1, n_pos], both ordered
        by slot (largest offset first). Differentiable: gradients reach the raw parameters.
        """
        scale = 1.0 / math.sqrt(self.d_head)
        r = self.r[self.r.shape[0] - n_pos:]  # [n_pos, H, dk], sliced once per call
        b = self.b[self.b.shape[0] - n_pos:]  # [n_pos, H]
        c = (b - (r * self.u).sum(-1)) * scale  # [n_pos, H]
        return FoldedAttention(
            wq=self.query.weight.t() * scale,  # [D, D]
            uq=self.u.reshape(-1) * scale,  # [D]
            rt=r.permute(1, 2, 0).contiguous(),  # [H, dk, n_pos]
            c=c.t().unsqueeze(1).contiguous(),  # [H, 1, n_pos]
        )


@dataclass
class FoldedAttention:
    wq: Tensor
    uq: Tensor
    rt: Tensor
    c: Tensor


class Layer(nn.Module):
    """Pre-norm layer: ``x + Drop(Attn(LN1(x)))`` then ``x + Drop(FF(LN2(x)))``."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, max_rel_pos: int, own_kv: bool):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = RelativeAttention(d_model, n_heads, max_rel_pos, own_kv)
        self.ln2 = nn.LayerNorm(d_model)
        self.ff1 = nn.Linear(d_model, d_ff)
        self.ff2 = nn.Linear(d_ff, d_model)


def init_weights(model: nn.Module, position_init: str = "zero") -> None:
    """GPT-2 style init: N(0, 0.02) matrices and embeddings, zero biases, LayerNorm (1, 0).

    Position parameters r and u stay zero, and b too unless ``position_init`` is
    ``recency`` (:func:`recency_bias`); memory weights keep the start memory_init gave.
    """
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, RelativeAttention) and position_init == "recency":
            with torch.no_grad():
                module.b.copy_(recency_bias(*module.b.shape, module.d_head))


def recency_bias(max_rel_pos: int, n_heads: int, d_head: int) -> Tensor:
    """The ``recency`` start of b [max_rel_pos, n_heads]: head h (1..H) scores a slot o
    positions back ``-2^(-2h/H) * o`` logits (slopes 0.71, 0.5, 0.35, 0.25 for 4 heads; an
    ALiBi-like prior, ALiBi's own are 2^(-8h/H)), times sqrt(d_k) since the score divides
    b by it.

    Why: under Adam b moves about lr a step, which the 1/sqrt(d_k) makes a logit change of
    lr/sqrt(d_k), so from zero it barely moves in a CPU budget and attention stays spread
    over the whole window. Windows trained from empty memory are short for their first
    tokens, which makes attention local anyway; carried memory fills every window, so
    there it pays to start local (measured: see the README's carried-memory results).
    """
    slopes = 2.0 ** (-2.0 * torch.arange(1, n_heads + 1, dtype=torch.float64) / n_heads)
    offsets = torch.arange(max_rel_pos, 0, -1, dtype=torch.float64)  # row i: offset P - i
    return (-offsets[:, None] * slopes[None, :] * math.sqrt(d_head)).float()
