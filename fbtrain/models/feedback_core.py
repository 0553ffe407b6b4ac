"""The sequential core of the Feedback Transformer, with a hand-written backward pass.

Why hand-written: a feedback model must run one token at a time, so a training step is
``seq_len * n_layers`` tiny steps. Under plain autograd every tiny op also records a graph
node and replays it in the backward, and on a CPU that per-op overhead, not arithmetic, is
the cost. Here the forward runs without autograd, keeping only what the backward needs; the
backward sweeps the steps in reverse computing *activation* gradients only, and every
*weight* gradient is one large matmul over all steps at the end. ``tests/reference.py``
checks this against a slow autograd implementation written straight from the equations.

Shapes: B batch, T steps in this call, D model width, H heads, d_k = D / H, L layers,
F feed-forward width, S = n0 + T memory slots (n0 carried over from an earlier call),
n_kv key/value sets (1 for ``feedback_kv``, L for ``feedback``). Memory keys and values
live in preallocated buffers ``[n_kv, B*H, S, d_k]``; nothing is re-stacked per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

_layer_norm = torch.native_layer_norm
_layer_norm_backward = torch.ops.aten.native_layer_norm_backward.default
_softmax_backward = torch.ops.aten._softmax_backward_data.default
_relu_backward = torch.ops.aten.threshold_backward.default


@dataclass(frozen=True)
class CoreSpec:
    """Static facts of one core call (hashable, so it can ride through autograd)."""

    n_layers: int
    n_heads: int
    shared_kv: bool
    window: int  # memory slots a step may attend to (mem_len <= max_rel_pos)
    dropout: float  # 0 when not training
    eps: float = 1e-5


# Per-layer tensors in the order the core takes them (see FeedbackTransformer.core_params).
LAYER_PARAMS = ("ln1_w", "ln1_b", "wq", "uq", "rt", "c", "wo_t", "bo",
                "ln2_w", "ln2_b", "w1_t", "b1", "w2_t", "b2")


@dataclass
class LayerTape:
    """What the forward keeps of one layer for the backward, one entry per step.

    Attention entries exist only for steps that attend (non-empty memory).
    """

    att: dict[str, list[Tensor]] = field(default_factory=dict)
    ff: dict[str, list[Tensor]] = field(default_factory=dict)

    def put(self, group: dict[str, list[Tensor]], **tensors: Tensor) -> None:
        for k, v in tensors.items():
            group.setdefault(k, []).append(v)


def _dropout_mask(like: Tensor, p: float) -> Tensor:
    """Inverted-dropout mask: 0 or 1/(1-p), same shape as ``like``."""
    return torch.empty_like(like).bernoulli_(1.0 - p).div_(1.0 - p)


def _window(slot: int, window: int) -> tuple[int, int]:
    """First slot and length of the memory window seen by the step that creates ``slot``."""
    lo = max(0, slot - window)
    return lo, slot - lo


def core_forward(
    spec: CoreSpec, x0: Tensor, mem_k: Tensor, mem_v: Tensor,
    layers: list[dict[str, Tensor]], mix: Tensor, wkv: Tensor, bkv: Tensor | None,
    tapes: list[LayerTape] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Run T steps. Must be called without autograd recording.

    x0: [B, T, D] token embeddings. mem_k, mem_v: [n_kv, B*H, n0, d_k] carried memory.
    layers: per-layer tensors named as LAYER_PARAMS (``rt`` [H, d_k, P], ``c`` [H, 1, P]
    hold the P = min(S, window) position rows a window can use, largest offset first).
    mix: [L+1] softmax memory weights. wkv: [D, 2*n_kv*D] (all keys, then all values);
    bkv: [2*n_kv*D] or None. tapes: per-layer records for the backward, or None.
    Returns hidden [T, L+1, B, D] (every layer's output at every step), the memory
    vectors [T, B, D], and the key/value buffers [n_kv, B*H, S, d_k].
    """
    B, T, D = x0.shape
    L, H = spec.n_layers, spec.n_heads
    dk, BH = D // H, B * H
    n_kv, n0 = mem_k.shape[0], mem_k.shape[2]
    S = n0 + T
    keys = x0.new_empty(n_kv, BH, S, dk)
    values = x0.new_empty(n_kv, BH, S, dk)
    keys[:, :, :n0] = mem_k
    values[:, :, :n0] = mem_v
    # Slot s of every key set, seen as [n_kv, B, H, d_k], for writing new memory in place.
    key_rows, value_rows = keys.view(n_kv, B, H, S, dk), values.view(n_kv, B, H, S, dk)
    hidden = x0.new_empty(T, L + 1, B, D)
    hidden[:, 0] = x0.transpose(0, 1)
    memory = x0.new_empty(T, B, D)
    n_pos = layers[0]["rt"].shape[-1]
    drop = spec.dropout
    for t in range(T):
        slot = n0 + t
        lo, ell = _window(slot, spec.window)
        x = hidden[t, 0]
        for li, p in enumerate(layers):
            kv = 0 if spec.shared_kv else li
            if ell:  # attention is skipped while memory is empty
                a, mu1, rs1 = _layer_norm(x, (D,), p["ln1_w"], p["ln1_b"], spec.eps)
                qu = torch.addmm(p["uq"], a, p["wq"])  # (q + u) / sqrt(d_k): [B, D]
                k_win, v_win = keys[kv, :, lo:slot], values[kv, :, lo:slot]  # [BH, ell, dk]
                scores = torch.bmm(qu.view(BH, 1, dk), k_win.transpose(1, 2)).view(B, H, ell)
                pos = torch.baddbmm(p["c"][:, :, n_pos - ell:], qu.view(B, H, dk).transpose(0, 1),
                                    p["rt"][:, :, n_pos - ell:])  # [H, B, ell]
                scores += pos.transpose(0, 1)
                prob = torch.softmax(scores, dim=-1)
                prob_used = prob
                masks = {}
                if drop:
                    masks["m_prob"] = _dropout_mask(prob, drop)
                    prob_used = prob * masks["m_prob"]
                o = torch.bmm(prob_used.view(BH, 1, ell), v_win).view(B, D)
                z = torch.addmm(p["bo"], o, p["wo_t"])
                if drop:
                    masks["m_att"] = _dropout_mask(z, drop)
                    z = z * masks["m_att"]
                y = z.add_(x)
                if tapes is not None:
                    tapes[li].put(tapes[li].att, a=a, mu1=mu1, rs1=rs1, qu=qu, prob=prob,
                                  prob_used=prob_used, o=o, **masks)
            else:
                y = x
            c, mu2, rs2 = _layer_norm(y, (D,), p["ln2_w"], p["ln2_b"], spec.eps)
            h = torch.addmm(p["b1"], c, p["w1_t"]).relu_()  # [B, F]
            h_used = h
            masks = {}
            if drop:
                masks["m_h"] = _dropout_mask(h, drop)
                h_used = h * masks["m_h"]
            f = torch.addmm(p["b2"], h_used, p["w2_t"])
            if drop:
                masks["m_ff"] = _dropout_mask(f, drop)
                f = f * masks["m_ff"]
            x = torch.add(y, f, out=hidden[t, li + 1])
            if tapes is not None:
                tapes[li].put(tapes[li].ff, y=y, mu2=mu2, rs2=rs2, c=c, h=h, h_used=h_used,
                              **masks)
        # m_t = sum_l softmax(w)_l h_t^l, then its keys/values for every key set at once.
        m = torch.mm(mix.view(1, L + 1), hidden[t].view(L + 1, B * D)).view(B, D)
        memory[t] = m
        kv_new = (torch.mm(m, wkv) if bkv is None else torch.addmm(bkv, m, wkv))
        kv_new = kv_new.view(B, 2, n_kv, H, dk)
        key_rows[:, :, :, slot] = kv_new[:, 0].transpose(0, 1)
        value_rows[:, :, :, slot] = kv_new[:, 1].transpose(0, 1)
    return hidden, memory, keys, values


