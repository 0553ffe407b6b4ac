"""The fused core's backward kernels: activation gradients only, four a token-layer (the
weight gradients are batched matmuls after the sweep, ``core.py``). The forward's module
(``forward.py``) states the conventions both follow: the grids, the row prologues, the
records written by a tile's first program, the shapes, and why there are no ``@jit``
helpers (``_SUM`` below is the same combine function as there).

- :func:`ffo_back` (x column tiles of F): the gradient g of the layer's output, composed from
  the layer above's records (its dy, the LN1 backward of its attention input gradient, the
  memory's gradient) -> dh.
- :func:`ffi_back` (x column tiles of D): dc = dh W1^T.
- :func:`att_back` (x heads x splits): LN2 backward (dy), the head's dz Wo^T, the
  attention backward over the split's slots (their key/value gradients of the head, owned
  by this program) -> the split's share of dqu.
- :func:`q_back` (x column tiles of D): da = dqu Wq^T; on layer 0 also the previous step's
  memory gradient from its keys'/values' gradients (before the memory norm's backward,
  which the next kernels apply: it needs whole rows).
"""

from __future__ import annotations

import triton.language as tl

_SUM = tl.standard._sum_combine  # what tl.sum reduces with


def ffo_back(
    src_ptr, src_stride, dm_ptr, mhat_ptr, rsm_ptr, mix, mix_at,
    has_ln, da_ptr, xa_ptr, mu1_ptr, rs1_ptr, ln1_w,
    w2, h_rec, m_ff, m_h, g_rec, df_rec, dh_rec, B,
    D: tl.constexpr, F: tl.constexpr, BLOCK_B: tl.constexpr, BD: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, NORM: tl.constexpr, DROPOUT: tl.constexpr,
):
    """Columns n of dh [B, F], from the gradient of the layer's output
    g = src + [has_ln] LN1'(da) + mix[mix_at] * dm, recorded as g_rec [B, D] (and
    df = Drop'(g) as df_rec). src: the loss's gradient of the top layer's output (rows
    ``src_stride`` apart), else the layer above's dy. LN1'(da): the layer above's LN1
    backward (da its output's gradient, xa = this layer's output, mu1/rs1 its statistics,
    ln1_w its weight). dm [B, D]: the memory's gradient, before the memory norm's backward
    (mhat and rsm: the norm's output and 1/std) where NORM."""
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < B
    wrows = rows < B * (tl.program_id(1) == 0)  # the rows the tile's first program records
    # Row sums of the two LayerNorm backwards, over chunks.
    s_g = tl.full([BLOCK_B], 0.0, g_rec.dtype.element_ty)
    s_gx = tl.full([BLOCK_B], 0.0, g_rec.dtype.element_ty)
    s_m = tl.full([BLOCK_B], 0.0, g_rec.dtype.element_ty)
    s_mx = tl.full([BLOCK_B], 0.0, g_rec.dtype.element_ty)
    mean1 = tl.load(mu1_ptr + rows, mask=rows < B * (has_ln > 0), other=0.0)
    rstd1 = tl.load(rs1_ptr + rows, mask=rows < B * (has_ln > 0), other=0.0)
    rstd_m = tl.full([BLOCK_B], 0.0, g_rec.dtype.element_ty)
    if NORM:
        rstd_m = tl.load(rsm_ptr + rows, mask=rmask, other=0.0)
    for k0 in range(0, BD, BK):
        ks = k0 + tl.arange(0, BK)
        kd = ks < D
        rkd = rmask[:, None] & kd[None, :]
        at_k = rows[:, None] * D + ks[None, :]
        if has_ln:
            g1_k = (tl.load(da_ptr + at_k, mask=rkd, other=0.0)
                    * tl.load(ln1_w + ks, mask=kd, other=0.0)[None, :])
            xhat_k = tl.where(rkd, (tl.load(xa_ptr + at_k, mask=rkd, other=0.0)
                                    - mean1[:, None]) * rstd1[:, None], 0.0)
            s_g += tl.reduce(g1_k, 1, _SUM)
            s_gx += tl.reduce(g1_k * xhat_k, 1, _SUM)
        if NORM:
            dm_k = tl.load(dm_ptr + at_k, mask=rkd, other=0.0)
            s_m += tl.reduce(dm_k, 1, _SUM)
            s_mx += tl.reduce(dm_k * tl.load(mhat_ptr + at_k, mask=rkd, other=0.0), 1, _SUM)
    s_g, s_gx, s_m, s_mx = s_g / D, s_gx / D, s_m / D, s_mx / D
    mix_w = tl.load(mix + mix_at)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = n < F
    rn = rmask[:, None] & nmask[None, :]
    acc = tl.full([BLOCK_B, BN], 0.0, g_rec.dtype.element_ty)
    for k0 in range(0, BD, BK):
        ks = k0 + tl.arange(0, BK)
        kd = ks < D
        rkd = rmask[:, None] & kd[None, :]
        at_k = rows[:, None] * D + ks[None, :]
        g = tl.load(src_ptr + rows[:, None] * src_stride + ks[None, :], mask=rkd, other=0.0)
        if has_ln:
            g1_k = (tl.load(da_ptr + at_k, mask=rkd, other=0.0)
                    * tl.load(ln1_w + ks, mask=kd, other=0.0)[None, :])
            xhat_k = (tl.load(xa_ptr + at_k, mask=rkd, other=0.0) - mean1[:, None]) * rstd1[:, None]
            g += rstd1[:, None] * (g1_k - s_g[:, None] - xhat_k * s_gx[:, None])
        dm_k = tl.load(dm_ptr + at_k, mask=rkd, other=0.0)
        if NORM:
            mhat_k = tl.load(mhat_ptr + at_k, mask=rkd, other=0.0)
            dm_k = rstd_m[:, None] * (dm_k - s_m[:, None] - mhat_k * s_mx[:, None])
        g = tl.where(rkd, g + mix_w * dm_k, 0.0)
        tl.store(g_rec + at_k, g, mask=wrows[:, None] & kd[None, :])
        if DROPOUT:
            g = g * tl.load(m_ff + at_k, mask=rkd, other=0.0)
        tl.store(df_rec + at_k, g, mask=wrows[:, None] & kd[None, :])
        w_k = tl.load(w2 + n[None, :] * D + ks[:, None], mask=kd[:, None] & nmask[None, :],
                      other=0.0)  # [BK, BN]: w2 [F, D] transposed
        acc += tl.dot(g, w_k, input_precision="ieee")
    hv = tl.load(h_rec + rows[:, None] * F + n[None, :], mask=rn, other=0.0)
    if DROPOUT:
        acc = acc * tl.load(m_h + rows[:, None] * F + n[None, :], mask=rn, other=0.0)
    tl.store(dh_rec + rows[:, None] * F + n[None, :], tl.where(hv > 0, acc, 0.0), mask=rn)


