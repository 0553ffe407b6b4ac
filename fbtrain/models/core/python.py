"""The feedback core's step loops in plain PyTorch: the fallback when the C++ core cannot be
built or loaded (no compiler, a failed build, no OpenMP), or when ``FBTRAIN_CORE=python``.

Same algorithm as ``csrc/feedback_core.cpp`` (described in ``spec.py``), same interface
as its ops, and the same numbers to float64 rounding; only the per-op overhead of the
interpreter makes it slower. What the two cores share lives beside this module (the
contract in ``spec.py``, the autograd wrapper in ``autograd.py``); this module holds only
the two sweeps. Dropout masks are drawn before the sweep exactly as the C++ core draws them (same
shapes, same order, from the global generator), so from one seed both cores drop the same
units. The tests hold both cores to ``tests/reference.py``.

Shapes as in ``spec.py``: B batch, T steps, D width, H heads, d_k = D / H, L
layers, F feed-forward width, S = n0 + T memory slots, n_kv key/value sets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from fbtrain.models.core.masks import Masks, draw_masks, window_of
from fbtrain.models.core.spec import (
    ATT_PARAMS,
    LAYER_PARAMS,
    CoreInputs,
    CoreOutputs,
    CoreSpec,
    LayerTensors,
)

_layer_norm = torch.native_layer_norm
_layer_norm_backward = torch.ops.aten.native_layer_norm_backward.default
_softmax_backward = torch.ops.aten._softmax_backward_data.default
_relu_backward = torch.ops.aten.threshold_backward.default



class AttRecord(NamedTuple):
    """One attention step of one layer, as the forward keeps it. Masks are None without
    dropout."""

    a: Tensor  # [B, D] LayerNorm1(x)
    mu1: Tensor  # [B, 1] its mean
    rs1: Tensor  # [B, 1] its reciprocal standard deviation
    qu: Tensor  # [B, D] (q + u) / sqrt(d_k)
    prob: Tensor  # [B, H, ell] attention probabilities
    prob_used: Tensor  # [B, H, ell] after dropout
    o: Tensor  # [B, D] attention output, before Wo
    mask_prob: Tensor | None  # [B, H, ell]
    mask_att: Tensor | None  # [B, D]


class FFRecord(NamedTuple):
    """One feed-forward step of one layer, as the forward keeps it."""

    y: Tensor  # [B, D] its input (after attention)
    mu2: Tensor  # [B, 1]
    rs2: Tensor  # [B, 1]
    c: Tensor  # [B, D] LayerNorm2(y)
    h: Tensor  # [B, F] relu(c W1 + b1)
    h_used: Tensor  # [B, F] after dropout
    mask_h: Tensor | None  # [B, F]
    mask_ff: Tensor | None  # [B, D]


class MemRecord(NamedTuple):
    """With memory norm, one step's normalised memory vector."""

    m_hat: Tensor  # [B, D] norm(m_t)
    mu: Tensor  # [B, 1]
    rstd: Tensor  # [B, 1]


class AttGrads(NamedTuple):
    """One attention step's activation gradients, kept for the weight gradients."""

    dz: Tensor  # [B, D] gradient of Wo's output (after its dropout mask)
    dqu: Tensor  # [B, D] of the query
    da: Tensor  # [B, D] of LayerNorm1's output


class FFGrads(NamedTuple):
    """One feed-forward step's activation gradients, kept for the weight gradients."""

    df: Tensor  # [B, D] gradient of W2's output (after its mask)
    dh: Tensor  # [B, F] of W1's output (before relu)
    dc: Tensor  # [B, D] of LayerNorm2's output


@dataclass
class Tape:
    """What the forward keeps for the backward: per layer, one record per step.

    ``att[l]`` holds an :class:`AttRecord` for each step that attends (non-empty memory);
    ``ff[l]`` an :class:`FFRecord` for every step; ``mem``, with memory norm, a
    :class:`MemRecord` for every step.
    """

    att: list[list[AttRecord]] = field(default_factory=list)
    ff: list[list[FFRecord]] = field(default_factory=list)
    mem: list[MemRecord] = field(default_factory=list)
    masks: Masks | None = None  # the call's dropout masks (their scale), None without dropout


