"""The transformer's blocked, mask-skewed attention against its op-by-op form.

``explicit_forward`` is the transformer's forward as it was written before its attention
ran in row blocks and through ``scaled_dot_product_attention``: every query row against
every slot, the position scores gathered from offsets to slots, masked, softmax, dropout,
weighted sum. The model must equal it (logits, carried keys and values, every gradient)
to 1e-12 in float64 and 1e-6 (relative) in float32, with and without carried memory,
windows shorter than the call, re-projected sources and dropout.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from fbtrain.config import ModelConfig
from fbtrain.models import build_model
from fbtrain.models import transformer as tf
from fbtrain.models.state import MemoryState, kept_sources


def explicit_forward(model: tf.Transformer, tokens: Tensor, state: MemoryState | None = None
                     ) -> tuple[Tensor, MemoryState]:
    """The transformer's forward, attention written out op by op over all [T, S] scores."""
    cfg = model.cfg
    B, T = tokens.shape
    H, D = cfg.n_heads, cfg.d_model
    dk, window = D // H, cfg.memory_window
    x = model.embed(tokens)
    if state is None:
        state = model.empty_state(B, x)
    n0 = state.slots
    S = n0 + T
    n_pos = max(1, min(S, window))
    offset = (n0 + torch.arange(T))[:, None] - torch.arange(S)
    allowed = (offset >= 1) & (offset <= window)
    attends = allowed.any(-1)
    blocked = ~allowed & attends[:, None]
    pos_index = (n_pos - offset).clamp(0, n_pos - 1).expand(B, H, T, S)
    new_keys, new_values, inputs = [], [], []
    reproject = state.sources is not None and n0 > 0
    drop = cfg.dropout if model.training else 0.0
    memory_norm = cfg.memory_norm == "layernorm"
    for li, layer in enumerate(model.layers):
        attn = layer.attn
        fa = attn.folded(n_pos)
        inputs.append(x)
        a = layer.ln1(x)
        if reproject:
            kv_in = torch.cat([state.sources[li].to(x.dtype), x], 1)
            kv_in = layer.ln1(kv_in) if memory_norm else kv_in
            keys = attn.key(kv_in).view(B, S, H, dk).transpose(1, 2)
            values = attn.value(kv_in).view(B, S, H, dk).transpose(1, 2)
        else:
            kv_in = a if memory_norm else x
            k = attn.key(kv_in).view(B, T, H, dk).transpose(1, 2)
            v = attn.value(kv_in).view(B, T, H, dk).transpose(1, 2)
            keys = torch.cat([state.keys[li].view(B, H, n0, dk).to(x.dtype), k], dim=2)
            values = torch.cat([state.values[li].view(B, H, n0, dk).to(x.dtype), v], dim=2)
        qu = torch.addmm(fa.uq, a.view(B * T, D), fa.wq).view(B, T, H, dk).transpose(1, 2)
        scores = qu @ keys.transpose(2, 3)
        by_offset = qu @ fa.rt + fa.c
        scores = scores + by_offset.gather(-1, pos_index)
        prob = F.dropout(torch.softmax(scores.masked_fill(blocked, float("-inf")), -1),
                         drop, model.training)
        o = (prob @ values).transpose(1, 2).reshape(B, T, D)
        z = attn.out(o) * attends[:, None].to(x.dtype)
        y = x + F.dropout(z, drop, model.training)
        h = F.dropout(F.relu(layer.ff1(layer.ln2(y))), drop, model.training)
        new_keys.append(keys[:, :, -window:].reshape(B * H, -1, dk))
        new_values.append(values[:, :, -window:].reshape(B * H, -1, dk))
        x = y + F.dropout(layer.ff2(h), drop, model.training)
    logits = model.head(model.ln_f(x))
    sources = kept_sources(state, torch.stack(inputs), window)
    return logits, MemoryState(torch.stack(new_keys), torch.stack(new_values),
                               state.steps + T, sources)


def model_of(dtype: torch.dtype, seed: int = 0, **kw) -> tf.Transformer:
    """A small transformer whose zero-initialised parameters (r, b, u, LayerNorms) are
    randomised too, so no term of the scores hides behind a zero."""
    cfg = dict(kind="transformer", d_model=16, n_heads=2, d_ff=24, n_layers=2,
               max_rel_pos=40)
    torch.manual_seed(seed)
    model = build_model(ModelConfig(**{**cfg, **kw}), 11).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model


