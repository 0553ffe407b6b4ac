"""A slow Feedback Transformer written straight from the equations, with plain autograd.

It follows the seed design's algorithm on purpose: a Python list of memory vectors,
``torch.stack`` of the whole memory at every step, the position tables sliced inside the
step loop, and (``feedback``) every layer re-projecting all of memory at every step, or
(``feedback_kv``) one key/value per step kept in lists and stacked anew each step. It reads
the parameters of a real fbtrain model, so both compute with the same weights; the tests
check the fast core against it, and ``scripts/benchmark.py`` times it as the baseline.
With ``memory_norm: layernorm`` keys and values project LayerNorm(memory): the layer's own
``ln1`` (``feedback``) or the shared ``mem_norm`` (``feedback_kv``), applied as modules.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from fbtrain.models.feedback import FeedbackTransformer


def reference_forward(model: FeedbackTransformer, tokens: Tensor) -> Tensor:
    """tokens [B, T] -> logits [B, T, vocab], one token at a time, from empty memory."""
    cfg = model.cfg
    B, T = tokens.shape
    D, H, L = cfg.d_model, cfg.n_heads, cfg.n_layers
    dk, P, window = D // H, cfg.max_rel_pos, cfg.memory_window
    drop = cfg.dropout if model.training else 0.0
    emb = model.embed(tokens)  # [B, T, D]
    mix = torch.softmax(model.mem_weights, dim=0)  # [L + 1]
    memory: list[Tensor] = []  # m_0 .. m_{t-1}, each [B, D]
    shared_k: list[Tensor] = []  # feedback_kv: k_j, v_j computed once per step
    shared_v: list[Tensor] = []
    logits = []
    for t in range(T):
        x = emb[:, t]
        outputs = [x]  # h_t^0 .. h_t^L
        if memory:  # stacked anew at every step
            if model.shared_kv:
                shared = torch.stack(shared_k[-window:], 1), torch.stack(shared_v[-window:], 1)
            else:
                mem = torch.stack(memory[-window:], dim=1)  # [B, n, D]
        for layer in model.layers:
            attn = layer.attn
            if memory:
                # [B, n, D]; the original variant re-projects all of memory in every layer
                if model.shared_kv:
                    k, v = shared
                else:
                    normed = layer.ln1(mem) if model.memory_norm else mem
                    k, v = attn.key(normed), attn.value(normed)
                n = k.shape[1]
                k, v = k.view(B, n, H, dk), v.view(B, n, H, dk)
                q = attn.query(layer.ln1(x)).view(B, H, dk)
                r = attn.r[P - n:]  # offsets n .. 1 for slots t-n .. t-1: [n, H, dk]
                b = attn.b[P - n:]  # [n, H]
                scores = (
                    torch.einsum("bhd,bjhd->bhj", q + attn.u, k)
                    + torch.einsum("bhd,jhd->bhj", q, r)
                    + b.t()
                ) / math.sqrt(dk)
                p = F.dropout(torch.softmax(scores, dim=-1), drop, model.training)
                o = torch.einsum("bhj,bjhd->bhd", p, v).reshape(B, D)
                x = x + F.dropout(attn.out(o), drop, model.training)
            h = F.dropout(F.relu(layer.ff1(layer.ln2(x))), drop, model.training)
            x = x + F.dropout(layer.ff2(h), drop, model.training)
            outputs.append(x)
        m = sum(mix[i] * outputs[i] for i in range(L + 1))
        memory.append(m)
        if model.shared_kv:
            normed = model.mem_norm(m) if model.memory_norm else m
            shared_k.append(model.key(normed))
            shared_v.append(model.value(normed))
        logits.append(model.head(model.ln_f(x)))
    return torch.stack(logits, dim=1)


def keep_relus_clear_of_zero(model: FeedbackTransformer) -> None:
    """Set each feed-forward block's weights, in place, so that every relu input lies in
    [0.5, 1.5] (even units) or [-1.5, -0.5] (odd units, which stay dead), whatever the
    tokens: ff1's bias +1 or -1, each of its weight rows scaled to norm 0.5 / bound, where
    bound >= |LN2(x)| for any x (sqrt(D) max|gamma| + |beta|), so |LN2(x) . w| <= 0.5 by
    Cauchy-Schwarz; and ff2's bias less ff2's weights times the live units' constant 1, so
    the block still adds a varying term to the residual stream, not one large constant
    (which leaves the LayerNorms' gradients ill-conditioned in float32).

    For comparing two float32 computations that sum in other orders: an input within their
    rounding of zero (about 1e-7 of its terms) may pass one relu and not the other, and
    that one gate moves a weight's gradient by its whole share, not by rounding. The
    float64 reference tests need none of this; they keep the drawn weights."""
    with torch.no_grad():
        for layer in model.layers:
            ln, ff1, ff2 = layer.ln2, layer.ff1, layer.ff2
            bound = ff1.weight.shape[1]**0.5 * ln.weight.abs().max() + ln.bias.norm()
            ff1.weight.mul_(0.5 / (bound * ff1.weight.norm(dim=1, keepdim=True)))
            live = torch.ones_like(ff1.bias)
            live[1::2] = 0.0
            ff1.bias.copy_(2 * live - 1)
            ff2.bias.sub_(ff2.weight @ live)