def core_backward(
    spec: CoreSpec, d_top: Tensor, hidden: Tensor, memory: Tensor, keys: Tensor,
    values: Tensor, n0: int, layers: list[dict[str, Tensor]], mix: Tensor, wkv: Tensor,
    tapes: list[LayerTape],
) -> tuple[Tensor, list[dict[str, Tensor]], Tensor, Tensor, Tensor]:
    """Gradients of the core given ``d_top`` [B, T, D], the gradient of the last layer's output.

    Returns d_x0 [B, T, D], per-layer parameter gradients (names as LAYER_PARAMS),
    d_mix [L+1], d_wkv [D, 2*n_kv*D] and d_bkv [2*n_kv*D].
    """
    T, L1, B, D = hidden.shape
    L, H = spec.n_layers, spec.n_heads
    dk, BH = D // H, B * H
    n_kv, S = keys.shape[0], keys.shape[2]
    n_pos = layers[0]["rt"].shape[-1]
    drop = spec.dropout
    mix_f = mix.tolist()
    d_keys, d_values = torch.zeros_like(keys), torch.zeros_like(values)
    d_key_rows = d_keys.view(n_kv, B, H, S, dk)
    d_value_rows = d_values.view(n_kv, B, H, S, dk)
    d_kv = hidden.new_zeros(T, B, 2, n_kv, H, dk)  # gradient of each step's new keys/values
    d_memory = hidden.new_zeros(T, B, D)
    d_x0 = hidden.new_empty(B, T, D)
    first_att = 0 if n0 > 0 else 1  # steps from here on attend
    n_att = T - first_att
    d_scores_all = [hidden.new_zeros(n_att, B, H, n_pos) for _ in range(L)]
    grads_att: list[dict[str, list[Tensor]]] = [{} for _ in range(L)]
    grads_ff: list[dict[str, list[Tensor]]] = [{} for _ in range(L)]
    for t in reversed(range(T)):
        slot = n0 + t
        lo, ell = _window(slot, spec.window)
        ai = t - first_att
        dm = None
        if t < T - 1:  # the newest slot is read by no later step of this call
            d_kv[t, :, 0] = d_key_rows[:, :, :, slot].transpose(0, 1)
            d_kv[t, :, 1] = d_value_rows[:, :, :, slot].transpose(0, 1)
            dm = torch.mm(d_kv[t].view(B, -1), wkv.t())  # [B, D]
            d_memory[t] = dm
        dx = d_top[:, t] if dm is None else torch.add(d_top[:, t], dm, alpha=mix_f[L])
        for li in reversed(range(L)):
            p, att, ff = layers[li], tapes[li].att, tapes[li].ff
            kv = 0 if spec.shared_kv else li
            # Feed-forward block: x_out = y + Drop(W2 Drop(relu(W1 LN2(y) + b1)) + b2).
            df = dx * ff["m_ff"][t] if drop else dx
            dh = torch.mm(df, p["w2_t"].t())
            if drop:
                dh = dh * ff["m_h"][t]
            dh = _relu_backward(dh, ff["h"][t], 0)
            dc = torch.mm(dh, p["w1_t"].t())
            dy = _layer_norm_backward(dc, ff["y"][t], (D,), ff["mu2"][t], ff["rs2"][t],
                                      p["ln2_w"], p["ln2_b"], (True, False, False))[0]
            dy += dx
            g = grads_ff[li]
            g.setdefault("df", []).append(df)
            g.setdefault("dh", []).append(dh)
            g.setdefault("dc", []).append(dc)
            if ell:
                # Attention block: y = x + Drop(Wo (softmax(scores) V) + bo).
                dz = dy * att["m_att"][ai] if drop else dy
                do = torch.mm(dz, p["wo_t"].t()).view(BH, 1, dk)
                k_win, v_win = keys[kv, :, lo:slot], values[kv, :, lo:slot]
                prob, prob_used = att["prob"][ai], att["prob_used"][ai]
                d_prob = torch.bmm(do, v_win.transpose(1, 2)).view(B, H, ell)
                # Rank-1 updates, broadcast in place (baddbmm_ into a strided view falls back
                # to one small matmul per batch row).
                d_values[kv, :, lo:slot].addcmul_(prob_used.view(BH, ell, 1), do)
                if drop:
                    d_prob = d_prob * att["m_prob"][ai]
                d_scores = _softmax_backward(d_prob, prob, -1, prob.dtype)  # [B, H, ell]
                qu = att["qu"][ai]
                dqu = torch.bmm(d_scores.view(BH, 1, ell), k_win).view(B, H, dk)
                rt_win = p["rt"][:, :, n_pos - ell:]
                dqu += torch.bmm(d_scores.transpose(0, 1), rt_win.transpose(1, 2)).transpose(0, 1)
                d_keys[kv, :, lo:slot].addcmul_(d_scores.view(BH, ell, 1), qu.view(BH, 1, dk))
                d_scores_all[li][ai, :, :, n_pos - ell:] = d_scores
                dqu = dqu.view(B, D)
                da = torch.mm(dqu, p["wq"].t())
                dx = _layer_norm_backward(da, hidden[t, li], (D,), att["mu1"][ai], att["rs1"][ai],
                                          p["ln1_w"], p["ln1_b"], (True, False, False))[0]
                dx += dy
                g = grads_att[li]
                g.setdefault("dz", []).append(dz)
                g.setdefault("dqu", []).append(dqu)
                g.setdefault("da", []).append(da)
            else:
                dx = dy
            if dm is not None:
                dx = dx.add_(dm, alpha=mix_f[li])
        d_x0[:, t] = dx
    layer_grads = [
        _layer_weight_grads(spec, layers[li], tapes[li], grads_att[li], grads_ff[li],
                            d_scores_all[li], hidden[first_att:, li] if n_att else None)
        for li in range(L)
    ]
    d_mix = torch.einsum("tbd,tlbd->l", d_memory, hidden)
    d_kv_flat = d_kv.view(T * B, -1)
    d_wkv = torch.mm(memory.view(T * B, D).t(), d_kv_flat)
    return d_x0, layer_grads, d_mix, d_wkv, d_kv_flat.sum(0)