def outputs(model: tf.Transformer, forward, tokens: Tensor, state: MemoryState | None,
            seed: int = 3) -> dict[str, Tensor]:
    """Logits, new keys/values and the gradients of a fixed random projection of the
    logits (and of the carried sources, where they require one)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout draws for both forwards
    logits, new = forward(model, tokens, state)
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(logits.shape, generator=g, dtype=logits.dtype)
    loss = (logits * weight).sum() + new.keys.sum() + (new.values ** 2).sum()
    loss.backward()
    out = {"logits": logits.detach(), "keys": new.keys.detach(), "values": new.values.detach()}
    out.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    return out


def carried(model: tf.Transformer, n0: int, B: int, sources: bool) -> MemoryState:
    """A state of n0 slots from an earlier call (with its sources for re-projection, or
    without: decoding's cache)."""
    with torch.no_grad():
        _, state = model(torch.randint(0, 11, (B, n0)))
    if not sources:
        return MemoryState(state.keys, state.values, state.steps)
    return MemoryState(state.keys, state.values, state.steps,
                       torch.randn(model.cfg.n_layers, B, state.slots, model.cfg.d_model,
                                   dtype=state.keys.dtype))


CASES = [  # T, n0, mem_len, memory_norm, carried sources
    (9, 0, None, "none", False),
    (9, 0, 4, "layernorm", False),
    (150, 0, None, "none", False),  # three row blocks
    (150, 0, 37, "none", False),  # a window shorter than a block
    (7, 5, None, "none", False),
    (70, 12, 20, "layernorm", False),
    (70, 12, 20, "none", True),  # re-projected sources
    (1, 0, None, "none", False),
    (1, 6, 3, "none", False),
]


@pytest.mark.parametrize(("T", "n0", "mem_len", "memory_norm", "sources"), CASES)
@pytest.mark.parametrize(("dtype", "rtol", "atol"), [(torch.float64, 0, 1e-12),
                                                     (torch.float32, 1e-6, 1e-6)])
def test_blocked_attention_equals_explicit(T, n0, mem_len, memory_norm, sources, dtype,
                                           rtol, atol):
    model = model_of(dtype, mem_len=mem_len, memory_norm=memory_norm)
    tokens = torch.randint(0, 11, (3, T))
    state = carried(model, n0, 3, sources) if n0 else None
    want = outputs(model, explicit_forward, tokens, state)
    got = outputs(model, lambda m, x, s: m(x, s), tokens, state)
    assert got.keys() == want.keys()
    for name in want:
        scale = want[name].abs().max().clamp(min=1.0)
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol * scale,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(("T", "n0", "mem_len", "memory_norm", "sources"), CASES)
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_attention_without_gradients_equals_explicit(T, n0, mem_len, memory_norm, sources,
                                                     dtype, atol):
    """Without gradients the blocks run in scaled_dot_product_attention."""
    model = model_of(dtype, mem_len=mem_len, memory_norm=memory_norm).eval()
    tokens = torch.randint(0, 11, (3, T))
    state = carried(model, n0, 3, sources) if n0 else None
    with torch.no_grad():
        want, want_state = explicit_forward(model, tokens, state)
        got, got_state = model(tokens, state)
    for a, b in ((got, want), (got_state.keys, want_state.keys),
                 (got_state.values, want_state.values)):
        torch.testing.assert_close(a, b, rtol=atol, atol=atol * b.abs().max().clamp(min=1.0))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_dropout_draws_as_before(dtype):
    """With dropout the probabilities' mask is drawn as [B, H, T, S] in one go, as the op-by-op
    form drew it: from one seed both drop the same entries (float64: equal to 1e-12)."""
    model = model_of(dtype, dropout=0.3, mem_len=6).train()
    tokens = torch.randint(0, 11, (2, 20))
    want = outputs(model, explicit_forward, tokens, None)
    got = outputs(model, lambda m, x, s: m(x, s), tokens, None)
    for name in want:
        scale = want[name].abs().max().clamp(min=1.0)
        tol = 1e-12 if dtype == torch.float64 else 1e-6
        torch.testing.assert_close(got[name], want[name], rtol=tol, atol=tol * scale,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(("T", "n0", "window", "block"),
                         [(10, 0, 100, 4), (10, 0, 3, 4), (5, 7, 3, 2), (6, 2, 100, None),
                          (1, 0, 5, 64), (200, 0, 4096, 64), (9, 30, 12, 4)])
def test_slot_scores_gather_each_offset(T, n0, window, block):
    """SlotScores puts offset o's score of row i at slot n0 + i - o, and its backward
    sends each slot's gradient back to that offset, for every row block."""
    B, H = 2, 3
    S = n0 + T
    for blk in tf.row_blocks(T, n0, window, block):
        rows, n_slots = blk.i1 - blk.i0, blk.hi - blk.lo
        i = torch.arange(n0 + blk.i0, n0 + blk.i1)[:, None]
        offset = i - torch.arange(blk.lo, blk.hi)
        allowed = (offset >= 1) & (offset <= window)
        # every slot a row of the block can see is inside the block's slots
        assert blk.lo <= max(0, n0 + blk.i0 - window) and blk.hi >= n0 + blk.i1 - 1
        assert blk.hi <= S and int(allowed.sum()) == sum(
            min(window, n0 + r) for r in range(blk.i0, blk.i1))
        pos = torch.randn(H, B, rows, blk.n_off, dtype=torch.float64, requires_grad=True)
        out = tf.SlotScores.apply(pos, blk.slot_of_column(n0), n_slots, ~allowed)
        column = (blk.n_off - offset).clamp(0, blk.n_off - 1)  # [rows, n_slots]
        want = pos.permute(1, 0, 2, 3).gather(-1, column.expand(B, H, rows, n_slots))
        assert torch.equal(out[..., allowed], want[..., allowed])
        assert torch.isneginf(out[..., ~allowed]).all()
        grad = torch.randn(B, H, rows, n_slots, dtype=torch.float64)
        (got,) = torch.autograd.grad(out, pos, grad.masked_fill(~allowed, 0.0))
        (expected,) = torch.autograd.grad(want, pos, grad.masked_fill(~allowed, 0.0))
        assert torch.equal(got, expected)