def ffi_back(
    dh_rec, w1, dc_rec, B,
    D: tl.constexpr, F: tl.constexpr, BLOCK_B: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr,
):
    """Columns n of dc = dh W1^T: dh [B, F] -> dc [B, D]; w1 [D, F] (W1 transposed)."""
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < B
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = n < D
    acc = tl.full([BLOCK_B, BN], 0.0, dc_rec.dtype.element_ty)
    for k0 in range(0, F, BK):
        ks = k0 + tl.arange(0, BK)
        kf = ks < F
        dh_k = tl.load(dh_rec + rows[:, None] * F + ks[None, :],
                       mask=rmask[:, None] & kf[None, :], other=0.0)
        w_k = tl.load(w1 + n[None, :] * F + ks[:, None], mask=kf[:, None] & nmask[None, :],
                      other=0.0)
        acc += tl.dot(dh_k, w_k, input_precision="ieee")
    tl.store(dc_rec + rows[:, None] * D + n[None, :], acc, mask=rmask[:, None] & nmask[None, :])


def att_back(
    g_rec, dc_rec, y_ptr, mu2_rec, rs2_rec, ln2_w, wo, m_att, m_prob,
    k_ptr, v_ptr, dk_ptr, dv_ptr, qu_rec, o_rec, score_rec, lse_rec, rt,
    dy_rec, dz_rec, ds_rec, dqu_part,
    B, S, lo, ell, n_split, n_pos,
    D: tl.constexpr, H: tl.constexpr, DK: tl.constexpr, BLOCK_B: tl.constexpr,
    BD: tl.constexpr, BDK: tl.constexpr, BW: tl.constexpr, SPLIT: tl.constexpr,
    BK: tl.constexpr, DROPOUT: tl.constexpr,
):
    """LN2's backward: dy = LN2'(dc) + g [B, D] (recorded); then, where the step attends,
    head h's gradients over its split sp of the window (``SPLIT`` slots): do_h =
    Drop'(dy) Wo^T, the split's key/value gradients added to dk/dv [B*H, S, DK] (this
    program's rows, head and slots only), and its share of dqu's head-h columns in
    dqu_part [n_split, B, D] (q_back sums them). The probabilities are exp(score - lse),
    and the softmax's row term sum_j p_j dp_j is do . o (o recorded after the weighted sum),
    so a split needs nothing from the others."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    rows = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < B
    wrows = rows < B * (h == 0) * (sp == 0)  # the rows the tile's first program records
    mean2 = tl.load(mu2_rec + rows, mask=rmask, other=0.0)
    rstd2 = tl.load(rs2_rec + rows, mask=rmask, other=0.0)
    s_g = tl.full([BLOCK_B], 0.0, dy_rec.dtype.element_ty)
    s_gy = tl.full([BLOCK_B], 0.0, dy_rec.dtype.element_ty)
    for k0 in range(0, BD, BK):  # LN2's backward: its row sums, over chunks
        ks = k0 + tl.arange(0, BK)
        kd = ks < D
        rkd = rmask[:, None] & kd[None, :]
        at_k = rows[:, None] * D + ks[None, :]
        g2_k = (tl.load(dc_rec + at_k, mask=rkd, other=0.0)
                * tl.load(ln2_w + ks, mask=kd, other=0.0)[None, :])
        yhat_k = tl.where(rkd, (tl.load(y_ptr + at_k, mask=rkd, other=0.0) - mean2[:, None])
                          * rstd2[:, None], 0.0)
        s_g += tl.reduce(g2_k, 1, _SUM)
        s_gy += tl.reduce(g2_k * yhat_k, 1, _SUM)
    s_g, s_gy = s_g / D, s_gy / D
    dks = tl.arange(0, BDK)
    kmask = dks < DK
    rk = rmask[:, None] & kmask[None, :]
    hcols = h * DK + dks
    do = tl.full([BLOCK_B, BDK], 0.0, dy_rec.dtype.element_ty)
    for k0 in range(0, BD, BK):
        ks = k0 + tl.arange(0, BK)
        kd = ks < D
        rkd = rmask[:, None] & kd[None, :]
        at_k = rows[:, None] * D + ks[None, :]
        g2_k = (tl.load(dc_rec + at_k, mask=rkd, other=0.0)
                * tl.load(ln2_w + ks, mask=kd, other=0.0)[None, :])
        yhat_k = (tl.load(y_ptr + at_k, mask=rkd, other=0.0) - mean2[:, None]) * rstd2[:, None]
        dy = (rstd2[:, None] * (g2_k - s_g[:, None] - yhat_k * s_gy[:, None])
              + tl.load(g_rec + at_k, mask=rkd, other=0.0))
        dy = tl.where(rkd, dy, 0.0)
        tl.store(dy_rec + at_k, dy, mask=wrows[:, None] & kd[None, :])
        if ell > 0:
            if DROPOUT:
                dy = dy * tl.load(m_att + at_k, mask=rkd, other=0.0)
            tl.store(dz_rec + at_k, dy, mask=wrows[:, None] & kd[None, :])
            w_k = tl.load(wo + hcols[None, :] * D + ks[:, None],
                          mask=kd[:, None] & kmask[None, :], other=0.0)  # wo [D, D] transposed
            do += tl.dot(dy, w_k, input_precision="ieee")
    if ell > 0:
        qu = tl.load(qu_rec + rows[:, None] * D + hcols[None, :], mask=rk, other=0.0)
        o = tl.load(o_rec + rows[:, None] * D + hcols[None, :], mask=rk, other=0.0)
        rowdot = tl.reduce(do * o, 1, _SUM)
        lse = tl.load(lse_rec + rows * H + h, mask=rmask, other=0.0)
        head = (rows * H + h) * S
        prob_row = (rows * H + h) * n_pos
        j_lo = sp * SPLIT
        j_hi = tl.minimum(ell, j_lo + SPLIT)
        # Pass 1: the values' gradients and the scores' (ds, recorded). Two passes, as in
        # attend, keep half the window tiles live at once (one pass held 234-255 registers
        # where the loads are not 16-byte aligned).
        for j0 in range(j_lo, j_hi, BW):
            j = j0 + tl.arange(0, BW)
            jmask = j < j_hi
            pos = n_pos - ell + j
            rj = rmask[:, None] & jmask[None, :]
            kw = rj[:, :, None] & kmask[None, None, :]
            slot_off = ((head[:, None] + lo + j[None, :]) * DK)[:, :, None] + dks[None, None, :]
            vt = tl.load(v_ptr + slot_off, mask=kw, other=0.0)
            dp = tl.reduce(do[:, None, :] * vt, 2, _SUM)  # d(prob) = do . v
            s = tl.load(score_rec + prob_row[:, None] + pos[None, :], mask=rj,
                        other=float("-inf"))
            p = tl.where(rj, tl.exp(s - lse[:, None]), 0.0)
            pu = p
            if DROPOUT:
                mp = tl.load(m_prob + ((rows * H + h) * ell)[:, None] + j[None, :], mask=rj,
                             other=0.0)
                pu = p * mp
                dp = dp * mp
            dvt = tl.load(dv_ptr + slot_off, mask=kw, other=0.0)
            tl.store(dv_ptr + slot_off, dvt + pu[:, :, None] * do[:, None, :], mask=kw)
            ds = tl.where(rj, p * (dp - rowdot[:, None]), 0.0)  # the softmax backward
            tl.store(ds_rec + prob_row[:, None] + pos[None, :], ds, mask=rj)
        tl.debug_barrier()  # pass 2 reads what other threads of this program wrote
        # Pass 2: the query's and the keys' gradients from ds.
        dqu = tl.full([BLOCK_B, BDK], 0.0, do.dtype)
        for j0 in range(j_lo, j_hi, BW):
            j = j0 + tl.arange(0, BW)
            jmask = j < j_hi
            pos = n_pos - ell + j
            rj = rmask[:, None] & jmask[None, :]
            kw = rj[:, :, None] & kmask[None, None, :]
            slot_off = ((head[:, None] + lo + j[None, :]) * DK)[:, :, None] + dks[None, None, :]
            ds = tl.load(ds_rec + prob_row[:, None] + pos[None, :], mask=rj, other=0.0)
            kt = tl.load(k_ptr + slot_off, mask=kw, other=0.0)
            rtt = tl.load(rt + (h * DK + dks[None, :]) * n_pos + pos[:, None],
                          mask=jmask[:, None] & kmask[None, :], other=0.0)  # [BW, BDK]
            # ds.k + ds.r in one product (a separate ds[:, :, None] * rtt[None] reduce is
            # rewritten by Triton into a TF32 dot: see attend).
            dqu += tl.reduce(ds[:, :, None] * (kt + rtt[None, :, :]), 1, _SUM)
            dkt = tl.load(dk_ptr + slot_off, mask=kw, other=0.0)
            tl.store(dk_ptr + slot_off, dkt + ds[:, :, None] * qu[:, None, :], mask=kw)
        tl.store(dqu_part + sp * B * D + rows[:, None] * D + hcols[None, :], dqu, mask=rk)


def q_back(
    dqu_part, n_split, dqu_rec, wq, da_rec, mem, dkv_ptr, wkv, dkv_rec, dm_ptr, B, S, slot,
    D: tl.constexpr, H: tl.constexpr, DK: tl.constexpr, NKV: tl.constexpr,
    BLOCK_B: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    """Columns n of da = dqu Wq^T [B, D] (wq [D, D]), dqu [B, D] the sum of the window
    splits' dqu_part [n_split, B, D] (recorded as dqu_rec). ``mem``: also memory slot ``slot``'s
    keys'/values' gradients from dkv [2, NKV, B*H, S, DK] -> recorded as dkv_rec
    [B, 2*NKV*D], and columns n of dm = dkv_rec Wkv^T [B, D] (wkv [D, 2*NKV*D]), before
    the memory norm's backward."""
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < B
    wrows = rows < B * (tl.program_id(1) == 0)  # the rows the tile's first program records
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = n < D
    rn = rmask[:, None] & nmask[None, :]
    acc = tl.full([BLOCK_B, BN], 0.0, da_rec.dtype.element_ty)
    for k0 in range(0, D, BK):
        ks = k0 + tl.arange(0, BK)
        kd = ks < D
        rkd = rmask[:, None] & kd[None, :]
        g = tl.full([BLOCK_B, BK], 0.0, acc.dtype)
        for s in range(n_split):
            g += tl.load(dqu_part + s * B * D + rows[:, None] * D + ks[None, :], mask=rkd,
                         other=0.0)
        tl.store(dqu_rec + rows[:, None] * D + ks[None, :], g, mask=wrows[:, None] & kd[None, :])
        w_k = tl.load(wq + n[None, :] * D + ks[:, None], mask=kd[:, None] & nmask[None, :],
                      other=0.0)  # [BK, BN]: wq transposed
        acc += tl.dot(g, w_k, input_precision="ieee")
    tl.store(da_rec + rows[:, None] * D + n[None, :], acc, mask=rn)
    if mem > 0:
        C: tl.constexpr = 2 * NKV * D
        dm = tl.full([BLOCK_B, BN], 0.0, da_rec.dtype.element_ty)
        for c0 in range(0, C, BK):
            cc = c0 + tl.arange(0, BK)
            cmask = cc < C
            rc = rmask[:, None] & cmask[None, :]
            addr = (((cc // D)[None, :] * B + rows[:, None]) * H + ((cc % D) // DK)[None, :]) \
                * S * DK + slot * DK + (cc % DK)[None, :]
            g = tl.load(dkv_ptr + addr, mask=rc, other=0.0)
            tl.store(dkv_rec + rows[:, None] * C + cc[None, :], g,
                     mask=wrows[:, None] & cmask[None, :])
            w_k = tl.load(wkv + n[None, :] * C + cc[:, None], mask=cmask[:, None] & nmask[None, :],
                          other=0.0)  # [BK, BN]: wkv transposed
            dm += tl.dot(g, w_k, input_precision="ieee")
        tl.store(dm_ptr + rows[:, None] * D + n[None, :], dm, mask=rn)
