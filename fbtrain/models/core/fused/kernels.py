"""The fused core's Triton kernels: four, one job each (see ``fused/__init__.py``).

- :func:`layer_forward`: one layer at one step for a tile of batch rows, LayerNorm to
  residual: LN1, the query projection, window attention over the memory keys/values with the
  position terms (two passes over the window: scores and their running max and sum, then the
  probabilities and the weighted sum), the output projection, the residual, LN2, the
  feed-forward in chunks of F with its relu, the residual; dropout by reading masks.
- :func:`memory_forward`: one step's memory vector m_t = sum_l mix_l h_t^l, its optional
  normalisation and its key/value projection into the new slot of every key/value set.
- :func:`memory_backward`: the same step's gradients back from the new slot's key/value
  gradients to m_t (through the normalisation).
- :func:`layer_backward`: one layer at one step backwards, activation gradients only: the
  feed-forward, LN2, attention (accumulating the window's key/value gradients, which only
  the program owning those batch rows touches), LN1, and the memory mix's share.

Matmuls whose inner dimension is the width D run in chunks of ``BK``, the left operand
re-read from its record (written just before, behind a barrier): Triton's float32 ``tl.dot``
(FMA, no tensor cores in IEEE precision) holds a whole inner row per thread, and at D = 128
that alone spilled registers.

Every kernel runs one program per tile of ``BLOCK_B`` batch rows; rows never meet, so no
atomics and the results do not depend on the tile. Matrices go through ``tl.dot`` tiles
(``IEEE`` precision: float32 stays float32, no TF32). Records (what the backward and the
weight gradients read) are written to full-call buffers, one [B, ...] slice a launch.
Shapes: D width (``BD`` its power-of-two tile), H heads of DK (``BDK``), F feed-forward
width (chunks of ``BF``), the window in chunks of ``BW``, P position rows.

Kept free of ``@triton.jit`` helpers, so each kernel is one plain function that
``fused.core`` wraps both for the interpreter and for the compiler. Reductions are
``tl.reduce`` with Triton's own combine functions (``_SUM``, ``_MAX``), and zeros
``tl.full``, rather than ``tl.sum``, ``tl.max`` and ``tl.zeros``: those are ``@jit``
functions of triton.language, compiled or interpreted as ``TRITON_INTERPRET`` was when
Triton was imported, so one process could not both interpret these kernels and compile
them. The interpreter reduces with numpy itself when it sees these combine functions.
"""

from __future__ import annotations

import triton.language as tl

_SUM = tl.standard._sum_combine  # what tl.sum reduces with
_MAX = tl.standard._elementwise_max  # and tl.max