def _stack(reversed_list: list[Tensor]) -> Tensor:
    """Stack per-step gradients collected in reverse step order, flattened to [steps*B, ...]."""
    out = torch.stack(reversed_list[::-1])
    return out.view(-1, out.shape[-1])


def _flat(forward_list: list[Tensor]) -> Tensor:
    out = torch.stack(forward_list)
    return out.view(-1, out.shape[-1])


def _layer_norm_affine_grads(d_out: Tensor, x: Tensor, mu: Tensor, rs: Tensor
                             ) -> tuple[Tensor, Tensor]:
    """Gradients of LayerNorm's weight and bias over all rows: sum(d * x_hat), sum(d)."""
    x_hat = (x - mu) * rs
    return (d_out * x_hat).sum(0), d_out.sum(0)


def _layer_weight_grads(spec: CoreSpec, p: dict[str, Tensor], tape: LayerTape,
                        g_att: dict[str, list[Tensor]], g_ff: dict[str, list[Tensor]],
                        d_scores: Tensor, x_att: Tensor | None) -> dict[str, Tensor]:
    """One large matmul per weight, over all steps at once (see module docstring)."""
    ff = tape.ff
    df, dh, dc = _stack(g_ff["df"]), _stack(g_ff["dh"]), _stack(g_ff["dc"])
    grads = {
        "w2_t": torch.mm(_flat(ff["h_used"]).t(), df), "b2": df.sum(0),
        "w1_t": torch.mm(_flat(ff["c"]).t(), dh), "b1": dh.sum(0),
    }
    grads["ln2_w"], grads["ln2_b"] = _layer_norm_affine_grads(
        dc, _flat(ff["y"]), _flat(ff["mu2"]), _flat(ff["rs2"]))
    if x_att is None:  # no step attended: attention parameters get zero gradient
        for name in ("ln1_w", "ln1_b", "wq", "uq", "rt", "c", "wo_t", "bo"):
            grads[name] = torch.zeros_like(p[name])
        return grads
    att = tape.att
    dz, dqu, da = _stack(g_att["dz"]), _stack(g_att["dqu"]), _stack(g_att["da"])
    D = dqu.shape[-1]
    grads["wo_t"], grads["bo"] = torch.mm(_flat(att["o"]).t(), dz), dz.sum(0)
    grads["wq"], grads["uq"] = torch.mm(_flat(att["a"]).t(), dqu), dqu.sum(0)
    grads["ln1_w"], grads["ln1_b"] = _layer_norm_affine_grads(
        da, x_att.reshape(-1, D), _flat(att["mu1"]), _flat(att["rs1"]))
    # Position table: d rt[h, :, p] = sum over steps and batch of qu[h] * d_score[h, p].
    n, B, H, n_pos = d_scores.shape
    qu = torch.stack(att["qu"]).view(n * B, H, -1).transpose(0, 1)  # [H, n*B, dk]
    ds = d_scores.view(n * B, H, n_pos).transpose(0, 1)  # [H, n*B, n_pos]
    grads["rt"] = torch.bmm(qu.transpose(1, 2), ds)  # [H, dk, n_pos]
    grads["c"] = ds.sum(1).unsqueeze(1)  # [H, 1, n_pos]
    return grads


