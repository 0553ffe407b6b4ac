""":class:`FusedCore`: the core's two sweeps as Triton kernels (``forward``, ``backward``,
run by ``launch``), four launches per layer and step each way (the memory folded into
layer 0's), and the weight gradients as a few batched matmuls after the sweep (see the
package docstring for the design).

Host code here only allocates buffers, slices them and launches: no host syncs and no
data-dependent control flow (every launch and its arguments follow from the input shapes),
so a whole call can be captured in one CUDA graph per shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import triton
from torch import Tensor

from fbtrain.models.core.fused.grads import ln_backward, weight_grads
from fbtrain.models.core.fused.launch import Launch, recording
from fbtrain.models.core.fused.launch import launch as _launch
from fbtrain.models.core.fused.precision import ieee_float32
from fbtrain.models.core.fused.tape import FusedTape
from fbtrain.models.core.masks import draw_masks, prob_offsets, window_of
from fbtrain.models.core.spec import (
    LAYER_PARAMS,
    Core,
    CoreError,
    CoreInputs,
    CoreOutputs,
    CoreSpec,
    interpreting,
)

# Tiles (docs/design.md, "The fused core": what they use of an SM).
BLOCK_B = 16  # batch rows per program (tl.dot needs 16 or more in each dimension)
BN = 32  # output columns per program of the column-split kernels
BK = 32  # inner-dimension chunk of every matmul
WINDOW_TILE = 128  # window slots x head width per chunk of the attention ([BLOCK_B, BW, d_k]);
# 256 held 228-255 registers in att_back where its loads are not 16-byte aligned (sm_80, sm_90)
SPLIT = 32  # window slots per attention program (a step's window split over programs)


def _blocks(D: int, H: int) -> dict[str, int]:
    """The power-of-two tiles for width D and H heads (16 at least: tl.dot's minimum), and
    the window chunk that keeps a [BLOCK_B, BW, d_k] tile at ``WINDOW_TILE`` per row (one
    slot at least: at d_k 128 a 2-slot minimum doubled the tile, to 243-255 registers)."""
    bdk = max(16, triton.next_power_of_2(D // H))
    return {"BD": max(16, triton.next_power_of_2(D)), "BDK": bdk,
            "BW": max(1, WINDOW_TILE // bdk)}


def _splits(ell: int) -> int:
    """Programs a head's window of ``ell`` slots is split over (1 for none)."""
    return max(1, triton.cdiv(ell, SPLIT))


def _tiles(B: int, n: int, per: int = BN) -> tuple[int, int]:
    """A grid of batch tiles x ``n`` columns in tiles of ``per`` (or ``n`` heads: per=1)."""
    return (triton.cdiv(B, BLOCK_B), triton.cdiv(n, per))


def _per_layer(layers: Sequence[Tensor]) -> list[dict[str, Tensor]]:
    """The flat per-layer list as one dict a layer, each tensor contiguous (the kernels
    index row-major; the model hands some weights over transposed)."""
    n = len(LAYER_PARAMS)
    return [dict(zip(LAYER_PARAMS, (t.contiguous() for t in layers[i:i + n]), strict=True))
            for i in range(0, len(layers), n)]


def _runs_here(t: Tensor) -> bool:
    """Whether the kernels can run on ``t``: CUDA, or (interpreted) anything under
    ``TRITON_INTERPRET``."""
    return t.is_cuda or interpreting()


class FusedCore:
    """The :class:`~fbtrain.models.core.spec.Core` calls on Triton kernels. A call on
    tensors the kernels cannot take (CPU tensors without the interpreter: a model moved to
    the CPU for sampling) goes to ``fallback``, forward and backward alike."""

    capturable = True  # no host syncs, fixed launches per shape: graphs.py may capture it

    def __init__(self, fallback: Core | None = None):
        self.fallback = fallback

    def _other(self, t: Tensor) -> Core | None:
        if _runs_here(t):
            return None
        if self.fallback is None:
            raise CoreError("the fused core runs on CUDA tensors (or under TRITON_INTERPRET=1)")
        return self.fallback

    def core_forward(self, spec: CoreSpec, inputs: CoreInputs, keep_tape: bool = False
                     ) -> CoreOutputs:
        """``Core.core_forward``: T steps, 4 launches a layer and step. The tape is a
        :class:`FusedTape` as a list (empty unless ``keep_tape``)."""
        if (other := self._other(inputs.x0)) is not None:
            return other.core_forward(spec, inputs, keep_tape)
        with torch.inference_mode():
            return _forward(spec, inputs, keep_tape)

    def core_backward(self, spec: CoreSpec, d_top: Tensor, outputs: CoreOutputs, mix: Tensor,
                      wkv: Tensor, layers: Sequence[Tensor]) -> CoreInputs:
        """``Core.core_backward``: 4 launches a layer and step, then the weight gradients."""
        if (other := self._other(d_top)) is not None:
            return other.core_backward(spec, d_top, outputs, mix, wkv, layers)
        with torch.inference_mode():
            return _backward(spec, d_top, outputs, mix, wkv, layers)


def _step_masks(masks: Any, li: int, t: int, ell: int, first_att: int, offsets: Sequence[int],
                BH: int, dummy: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Layer li's dropout masks at step t (att, prob, h, ff), or ``dummy`` for each without
    dropout (and for the attention's where the step does not attend). ``masks``: anything
    with the :class:`~fbtrain.models.core.masks.Masks` tensors (the tape's are named
    mask_*)."""
    if masks is None:
        return dummy, dummy, dummy, dummy
    att, prob, h, ff = masks
    m_att = att[li, t - first_att] if ell else dummy
    m_prob = prob[li, offsets[t]:offsets[t] + BH * ell] if ell else dummy
    return m_att, m_prob, h[li, t], ff[li, t]


def _forward(spec: CoreSpec, inputs: CoreInputs, keep_tape: bool) -> CoreOutputs:
    x0, mem_k, mem_v, mix, wkv, bkv, flat_layers = inputs
    mix, wkv = mix.contiguous(), wkv.contiguous()
    bkv = None if bkv is None else bkv.contiguous()
    B, T, D = x0.shape
    L, H = spec.n_layers, spec.n_heads
    dk = D // H
    n_kv, n0 = mem_k.shape[0], mem_k.shape[2]
    S = n0 + T
    params = _per_layer(flat_layers)
    F, n_pos = params[0]["w1_t"].shape[1], params[0]["rt"].shape[-1]
    new = x0.new_empty
    _check_offsets(2 * n_kv * B * H * S * dk)
    kv = new(2, n_kv, B * H, S, dk)
    kv[0, :, :, :n0] = mem_k
    kv[1, :, :, :n0] = mem_v
    hidden = new(T, L + 1, B, D)
    hidden[:, 0] = x0.transpose(0, 1)
    memory = new(T, B, D)
    masks = draw_masks(spec, x0, n0, F)
    steps = T if keep_tape else 1  # records: per step for the backward, else one scratch
    norm_steps = steps if spec.memory_norm else 1
    tape = FusedTape(
        new(L, steps, B, D), new(L, steps, B), new(L, steps, B), new(L, steps, B, D),
        new(L, steps, B, H, n_pos), new(L, steps, B, H), new(L, steps, B, D),
        new(L, steps, B, D),
        new(L, steps, B), new(L, steps, B), new(L, steps, B, D), new(L, steps, B, F),
        new(norm_steps, B, D), new(norm_steps, B), new(norm_steps, B),
        *((masks.att, masks.prob, masks.h, masks.ff) if masks else (new(0),) * 4))
    m_scr = new(H, B, D)  # attend's per-program copy of the memory vector
    splits = _splits(max(window_of(n0 + t, spec.window)[1] for t in range(T)))
    o_part, m_part, l_part = new(splits, B, D), new(splits, B, H), new(splits, B, H)
    dummy = new(1)
    first_att = 0 if n0 > 0 else 1
    offsets = masks.prob_offset if masks else []
    mask_list = (masks.att, masks.prob, masks.h, masks.ff) if masks else None
    blocks = _blocks(D, H)
    drop = masks is not None
    att_consts = dict(D=D, H=H, DK=dk, L1=L + 1, NKV=n_kv, HAS_BIAS=bkv is not None,
                      NORM=spec.memory_norm, BLOCK_B=BLOCK_B, **blocks, SPLIT=SPLIT, BK=BK,
                      DROPOUT=drop)
    out_consts = dict(D=D, H=H, DK=dk, BLOCK_B=BLOCK_B, BN=BN, BK=BK, DROPOUT=drop)
    ff_in_consts = dict(D=D, F=F, BLOCK_B=BLOCK_B, BD=blocks["BD"], BN=BN, BK=BK, DROPOUT=drop)
    ff_out_consts = dict(D=D, F=F, BLOCK_B=BLOCK_B, BN=BN, BK=BK, DROPOUT=drop)

    def attend(li: int, t: int, r: int, lo: int, ell: int, mem_step: int | None) -> None:
        """Layer li's attention at step t (``ell`` 0: none), first making the memory of
        step ``mem_step`` (None: none)."""
        p, kv_set = params[li], 0 if spec.shared_kv else li
        m_att, m_prob, _, _ = _step_masks(mask_list, li, t, ell, first_att, offsets, B * H, dummy)
        rm = (mem_step if keep_tape else 0) if spec.memory_norm and mem_step is not None else 0
        n_split = _splits(ell)
        _launch("attend", (triton.cdiv(B, BLOCK_B), H, n_split), {
            "x_ptr": hidden[t, li], "k_ptr": kv[0, kv_set], "v_ptr": kv[1, kv_set],
            "ln1_w": p["ln1_w"], "ln1_b": p["ln1_b"], "wq": p["wq"], "uq": p["uq"],
            "rt": p["rt"], "cpos": p["c"], "m_prob": m_prob,
            "a_rec": tape.a[li, r], "mu1_rec": tape.mu1[li, r], "rs1_rec": tape.rs1[li, r],
            "qu_rec": tape.qu[li, r], "score_rec": tape.score[li, r], "o_part": o_part,
            "m_part": m_part, "l_part": l_part,
            "hid_ptr": hidden[mem_step if mem_step is not None else t], "mix": mix,
            "wkv": wkv, "bkv": dummy if bkv is None else bkv, "kv_ptr": kv,
            "mem_ptr": memory[mem_step if mem_step is not None else t],
            "mhat_rec": tape.m_hat[rm], "mu_rec": tape.mu_m[rm], "rs_rec": tape.rs_m[rm],
            "m_scr": m_scr,
            "B": B, "S": S, "lo": lo, "ell": ell, "n_split": n_split, "n_pos": n_pos,
            "mem": int(mem_step is not None),
            "slot": n0 + (mem_step if mem_step is not None else t), "eps": spec.eps,
        }, att_consts)
        if ell:
            _launch("out_proj", _tiles(B, D), {
                "x_ptr": hidden[t, li], "o_part": o_part, "m_part": m_part, "l_part": l_part,
                "n_split": n_split, "wo": p["wo_t"], "bo": p["bo"], "m_att": m_att,
                "o_rec": tape.o[li, r], "lse_rec": tape.lse[li, r], "y_rec": tape.y[li, r],
                "B": B}, out_consts)

    for t in range(T):
        lo, ell = window_of(n0 + t, spec.window)
        r = t if keep_tape else 0
        for li in range(L):
            p = params[li]
            _, _, m_h, m_ff = _step_masks(mask_list, li, t, ell, first_att, offsets, B * H, dummy)
            if ell:  # (a step that makes no memory attends: t > 0, or carried slots)
                attend(li, t, r, lo, ell, t - 1 if li == 0 and t > 0 else None)
            y = tape.y[li, r] if ell else hidden[t, li]
            _launch("ff_in", _tiles(B, F), {
                "y_ptr": y, "ln2_w": p["ln2_w"], "ln2_b": p["ln2_b"], "w1": p["w1_t"],
                "b1": p["b1"], "m_h": m_h, "mu2_rec": tape.mu2[li, r],
                "rs2_rec": tape.rs2[li, r], "c_rec": tape.c[li, r], "h_rec": tape.h[li, r],
                "B": B, "eps": spec.eps}, ff_in_consts)
            _launch("ff_out", _tiles(B, D), {
                "y_ptr": y, "h_rec": tape.h[li, r], "w2": p["w2_t"], "b2": p["b2"],
                "m_ff": m_ff, "out_ptr": hidden[t, li + 1], "B": B}, ff_out_consts)
    attend(0, T - 1, T - 1 if keep_tape else 0, 0, 0, T - 1)  # the last step's memory only
    if keep_tape and first_att:
        tape.y[:, 0] = hidden[0, :L]  # step 0 did not attend: y is x (LN2's backward reads it)
    return CoreOutputs(hidden, memory, kv[0], kv[1], list(tape) if keep_tape else [])


def _check_offsets(elements: int) -> None:
    """The kernels index the whole key/value buffer with 32-bit offsets (Triton's ints):
    refuse sizes past that in one line rather than write out of bounds."""
    if elements >= 2 ** 31:
        raise CoreError(f"the fused core's key/value buffer would hold {elements:,} elements, "
                        "past its 32-bit offsets (2**31); use a smaller batch or window")


def _backward(spec: CoreSpec, d_top: Tensor, outputs: CoreOutputs, mix: Tensor, wkv: Tensor,
              flat_layers: Sequence[Tensor]) -> CoreInputs:
    hidden, memory, keys, values, tape_list = outputs
    tape = FusedTape(*tape_list)
    d_top, mix, wkv = d_top.contiguous(), mix.contiguous(), wkv.contiguous()
    T, _, B, D = hidden.shape
    L, H = spec.n_layers, spec.n_heads
    dk = D // H
    n_kv, S = keys.shape[0], keys.shape[2]
    n0 = S - T
    params = _per_layer(flat_layers)
    F, n_pos = params[0]["w1_t"].shape[1], params[0]["rt"].shape[-1]
    C = 2 * n_kv * D
    dropout = tape.mask_h.numel() > 0
    masks = (tape.mask_att, tape.mask_prob, tape.mask_h, tape.mask_ff) if dropout else None
    d_kv = hidden.new_zeros(2, n_kv, B * H, S, dk)  # every slot's key/value gradients
    dm_raw = hidden.new_zeros(T, B, D)  # zero at the last step: no later step reads it
    dkv_rec = hidden.new_zeros(T, B, C)
    new = hidden.new_empty
    g_out, g_dy, g_df, g_dc = new(L, T, B, D), new(L, T, B, D), new(L, T, B, D), new(L, T, B, D)
    g_dz, g_dqu, g_da, g_dh = new(L, T, B, D), new(L, T, B, D), new(L, T, B, D), new(L, T, B, F)
    g_ds = hidden.new_zeros(L, T, B, H, n_pos)  # score gradients at their position rows
    dqu_part = new(_splits(max(window_of(n0 + t, spec.window)[1] for t in range(T))), B, D)
    dummy = new(1)
    first_att = 0 if n0 > 0 else 1
    offsets = prob_offsets(spec, n0, T, B)
    blocks = _blocks(D, H)
    ffo_consts = dict(D=D, F=F, BLOCK_B=BLOCK_B, BD=blocks["BD"], BN=BN, BK=BK,
                      NORM=spec.memory_norm, DROPOUT=dropout)
    ffi_consts = dict(D=D, F=F, BLOCK_B=BLOCK_B, BN=BN, BK=BK)
    att_consts = dict(D=D, H=H, DK=dk, BLOCK_B=BLOCK_B, **blocks, SPLIT=SPLIT, BK=BK,
                      DROPOUT=dropout)
    q_consts = dict(D=D, H=H, DK=dk, NKV=n_kv, BLOCK_B=BLOCK_B, BN=BN, BK=BK)
    for t in reversed(range(T)):
        lo, ell = window_of(n0 + t, spec.window)
        n_split = _splits(ell)
        rm = t if spec.memory_norm else 0
        for li in reversed(range(L)):
            p, kv_set, top = params[li], 0 if spec.shared_kv else li, li == L - 1
            m_att, m_prob, m_h, m_ff = _step_masks(masks, li, t, ell, first_att, offsets,
                                                   B * H, dummy)
            above = None if top else li + 1
            has_ln = above is not None and ell > 0
            _launch("ffo_back", _tiles(B, F), {
                "src_ptr": d_top[:, t] if top else g_dy[above, t],
                "src_stride": T * D if top else D,
                "dm_ptr": dm_raw[t], "mhat_ptr": tape.m_hat[rm], "rsm_ptr": tape.rs_m[rm],
                "mix": mix, "mix_at": li + 1, "has_ln": int(has_ln),
                "da_ptr": g_da[above, t] if has_ln else dummy, "xa_ptr": hidden[t, li + 1],
                "mu1_ptr": tape.mu1[above, t] if has_ln else dummy,
                "rs1_ptr": tape.rs1[above, t] if has_ln else dummy,
                "ln1_w": params[above]["ln1_w"] if has_ln else dummy,
                "w2": p["w2_t"], "h_rec": tape.h[li, t], "m_ff": m_ff, "m_h": m_h,
                "g_rec": g_out[li, t], "df_rec": g_df[li, t], "dh_rec": g_dh[li, t], "B": B,
            }, ffo_consts)
            _launch("ffi_back", _tiles(B, D), {
                "dh_rec": g_dh[li, t], "w1": p["w1_t"], "dc_rec": g_dc[li, t], "B": B},
                ffi_consts)
            _launch("att_back", (triton.cdiv(B, BLOCK_B), H if ell else 1, n_split), {
                "g_rec": g_out[li, t], "dc_rec": g_dc[li, t], "y_ptr": tape.y[li, t],
                "mu2_rec": tape.mu2[li, t], "rs2_rec": tape.rs2[li, t], "ln2_w": p["ln2_w"],
                "wo": p["wo_t"], "m_att": m_att, "m_prob": m_prob,
                "k_ptr": keys[kv_set], "v_ptr": values[kv_set],
                "dk_ptr": d_kv[0, kv_set], "dv_ptr": d_kv[1, kv_set],
                "qu_rec": tape.qu[li, t], "o_rec": tape.o[li, t],
                "score_rec": tape.score[li, t], "lse_rec": tape.lse[li, t], "rt": p["rt"],
                "dy_rec": g_dy[li, t], "dz_rec": g_dz[li, t], "ds_rec": g_ds[li, t],
                "dqu_part": dqu_part, "B": B, "S": S, "lo": lo, "ell": ell,
                "n_split": n_split, "n_pos": n_pos,
            }, att_consts)
            if ell:
                mem = li == 0 and t > 0  # slot t-1's gradients are complete: make its dm
                _launch("q_back", _tiles(B, D), {
                    "dqu_part": dqu_part, "n_split": n_split, "dqu_rec": g_dqu[li, t],
                    "wq": p["wq"], "da_rec": g_da[li, t],
                    "mem": int(mem), "dkv_ptr": d_kv, "wkv": wkv,
                    "dkv_rec": dkv_rec[t - 1] if mem else dummy,
                    "dm_ptr": dm_raw[t - 1] if mem else dummy,
                    "B": B, "S": S, "slot": n0 + t - 1}, q_consts)
    # What no later step needs, for all steps at once: the memory norm's backward, the
    # embedding's gradient (layer 0's input), the mix and the memory projection's.
    # torch's matmuls here in IEEE float32 whatever the caller's matmul precision (TF32
    # under "high" would move the core past its 1e-4 agreement; precision.py).
    with ieee_float32():
        d_memory = dm_raw
        if spec.memory_norm:
            d_memory = ln_backward(dm_raw, memory, tape.mu_m, tape.rs_m,
                                    torch.ones_like(memory[0, 0]))  # the norm has no affine
        d_x0 = g_dy[0] + mix[0] * d_memory  # [T, B, D]
        a = first_att
        d_x0[a:] += ln_backward(g_da[0, a:], hidden[a:, 0], tape.mu1[0, a:], tape.rs1[0, a:],
                                 params[0]["ln1_w"])
        grads = weight_grads(spec, hidden, memory, tape, params, first_att,
                              (g_dz, g_dqu, g_da, g_df, g_dh, g_dc, g_ds))
        d_mix = torch.einsum("tbd,tlbd->l", d_memory, hidden)
        kv_in = tape.m_hat if spec.memory_norm else memory
        d_flat = dkv_rec.view(T * B, C)
        d_wkv = torch.mm(kv_in.reshape(T * B, D).t(), d_flat)
    return CoreInputs(d_x0.transpose(0, 1).contiguous(), d_kv[0, :, :, :n0],
                      d_kv[1, :, :, :n0], d_mix, d_wkv, d_flat.sum(0), grads)


def core_launches(spec: CoreSpec, inputs: CoreInputs, backward: bool = True
                  ) -> tuple[list[Launch], list[Launch]]:
    """The launches one forward (with its tape) and one backward make for ``inputs``
    (meta tensors are fine: nothing runs)."""
    with recording() as forward_launches:
        outputs = _forward(spec, inputs, keep_tape=True)
    backward_launches: list[Launch] = []
    if backward:
        with recording() as backward_launches:
            _backward(spec, torch.empty_like(inputs.x0), outputs, inputs.mix, inputs.wkv,
                      inputs.layers)
    return forward_launches, backward_launches