def layer_forward(
    x_ptr, out_ptr, k_ptr, v_ptr,
    ln1_w, ln1_b, wq, uq, rt, cpos, wo, bo, ln2_w, ln2_b, w1, b1, w2, b2,
    a_rec, mu1_rec, rs1_rec, qu_rec, prob_rec, o_rec,
    y_rec, mu2_rec, rs2_rec, c_rec, h_rec,
    m_att, m_prob, m_h, m_ff,
    B, S, lo, ell, n_pos, eps,
    D: tl.constexpr, H: tl.constexpr, DK: tl.constexpr, F: tl.constexpr,
    BLOCK_B: tl.constexpr, BD: tl.constexpr, BDK: tl.constexpr, BW: tl.constexpr,
    BF: tl.constexpr, BK: tl.constexpr, DROPOUT: tl.constexpr,
):
    """x [B, D] -> out [B, D] for one layer and step; k/v [B*H, S, DK] its key/value set.
    ``lo``/``ell``: the window's first slot and length (0: memory empty, no attention)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < B
    cols = tl.arange(0, BD)
    dmask = cols < D
    rd = rmask[:, None] & dmask[None, :]
    row_d = rows[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + row_d, mask=rd, other=0.0)
    dks = tl.arange(0, BDK)
    kmask = dks < DK
    y = x
    if ell > 0:
        # LN1
        mean = tl.reduce(x, 1, _SUM) / D
        xc = tl.where(rd, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.reduce(xc * xc, 1, _SUM) / D + eps)
        a = (xc * rstd[:, None] * tl.load(ln1_w + cols, mask=dmask, other=0.0)[None, :]
             + tl.load(ln1_b + cols, mask=dmask, other=0.0)[None, :])
        a = tl.where(rd, a, 0.0)
        tl.store(a_rec + row_d, a, mask=rd)
        tl.debug_barrier()  # the query projection re-reads it in K chunks (module docstring)
        tl.store(mu1_rec + rows, mean, mask=rmask)
        tl.store(rs1_rec + rows, rstd, mask=rmask)
        z = tl.full([BLOCK_B, BD], 0.0, x.dtype)
        for h in range(H):
            hcols = h * DK + dks
            rk = rmask[:, None] & kmask[None, :]
            qu = tl.full([BLOCK_B, BDK], 0.0, x.dtype)
            for k0 in range(0, BD, BK):
                ks = k0 + tl.arange(0, BK)
                kd = ks < D
                a_k = tl.load(a_rec + rows[:, None] * D + ks[None, :],
                              mask=rmask[:, None] & kd[None, :], other=0.0)
                w_k = tl.load(wq + ks[:, None] * D + hcols[None, :],
                              mask=kd[:, None] & kmask[None, :], other=0.0)
                qu += tl.dot(a_k, w_k, input_precision="ieee")
            qu += tl.load(uq + hcols, mask=kmask, other=0.0)[None, :]
            tl.store(qu_rec + rows[:, None] * D + hcols[None, :], qu, mask=rk)
            head = (rows * H + h) * S  # [BLOCK_B] first slot of (row, head)
            prob_row = (rows * H + h) * n_pos
            m_run = tl.full([BLOCK_B], float("-inf"), dtype=x.dtype)
            l_run = tl.full([BLOCK_B], 0.0, x.dtype)
            # Pass 1: the scores (kept in the probability record), their max and sum.
            for j0 in range(0, ell, BW):
                j = j0 + tl.arange(0, BW)
                jmask = j < ell
                pos = n_pos - ell + j  # position row: largest offset first
                kw = rmask[:, None, None] & jmask[None, :, None] & kmask[None, None, :]
                kt = tl.load(k_ptr + ((head[:, None] + lo + j[None, :]) * DK)[:, :, None]
                             + dks[None, None, :], mask=kw, other=0.0)
                s = tl.reduce(qu[:, None, :] * kt, 2, tl.standard._sum_combine)
                r = tl.load(rt + (h * DK + dks[:, None]) * n_pos + pos[None, :],
                            mask=kmask[:, None] & jmask[None, :], other=0.0)
                s += tl.reduce(qu[:, :, None] * r[None, :, :], 1, _SUM)
                s += tl.load(cpos + h * n_pos + pos, mask=jmask, other=0.0)[None, :]
                s = tl.where(jmask[None, :], s, float("-inf"))
                tl.store(prob_rec + prob_row[:, None] + pos[None, :], s,
                         mask=rmask[:, None] & jmask[None, :])
                m_new = tl.maximum(m_run, tl.reduce(s, 1, _MAX))
                l_run = (l_run * tl.exp(m_run - m_new)
                         + tl.reduce(tl.exp(s - m_new[:, None]), 1, _SUM))
                m_run = m_new
            tl.debug_barrier()  # pass 2 reads what other threads of this program wrote
            o = tl.full([BLOCK_B, BDK], 0.0, x.dtype)
            # Pass 2: probabilities (recorded), dropout, the weighted sum of values.
            for j0 in range(0, ell, BW):
                j = j0 + tl.arange(0, BW)
                jmask = j < ell
                pos = n_pos - ell + j
                rj = rmask[:, None] & jmask[None, :]
                s = tl.load(prob_rec + prob_row[:, None] + pos[None, :], mask=rj,
                            other=float("-inf"))
                p = tl.exp(s - m_run[:, None]) / l_run[:, None]
                p = tl.where(rj, p, 0.0)
                tl.store(prob_rec + prob_row[:, None] + pos[None, :], p, mask=rj)
                if DROPOUT:
                    p = p * tl.load(m_prob + ((rows * H + h) * ell)[:, None] + j[None, :],
                                    mask=rj, other=0.0)
                kw = rmask[:, None, None] & jmask[None, :, None] & kmask[None, None, :]
                vt = tl.load(v_ptr + ((head[:, None] + lo + j[None, :]) * DK)[:, :, None]
                             + dks[None, None, :], mask=kw, other=0.0)
                o += tl.reduce(p[:, :, None] * vt, 1, _SUM)
            tl.store(o_rec + rows[:, None] * D + hcols[None, :], o, mask=rk)
            wo_h = tl.load(wo + hcols[:, None] * D + cols[None, :],
                           mask=kmask[:, None] & dmask[None, :], other=0.0)
            z += tl.dot(o, wo_h, input_precision="ieee")
        z += tl.load(bo + cols, mask=dmask, other=0.0)[None, :]
        if DROPOUT:
            z = z * tl.load(m_att + row_d, mask=rd, other=0.0)
        # x re-read rather than held through the heads' loop (registers: see the docstring)
        y = tl.load(x_ptr + row_d, mask=rd, other=0.0) + z
    tl.store(y_rec + row_d, y, mask=rd)
    # LN2 and the feed-forward, F in chunks of BF.
    mean2 = tl.reduce(y, 1, _SUM) / D
    yc = tl.where(rd, y - mean2[:, None], 0.0)
    rstd2 = 1.0 / tl.sqrt(tl.reduce(yc * yc, 1, _SUM) / D + eps)
    c = (yc * rstd2[:, None] * tl.load(ln2_w + cols, mask=dmask, other=0.0)[None, :]
         + tl.load(ln2_b + cols, mask=dmask, other=0.0)[None, :])
    c = tl.where(rd, c, 0.0)
    tl.store(c_rec + row_d, c, mask=rd)
    tl.debug_barrier()  # the first feed-forward matmul re-reads it in K chunks
    tl.store(mu2_rec + rows, mean2, mask=rmask)
    tl.store(rs2_rec + rows, rstd2, mask=rmask)
    f = tl.full([BLOCK_B, BD], 0.0, x.dtype)
    for f0 in range(0, F, BF):
        fc = f0 + tl.arange(0, BF)
        fmask = fc < F
        rf = rmask[:, None] & fmask[None, :]
        hc = tl.full([BLOCK_B, BF], 0.0, x.dtype)
        for k0 in range(0, BD, BK):
            ks = k0 + tl.arange(0, BK)
            kd = ks < D
            c_k = tl.load(c_rec + rows[:, None] * D + ks[None, :],
                          mask=rmask[:, None] & kd[None, :], other=0.0)
            w_k = tl.load(w1 + ks[:, None] * F + fc[None, :], mask=kd[:, None] & fmask[None, :],
                          other=0.0)
            hc += tl.dot(c_k, w_k, input_precision="ieee")
        hc = tl.maximum(hc + tl.load(b1 + fc, mask=fmask, other=0.0)[None, :], 0.0)
        tl.store(h_rec + rows[:, None] * F + fc[None, :], hc, mask=rf)
        if DROPOUT:
            hc = hc * tl.load(m_h + rows[:, None] * F + fc[None, :], mask=rf, other=0.0)
        w2c = tl.load(w2 + fc[:, None] * D + cols[None, :],
                      mask=fmask[:, None] & dmask[None, :], other=0.0)
        f += tl.dot(hc, w2c, input_precision="ieee")
    f += tl.load(b2 + cols, mask=dmask, other=0.0)[None, :]
    if DROPOUT:
        f = f * tl.load(m_ff + row_d, mask=rd, other=0.0)
    tl.store(out_ptr + row_d, y + f, mask=rd)


def memory_forward(
    hid_ptr, mix, wkv, bkv, kv_ptr, mem_ptr, mhat_rec, mu_rec, rs_rec,
    B, S, slot, eps,
    L1: tl.constexpr, D: tl.constexpr, H: tl.constexpr, DK: tl.constexpr,
    NKV: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
    BLOCK_B: tl.constexpr, BD: tl.constexpr, BC: tl.constexpr,
):
    """hid [L+1, B, D] (one step) -> m_t [B, D] and the new slot of kv
    [2, NKV, B*H, S, DK]: all key sets, then all value sets (wkv's column order)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < B
    cols = tl.arange(0, BD)
    dmask = cols < D
    rd = rmask[:, None] & dmask[None, :]
    row_d = rows[:, None] * D + cols[None, :]
    m = tl.full([BLOCK_B, BD], 0.0, mem_ptr.dtype.element_ty)
    for li in tl.static_range(L1):
        m += tl.load(mix + li) * tl.load(hid_ptr + li * B * D + row_d, mask=rd, other=0.0)
    tl.store(mem_ptr + row_d, m, mask=rd)
    if NORM:  # LayerNorm without affine (folded into wkv/bkv by the model)
        mean = tl.reduce(m, 1, _SUM) / D
        mc = tl.where(rd, m - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.reduce(mc * mc, 1, _SUM) / D + eps)
        m = mc * rstd[:, None]
        tl.store(mhat_rec + row_d, m, mask=rd)
        tl.store(mu_rec + rows, mean, mask=rmask)
        tl.store(rs_rec + rows, rstd, mask=rmask)
    C: tl.constexpr = 2 * NKV * D
    for c0 in range(0, C, BC):
        cc = c0 + tl.arange(0, BC)
        cmask = cc < C
        w = tl.load(wkv + cols[:, None] * C + cc[None, :], mask=dmask[:, None] & cmask[None, :],
                    other=0.0)
        kv = tl.dot(m, w, input_precision="ieee")
        if HAS_BIAS:
            kv += tl.load(bkv + cc, mask=cmask, other=0.0)[None, :]
        part = cc // D  # which * NKV + set
        hh = (cc % D) // DK
        dd = cc % DK
        addr = ((part[None, :] * B + rows[:, None]) * H + hh[None, :]) * S * DK + slot * DK \
            + dd[None, :]
        tl.store(kv_ptr + addr, kv, mask=rmask[:, None] & cmask[None, :])


def memory_backward(
    dkv_ptr, wkv, mem_ptr, mu_rec, rs_rec, dm_ptr, dkv_rec,
    B, S, slot,
    D: tl.constexpr, H: tl.constexpr, DK: tl.constexpr, NKV: tl.constexpr,
    NORM: tl.constexpr, BLOCK_B: tl.constexpr, BD: tl.constexpr, BC: tl.constexpr,
):
    """The new slot's key/value gradients (in dkv [2, NKV, B*H, S, DK]) -> recorded as
    dkv_rec [B, 2*NKV*D], and back through the projection (and norm) to dm [B, D]."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < B
    cols = tl.arange(0, BD)
    dmask = cols < D
    rd = rmask[:, None] & dmask[None, :]
    row_d = rows[:, None] * D + cols[None, :]
    C: tl.constexpr = 2 * NKV * D
    dm = tl.full([BLOCK_B, BD], 0.0, dm_ptr.dtype.element_ty)
    for c0 in range(0, C, BC):
        cc = c0 + tl.arange(0, BC)
        cmask = cc < C
        rc = rmask[:, None] & cmask[None, :]
        part = cc // D
        hh = (cc % D) // DK
        dd = cc % DK
        addr = ((part[None, :] * B + rows[:, None]) * H + hh[None, :]) * S * DK + slot * DK \
            + dd[None, :]
        g = tl.load(dkv_ptr + addr, mask=rc, other=0.0)
        tl.store(dkv_rec + rows[:, None] * C + cc[None, :], g, mask=rc)
        wt = tl.load(wkv + cols[None, :] * C + cc[:, None], mask=cmask[:, None] & dmask[None, :],
                     other=0.0)  # [BC, BD]: wkv transposed
        dm += tl.dot(g, wt, input_precision="ieee")
    if NORM:
        x = tl.load(mem_ptr + row_d, mask=rd, other=0.0)
        mean = tl.load(mu_rec + rows, mask=rmask, other=0.0)
        rstd = tl.load(rs_rec + rows, mask=rmask, other=0.0)
        xhat = tl.where(rd, (x - mean[:, None]) * rstd[:, None], 0.0)
        dm = rstd[:, None] * (dm - (tl.reduce(dm, 1, _SUM) / D)[:, None]
                              - xhat * (tl.reduce(dm * xhat, 1, _SUM) / D)[:, None])
        dm = tl.where(rd, dm, 0.0)
    tl.store(dm_ptr + row_d, dm, mask=rd)


def layer_backward(
    dx_ptr, dx_stride, dout_ptr, dout_stride, dm_ptr, mix, li, is_top,
    x_ptr, k_ptr, v_ptr, dk_ptr, dv_ptr,
    ln1_w, wq, rt, wo, ln2_w, w1, w2,
    a_rec, mu1_rec, rs1_rec, qu_rec, prob_rec,
    y_rec, mu2_rec, rs2_rec, h_rec,
    m_att, m_prob, m_h, m_ff,
    dz_rec, dqu_rec, da_rec, df_rec, dh_rec, dc_rec, ds_rec,
    B, S, lo, ell, n_pos, n_layers,
    D: tl.constexpr, H: tl.constexpr, DK: tl.constexpr, F: tl.constexpr,
    BLOCK_B: tl.constexpr, BD: tl.constexpr, BDK: tl.constexpr, BW: tl.constexpr,
    BF: tl.constexpr, BK: tl.constexpr, DROPOUT: tl.constexpr,
):
    """The gradient of one layer's output at one step (dx, rows ``dx_stride`` apart; on the
    top layer plus mix_L times the memory's dm) -> the gradient of its input (dout), the
    window's key/value gradients added to dk/dv [B*H, S, DK], and the activation records
    the weight gradients are built from."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < B
    cols = tl.arange(0, BD)
    dmask = cols < D
    rd = rmask[:, None] & dmask[None, :]
    row_d = rows[:, None] * D + cols[None, :]
    dx = tl.load(dx_ptr + rows[:, None] * dx_stride + cols[None, :], mask=rd, other=0.0)
    if is_top:
        dx += tl.load(mix + n_layers) * tl.load(dm_ptr + row_d, mask=rd, other=0.0)
    # Feed-forward: out = y + Drop(W2 Drop(relu(W1 LN2(y) + b1)) + b2).
    df = dx
    if DROPOUT:
        df = df * tl.load(m_ff + row_d, mask=rd, other=0.0)
    tl.store(df_rec + row_d, df, mask=rd)
    tl.debug_barrier()  # re-read in K chunks below
    dc = tl.full([BLOCK_B, BD], 0.0, dx.dtype)
    for f0 in range(0, F, BF):
        fc = f0 + tl.arange(0, BF)
        fmask = fc < F
        rf = rmask[:, None] & fmask[None, :]
        dh = tl.full([BLOCK_B, BF], 0.0, dx.dtype)
        for k0 in range(0, BD, BK):
            ks = k0 + tl.arange(0, BK)
            kd = ks < D
            df_k = tl.load(df_rec + rows[:, None] * D + ks[None, :],
                           mask=rmask[:, None] & kd[None, :], other=0.0)
            w_k = tl.load(w2 + fc[None, :] * D + ks[:, None], mask=kd[:, None] & fmask[None, :],
                          other=0.0)  # [BK, BF]: w2_t transposed
            dh += tl.dot(df_k, w_k, input_precision="ieee")
        if DROPOUT:
            dh = dh * tl.load(m_h + rows[:, None] * F + fc[None, :], mask=rf, other=0.0)
        hv = tl.load(h_rec + rows[:, None] * F + fc[None, :], mask=rf, other=0.0)
        dh = tl.where(hv > 0, dh, 0.0)
        tl.store(dh_rec + rows[:, None] * F + fc[None, :], dh, mask=rf)
        w1t = tl.load(w1 + cols[None, :] * F + fc[:, None], mask=fmask[:, None] & dmask[None, :],
                      other=0.0)  # [BF, BD]: w1_t transposed
        dc += tl.dot(dh, w1t, input_precision="ieee")
    tl.store(dc_rec + row_d, dc, mask=rd)
    y = tl.load(y_rec + row_d, mask=rd, other=0.0)
    mean2 = tl.load(mu2_rec + rows, mask=rmask, other=0.0)
    rstd2 = tl.load(rs2_rec + rows, mask=rmask, other=0.0)
    yhat = tl.where(rd, (y - mean2[:, None]) * rstd2[:, None], 0.0)
    g = dc * tl.load(ln2_w + cols, mask=dmask, other=0.0)[None, :]
    dy = rstd2[:, None] * (g - (tl.reduce(g, 1, _SUM) / D)[:, None]
                           - yhat * (tl.reduce(g * yhat, 1, _SUM) / D)[:, None]) + dx
    dy = tl.where(rd, dy, 0.0)
    dx_new = dy
    if ell > 0:
        # Attention: y = x + Drop(Wo (softmax(scores) V) + bo).
        dz = dy
        if DROPOUT:
            dz = dz * tl.load(m_att + row_d, mask=rd, other=0.0)
        tl.store(dz_rec + row_d, dz, mask=rd)
        tl.debug_barrier()  # re-read in K chunks below
        dks = tl.arange(0, BDK)
        kmask = dks < DK
        rk = rmask[:, None] & kmask[None, :]
        da = tl.full([BLOCK_B, BD], 0.0, dx.dtype)
        for h in range(H):
            hcols = h * DK + dks
            do = tl.full([BLOCK_B, BDK], 0.0, dx.dtype)
            for k0 in range(0, BD, BK):
                ks = k0 + tl.arange(0, BK)
                kd = ks < D
                dz_k = tl.load(dz_rec + rows[:, None] * D + ks[None, :],
                               mask=rmask[:, None] & kd[None, :], other=0.0)
                w_k = tl.load(wo + hcols[None, :] * D + ks[:, None],
                              mask=kd[:, None] & kmask[None, :], other=0.0)  # wo_t transposed
                do += tl.dot(dz_k, w_k, input_precision="ieee")
            qu = tl.load(qu_rec + rows[:, None] * D + hcols[None, :], mask=rk, other=0.0)
            head = (rows * H + h) * S
            prob_row = (rows * H + h) * n_pos
            rowdot = tl.full([BLOCK_B], 0.0, dx.dtype)
            # Pass 1: d(prob) = do . v (kept in the score-gradient record), dV += p do.
            for j0 in range(0, ell, BW):
                j = j0 + tl.arange(0, BW)
                jmask = j < ell
                pos = n_pos - ell + j
                rj = rmask[:, None] & jmask[None, :]
                kw = rj[:, :, None] & kmask[None, None, :]
                slot_off = ((head[:, None] + lo + j[None, :]) * DK)[:, :, None] + dks[None, None, :]
                vt = tl.load(v_ptr + slot_off, mask=kw, other=0.0)
                dp = tl.reduce(do[:, None, :] * vt, 2, tl.standard._sum_combine)
                p = tl.load(prob_rec + prob_row[:, None] + pos[None, :], mask=rj, other=0.0)
                pu = p
                if DROPOUT:
                    mp = tl.load(m_prob + ((rows * H + h) * ell)[:, None] + j[None, :], mask=rj,
                                 other=0.0)
                    pu = p * mp
                    dp = dp * mp
                dvt = tl.load(dv_ptr + slot_off, mask=kw, other=0.0)
                tl.store(dv_ptr + slot_off, dvt + pu[:, :, None] * do[:, None, :], mask=kw)
                tl.store(ds_rec + prob_row[:, None] + pos[None, :], dp, mask=rj)
                rowdot += tl.reduce(p * dp, 1, _SUM)
            tl.debug_barrier()  # pass 2 reads what other threads of this program wrote
            dqu = tl.full([BLOCK_B, BDK], 0.0, dx.dtype)
            # Pass 2: the softmax backward, then the query's and the keys' gradients.
            for j0 in range(0, ell, BW):
                j = j0 + tl.arange(0, BW)
                jmask = j < ell
                pos = n_pos - ell + j
                rj = rmask[:, None] & jmask[None, :]
                kw = rj[:, :, None] & kmask[None, None, :]
                slot_off = ((head[:, None] + lo + j[None, :]) * DK)[:, :, None] + dks[None, None, :]
                dp = tl.load(ds_rec + prob_row[:, None] + pos[None, :], mask=rj, other=0.0)
                p = tl.load(prob_rec + prob_row[:, None] + pos[None, :], mask=rj, other=0.0)
                ds = tl.where(rj, p * (dp - rowdot[:, None]), 0.0)
                tl.store(ds_rec + prob_row[:, None] + pos[None, :], ds, mask=rj)
                kt = tl.load(k_ptr + slot_off, mask=kw, other=0.0)
                dqu += tl.reduce(ds[:, :, None] * kt, 1, _SUM)
                rtt = tl.load(rt + (h * DK + dks[None, :]) * n_pos + pos[:, None],
                              mask=jmask[:, None] & kmask[None, :], other=0.0)  # [BW, BDK]
                dqu += tl.reduce(ds[:, :, None] * rtt[None, :, :], 1, _SUM)
                dkt = tl.load(dk_ptr + slot_off, mask=kw, other=0.0)
                tl.store(dk_ptr + slot_off, dkt + ds[:, :, None] * qu[:, None, :], mask=kw)
            tl.store(dqu_rec + rows[:, None] * D + hcols[None, :], dqu, mask=rk)
            wqt = tl.load(wq + cols[None, :] * D + hcols[:, None],
                          mask=kmask[:, None] & dmask[None, :], other=0.0)  # [BDK, BD]
            da += tl.dot(dqu, wqt, input_precision="ieee")
        tl.store(da_rec + row_d, da, mask=rd)
        x = tl.load(x_ptr + row_d, mask=rd, other=0.0)
        mean1 = tl.load(mu1_rec + rows, mask=rmask, other=0.0)
        rstd1 = tl.load(rs1_rec + rows, mask=rmask, other=0.0)
        xhat = tl.where(rd, (x - mean1[:, None]) * rstd1[:, None], 0.0)
        g1 = da * tl.load(ln1_w + cols, mask=dmask, other=0.0)[None, :]
        dx_new = rstd1[:, None] * (g1 - (tl.reduce(g1, 1, _SUM) / D)[:, None]
                                   - xhat * (tl.reduce(g1 * xhat, 1, _SUM) / D)[:, None]) + dy
    # dm re-read rather than held through the sweep (registers: see the docstring)
    dx_new += tl.load(mix + li) * tl.load(dm_ptr + row_d, mask=rd, other=0.0)
    tl.store(dout_ptr + rows[:, None] * dout_stride + cols[None, :], dx_new, mask=rd)