class FeedbackCoreFunction(torch.autograd.Function):
    """Autograd wrapper: inputs (spec, x0, mem_k, mem_v, mix, wkv, bkv, *layer tensors).

    Outputs the last layer's hidden states [B, T, D] plus the new memory keys/values (the
    last ``window`` slots; non-differentiable: carried memory is detached, as in TBPTT).
    """

    @staticmethod
    def forward(ctx, spec: CoreSpec, x0: Tensor, mem_k: Tensor, mem_v: Tensor, mix: Tensor,
                wkv: Tensor, bkv: Tensor | None, *flat: Tensor):
        layers = unflatten_layers(flat)
        tapes = [LayerTape() for _ in layers]
        hidden, memory, keys, values = core_forward(
            spec, x0, mem_k, mem_v, layers, mix, wkv, bkv, tapes)
        # Outputs are fresh tensors, never views of saved buffers (that would make a cycle).
        top = hidden[:, -1].transpose(0, 1).contiguous()
        new_k = keys[:, :, -spec.window:].clone()
        new_v = values[:, :, -spec.window:].clone()
        ctx.mark_non_differentiable(new_k, new_v)
        ctx.spec, ctx.n0, ctx.tapes, ctx.has_bkv = spec, mem_k.shape[2], tapes, bkv is not None
        ctx.buffers = (hidden, memory, keys, values)
        ctx.save_for_backward(mix, wkv, *flat)
        return top, new_k, new_v

    @staticmethod
    def backward(ctx, d_top: Tensor, _dk: Tensor, _dv: Tensor):
        mix, wkv, *flat = ctx.saved_tensors
        layers = unflatten_layers(flat)
        hidden, memory, keys, values = ctx.buffers
        d_x0, layer_grads, d_mix, d_wkv, d_bkv = core_backward(
            ctx.spec, d_top.contiguous(), hidden, memory, keys, values, ctx.n0, layers, mix,
            wkv, ctx.tapes)
        ctx.buffers = ctx.tapes = None
        flat_grads = [g[name] for g in layer_grads for name in LAYER_PARAMS]
        return (None, d_x0, None, None, d_mix, d_wkv, d_bkv if ctx.has_bkv else None,
                *flat_grads)


def flatten_layers(layers: list[dict[str, Tensor]]) -> list[Tensor]:
    return [p[name] for p in layers for name in LAYER_PARAMS]


def unflatten_layers(flat: tuple[Tensor, ...] | list[Tensor]) -> list[dict[str, Tensor]]:
    n = len(LAYER_PARAMS)
    return [dict(zip(LAYER_PARAMS, flat[i:i + n], strict=True)) for i in range(0, len(flat), n)]