def _per_layer(flat: Sequence[Tensor]) -> list[LayerTensors]:
    """The flat per-layer list (``CoreInputs.layers``) cut into one LayerTensors a layer."""
    n = len(LAYER_PARAMS)
    return [LayerTensors(*flat[i:i + n]) for i in range(0, len(flat), n)]


def core_forward(spec: CoreSpec, inputs: CoreInputs, keep_tape: bool = False
                 ) -> CoreOutputs:
    """:meth:`fbtrain.models.core.spec.Core.core_forward` in PyTorch calls (inference
    mode). The tape is a :class:`Tape`, or None unless ``keep_tape``."""
    x0, mem_k, mem_v, mix, wkv, bkv, layers = inputs
    with torch.inference_mode():
        return CoreOutputs(*_forward(spec, x0, mem_k, mem_v, _per_layer(layers), mix, wkv,
                                     bkv, keep_tape))


def _forward(spec: CoreSpec, x0: Tensor, mem_k: Tensor, mem_v: Tensor,
             params: list[LayerTensors], mix: Tensor, wkv: Tensor, bkv: Tensor | None,
             keep_tape: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tape | None]:
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
    key_sets, value_sets = list(keys.unbind(0)), list(values.unbind(0))  # [BH, S, dk] each
    hidden = x0.new_empty(T, L + 1, B, D)
    hidden[:, 0] = x0.transpose(0, 1)
    memory = x0.new_empty(T, B, D)
    set_of = [0 if spec.shared_kv else li for li in range(L)]
    n_pos = params[0].rt.shape[-1]
    masks = draw_masks(spec, x0, n0, params[0].w1_t.shape[1])
    eps, shape = spec.eps, (D,)
    first_att = 0 if n0 > 0 else 1
    tape = Tape([[] for _ in range(L)], [[] for _ in range(L)], masks=masks) if keep_tape else None
    mask_prob = mask_att = mask_h = mask_ff = None
    for t in range(T):
        slot = n0 + t
        lo, ell = window_of(slot, spec.window)
        if ell:  # views of this step's memory window, shared by the layers that use a set
            k_t = [k.narrow(1, lo, ell).transpose(1, 2) for k in key_sets]  # [BH, dk, ell]
            v_w = [v.narrow(1, lo, ell) for v in value_sets]  # [BH, ell, dk]
        x = hidden[t, 0]
        for li in range(L):
            p = params[li]
            if masks is not None:
                mask_h, mask_ff = masks.h[li, t], masks.ff[li, t]
            if ell:  # attention is skipped while memory is empty
                a, mu1, rs1 = _layer_norm(x, shape, p.ln1_w, p.ln1_b, eps)
                qu = torch.addmm(p.uq, a, p.wq)  # (q + u) / sqrt(d_k): [B, D]
                scores = torch.bmm(qu.view(BH, 1, dk), k_t[set_of[li]]).view(B, H, ell)
                # Position scores per head ([H, B, d_k] @ [H, d_k, ell]): H gemms on the
                # [H, d_k, n_pos] table itself, not B*H matvecs on a copy per batch row.
                scores += torch.baddbmm(p.c.narrow(2, n_pos - ell, ell),
                                        qu.view(B, H, dk).transpose(0, 1),
                                        p.rt.narrow(2, n_pos - ell, ell)).transpose(0, 1)
                prob = torch.softmax(scores, dim=-1)
                prob_used = prob
                if masks is not None:
                    mask_prob = masks.prob_of(li, t, B, H, ell)
                    mask_att = masks.att[li, t - first_att]
                    prob_used = masks.drop(prob, mask_prob)
                o = torch.bmm(prob_used.view(BH, 1, ell), v_w[set_of[li]]).view(B, D)
                z = torch.addmm(p.bo, o, p.wo_t)
                if masks is not None:
                    z = masks.drop_(z, mask_att)
                y = z.add_(x)
                if tape is not None:
                    tape.att[li].append(AttRecord(a, mu1, rs1, qu, prob, prob_used, o,
                                                  mask_prob, mask_att))
            else:
                y = x
            c, mu2, rs2 = _layer_norm(y, shape, p.ln2_w, p.ln2_b, eps)
            h = torch.addmm(p.b1, c, p.w1_t).relu_()  # [B, F]
            h_used = h if masks is None else masks.drop(h, mask_h)
            f = torch.addmm(p.b2, h_used, p.w2_t)
            if masks is not None:
                f = masks.drop_(f, mask_ff)
            x = torch.add(y, f, out=hidden[t, li + 1])
            if tape is not None:
                tape.ff[li].append(FFRecord(y, mu2, rs2, c, h, h_used, mask_h, mask_ff))
        # m_t = sum_l softmax(w)_l h_t^l, then its keys/values for every key set at once.
        m = torch.mm(mix.view(1, L + 1), hidden[t].view(L + 1, B * D), out=memory[t].view(1, -1))
        m = m.view(B, D)
        # With memory norm the projection reads LayerNorm(m_t); its affine part is folded
        # into wkv/bkv by the model, so only the normalisation happens here.
        if spec.memory_norm:
            m_hat, mu_m, rs_m = _layer_norm(m, shape, None, None, eps)
            if tape is not None:
                tape.mem.append(MemRecord(m_hat, mu_m, rs_m))
            m = m_hat
        kv_new = torch.mm(m, wkv) if bkv is None else torch.addmm(bkv, m, wkv)
        kv_new = kv_new.view(B, 2, n_kv, H, dk)
        key_rows[:, :, :, slot] = kv_new[:, 0].transpose(0, 1)
        value_rows[:, :, :, slot] = kv_new[:, 1].transpose(0, 1)
    return hidden, memory, keys, values, tape


def core_backward(spec: CoreSpec, d_top: Tensor, outputs: CoreOutputs, mix: Tensor,
                  wkv: Tensor, layers: Sequence[Tensor]) -> CoreInputs:
    """:meth:`fbtrain.models.core.spec.Core.core_backward` in PyTorch calls (inference
    mode), given this module's :class:`Tape` in ``outputs``."""
    hidden, memory, keys, values, tape = outputs
    n0 = keys.shape[2] - hidden.shape[0]  # the carried slots come first
    with torch.inference_mode():
        return CoreInputs(*_backward(spec, d_top, hidden, memory, keys, values, n0,
                                     _per_layer(layers), mix, wkv, tape))


def _backward(spec: CoreSpec, d_top: Tensor, hidden: Tensor, memory: Tensor, keys: Tensor,
              values: Tensor, n0: int, params: list[LayerTensors], mix: Tensor,
              wkv: Tensor, tape: Tape
              ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, list[Tensor]]:
    T, _, B, D = hidden.shape
    L, H = spec.n_layers, spec.n_heads
    dk, BH = D // H, B * H
    n_kv, S = keys.shape[0], keys.shape[2]
    masks, shape = tape.masks, (D,)
    mix_f = mix.tolist()
    n_pos = params[0].rt.shape[-1]
    # Transposed weights (views) and position tables, once per call rather than per step.
    back = [(p.wq.t(), p.rt.transpose(1, 2), p.wo_t.t(), p.w1_t.t(), p.w2_t.t())
            for p in params]
    set_of = [0 if spec.shared_kv else li for li in range(L)]
    key_sets, value_sets = list(keys.unbind(0)), list(values.unbind(0))
    d_keys, d_values = torch.zeros_like(keys), torch.zeros_like(values)
    d_key_sets, d_value_sets = list(d_keys.unbind(0)), list(d_values.unbind(0))
    d_key_rows = d_keys.view(n_kv, B, H, S, dk)
    d_value_rows = d_values.view(n_kv, B, H, S, dk)
    d_kv = hidden.new_zeros(T, B, 2, n_kv, H, dk)  # gradient of each step's new keys/values
    d_memory = hidden.new_zeros(T, B, D)
    d_x0 = hidden.new_empty(B, T, D)
    first_att = 0 if n0 > 0 else 1  # steps from here on attend
    # Position-table gradients are summed per step (an [T, T]-sized record would grow
    # quadratically with the sequence); rows are ordered like rt/c, largest offset first.
    d_rt = [torch.zeros_like(p.rt) for p in params]  # [H, dk, n_pos]
    d_c = [hidden.new_zeros(H, n_pos) for _ in params]  # [H, n_pos]
    # Per layer, per step (in reverse step order): activation gradients the weight
    # gradients are built from at the end.
    g_att: list[list[AttGrads]] = [[] for _ in range(L)]
    g_ff: list[list[FFGrads]] = [[] for _ in range(L)]
    for t in reversed(range(T)):
        slot = n0 + t
        lo, ell = window_of(slot, spec.window)
        ai = t - first_att
        dm = None
        if t < T - 1:  # the newest slot is read by no later step of this call
            d_kv[t, :, 0] = d_key_rows[:, :, :, slot].transpose(0, 1)
            d_kv[t, :, 1] = d_value_rows[:, :, :, slot].transpose(0, 1)
            dm = torch.mm(d_kv[t].view(B, -1), wkv.t(), out=d_memory[t])  # [B, D]
            if spec.memory_norm:  # through the normalisation, back to m_t
                rec = tape.mem[t]
                dm.copy_(_layer_norm_backward(dm, memory[t], shape, rec.mu, rec.rstd, None, None,
                                              (True, False, False))[0])
        if ell:
            k_w = [k.narrow(1, lo, ell) for k in key_sets]  # [BH, ell, dk]
            v_t = [v.narrow(1, lo, ell).transpose(1, 2) for v in value_sets]  # [BH, dk, ell]
            dk_w = [k.narrow(1, lo, ell) for k in d_key_sets]
            dv_w = [v.narrow(1, lo, ell) for v in d_value_sets]
        dx = d_top[:, t] if dm is None else torch.add(d_top[:, t], dm, alpha=mix_f[L])
        for li in reversed(range(L)):
            p = params[li]
            wq_b, rt_b, wo_b, w1_b, w2_b = back[li]
            ff = tape.ff[li][t]
            # Feed-forward block: x_out = y + Drop(W2 Drop(relu(W1 LN2(y) + b1)) + b2).
            df = masks.drop(dx, ff.mask_ff) if masks is not None else dx
            dh = torch.mm(df, w2_b)
            if masks is not None:
                dh = masks.drop_(dh, ff.mask_h)
            dh = _relu_backward(dh, ff.h, 0)
            dc = torch.mm(dh, w1_b)
            dy = _layer_norm_backward(dc, ff.y, shape, ff.mu2, ff.rs2, p.ln2_w, p.ln2_b,
                                      (True, False, False))[0]
            dy += dx
            g_ff[li].append(FFGrads(df, dh, dc))
            if ell:
                # Attention block: y = x + Drop(Wo (softmax(scores) V) + bo).
                att = tape.att[li][ai]
                qu, prob = att.qu, att.prob
                kv = set_of[li]
                dz = masks.drop(dy, att.mask_att) if masks is not None else dy
                do = torch.mm(dz, wo_b).view(BH, 1, dk)
                d_prob = torch.bmm(do, v_t[kv]).view(B, H, ell)
                # Rank-1 updates, broadcast in place (baddbmm_ into a strided view falls
                # back to one small matmul per batch row).
                dv_w[kv].addcmul_(att.prob_used.view(BH, ell, 1), do)
                if masks is not None:
                    d_prob = masks.drop_(d_prob, att.mask_prob)
                d_scores = _softmax_backward(d_prob, prob, -1, prob.dtype)  # [B, H, ell]
                d_scores_hb = d_scores.transpose(0, 1)  # [H, B, ell]
                dqu = torch.bmm(d_scores.view(BH, 1, ell), k_w[kv]).view(B, H, dk)
                dqu += torch.bmm(d_scores_hb, rt_b.narrow(1, n_pos - ell, ell)).transpose(0, 1)
                dk_w[kv].addcmul_(d_scores.view(BH, ell, 1), qu.view(BH, 1, dk))
                d_rt[li].narrow(2, n_pos - ell, ell).add_(
                    torch.bmm(qu.view(B, H, dk).permute(1, 2, 0), d_scores_hb))
                d_c[li].narrow(1, n_pos - ell, ell).add_(d_scores.sum(0))
                dqu = dqu.view(B, D)
                da = torch.mm(dqu, wq_b)
                dx = _layer_norm_backward(da, hidden[t, li], shape, att.mu1, att.rs1, p.ln1_w,
                                          p.ln1_b, (True, False, False))[0]
                dx += dy
                g_att[li].append(AttGrads(dz, dqu, da))
            else:
                dx = dy
            if dm is not None:
                dx = dx.add_(dm, alpha=mix_f[li])
        d_x0[:, t] = dx
    layer_grads: list[Tensor] = []
    for li in range(L):
        grads = _layer_weight_grads(tape.att[li], tape.ff[li], g_att[li], g_ff[li],
                                    hidden[first_att:, li], params[li])
        grads["rt"], grads["c"] = d_rt[li], d_c[li].unsqueeze(1)
        layer_grads += [grads[name] for name in LAYER_PARAMS]
    d_mix = torch.einsum("tbd,tlbd->l", d_memory, hidden)
    d_kv_flat = d_kv.view(T * B, -1)
    kv_in = _stacked(tape.mem, "m_hat") if spec.memory_norm else memory.view(T * B, D)
    d_wkv = torch.mm(kv_in.t(), d_kv_flat)
    # The carried slots' key/value gradients, for callers that projected them differentiably.
    return (d_x0, d_keys[:, :, :n0], d_values[:, :, :n0], d_mix, d_wkv, d_kv_flat.sum(0),
            layer_grads)


def _stacked(records: Sequence[NamedTuple], name: str, reverse: bool = False) -> Tensor:
    """Field ``name`` of every per-step record, stacked and flattened to [steps * B, n]."""
    items = [getattr(r, name) for r in (reversed(records) if reverse else records)]
    out = torch.stack(items)
    return out.view(-1, out.shape[-1])


def _layer_norm_affine_grads(d_out: Tensor, x: Tensor, mu: Tensor, rs: Tensor
                             ) -> tuple[Tensor, Tensor]:
    """Gradients of LayerNorm's weight and bias over all rows: sum(d * x_hat), sum(d)."""
    x_hat = (x - mu) * rs
    return (d_out * x_hat).sum(0), d_out.sum(0)


def _layer_weight_grads(att: list[AttRecord], ff: list[FFRecord], g_att: list[AttGrads],
                        g_ff: list[FFGrads], x_att: Tensor, p: LayerTensors
                        ) -> dict[str, Tensor]:
    """One large matmul per weight, over all steps at once (see spec.py).

    ``att``/``ff`` are the forward's records (step order), ``g_att``/``g_ff`` the
    backward's (reverse step order); x_att [n_att, B, D] the attention steps' inputs.
    """
    df, dh, dc = (_stacked(g_ff, name, reverse=True) for name in FFGrads._fields)
    grads = {
        "w2_t": torch.mm(_stacked(ff, "h_used").t(), df), "b2": df.sum(0),
        "w1_t": torch.mm(_stacked(ff, "c").t(), dh), "b1": dh.sum(0),
    }
    grads["ln2_w"], grads["ln2_b"] = _layer_norm_affine_grads(
        dc, _stacked(ff, "y"), _stacked(ff, "mu2"), _stacked(ff, "rs2"))
    if not att:  # no step attended: attention parameters get zero gradient
        for name in ATT_PARAMS:
            grads[name] = torch.zeros_like(getattr(p, name))
        return grads
    dz, dqu, da = (_stacked(g_att, name, reverse=True) for name in AttGrads._fields)
    grads["wo_t"], grads["bo"] = torch.mm(_stacked(att, "o").t(), dz), dz.sum(0)
    grads["wq"], grads["uq"] = torch.mm(_stacked(att, "a").t(), dqu), dqu.sum(0)
    grads["ln1_w"], grads["ln1_b"] = _layer_norm_affine_grads(
        da, x_att.reshape(-1, x_att.shape[-1]), _stacked(att, "mu1"), _stacked(att, "rs1"))
    return grads
