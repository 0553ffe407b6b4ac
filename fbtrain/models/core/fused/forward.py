"""The fused core's forward kernels (the backward's are in ``backward.py``): a token-layer
is four kernels each way, each spread over the GPU by batch tile and by head or column tile
(see ``fused/__init__.py``). The conventions below hold for both modules.

Forward, for one layer at one step (grid: batch tiles x heads x window splits, or batch
tiles x column tiles):

- :func:`attend` (x heads x splits of the window): LN1, the head's query, attention over
  the split's window slots with the position terms (two passes: scores with their running
  max and sum, then the weighted sum) -> the split's partial sums. On layer 0 the last
  split first makes the previous step's memory vector and the head's keys and values of
  it in every key/value set (``mem``).
- :func:`out_proj` (x column tiles of D): o from the splits' partial sums (recorded, with
  the log-sum-exp), y = x + Drop(o Wo + bo).
- :func:`ff_in` (x column tiles of F): h = Drop(relu(LN2(y) W1 + b1)).
- :func:`ff_out` (x column tiles of D): out = y + Drop(h W2 + b2).

Why this split: a LayerNorm needs whole rows and a matmul's output columns can be spread
over programs, so each kernel is a row prologue (statistics over whole rows, recomputed by
every program of the row tile: cheap) followed by one matmul over its own output columns,
the inner dimension in chunks of ``BK``. No program needs another's results within a
launch, so there are no atomics and no grid barriers, results are deterministic for given
tiles (the window split sets the order of some sums: another ``SPLIT`` changes low bits),
and the register footprint is a few [16, 32] tiles whatever the width. A record
that every program of a tile computes alike is written by the first program of the tile
(``wrows``: a row mask made by arithmetic, as the interpreter takes no scalar in a mask).

Matrices go through ``tl.dot`` in ``IEEE`` precision (float32 stays float32, no TF32).
Shapes: B batch, D width (``BD`` its power-of-two tile), H heads of DK (``BDK``), F
feed-forward width, the window of ``ell`` slots from slot ``lo`` in chunks of ``BW``, P
(``n_pos``) position rows, S key/value slots, BLOCK_B batch rows a program. Key/value
buffers are [2, NKV, B*H, S, DK] (keys then values, set by set); a set's keys [B*H, S, DK].

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


def attend(
    x_ptr, k_ptr, v_ptr, ln1_w, ln1_b, wq, uq, rt, cpos, m_prob,
    a_rec, mu1_rec, rs1_rec, qu_rec, score_rec, o_part, m_part, l_part,
    hid_ptr, mix, wkv, bkv, kv_ptr, mem_ptr, mhat_rec, mu_rec, rs_rec, m_scr,
    B, S, lo, ell, n_split, n_pos, mem, slot, eps,
    D: tl.constexpr, H: tl.constexpr, DK: tl.constexpr, L1: tl.constexpr,
    NKV: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
    BLOCK_B: tl.constexpr, BD: tl.constexpr, BDK: tl.constexpr, BW: tl.constexpr,
    SPLIT: tl.constexpr, BK: tl.constexpr, DROPOUT: tl.constexpr,
):
    """x [B, D] -> head h's attention over its share of the window (``SPLIT`` slots from
    split sp's start, of ``n_split``): the unnormalised weighted sum o_part [n_split, B, D]
    (head h's columns), its max m_part and sum l_part [n_split, B, H] (out_proj combines
    them); k/v [B*H, S, DK] the layer's key/value set; the raw scores to score_rec.
    ``mem``: first make memory slot ``slot`` from hid [L+1, B, D] (the previous step's
    layer outputs; by the last split, which reads that slot): m [B, D], its norm, and head
    h's keys and values of it in all NKV sets of kv [2, NKV, B*H, S, DK]. ``ell`` 0: no
    attention."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    rows = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < B
    wrows = rows < B * (h == 0) * (sp == 0)  # the rows the tile's first program records
    dks = tl.arange(0, BDK)
    kmask = dks < DK
    rk = rmask[:, None] & kmask[None, :]
    if (mem > 0) & (sp == n_split - 1):
        mrows = rows < B * (h == 0)  # (this split's first head records the memory)
        # m = sum_l mix_l hid_l, chunk by chunk into this program's own scratch rows (the
        # projection reads it in K chunks), then normalised there in place.
        scr = m_scr + h * B * D
        s1 = tl.full([BLOCK_B], 0.0, mem_ptr.dtype.element_ty)
        for k0 in range(0, BD, BK):
            ks = k0 + tl.arange(0, BK)
            kd = ks < D
            at_k = rows[:, None] * D + ks[None, :]
            rkd = rmask[:, None] & kd[None, :]
            m_k = tl.full([BLOCK_B, BK], 0.0, mem_ptr.dtype.element_ty)
            for li in tl.static_range(L1):
                m_k += tl.load(mix + li) * tl.load(hid_ptr + li * B * D + at_k, mask=rkd,
                                                   other=0.0)
            tl.store(mem_ptr + at_k, m_k, mask=mrows[:, None] & kd[None, :])
            tl.store(scr + at_k, m_k, mask=rkd)
            s1 += tl.reduce(m_k, 1, _SUM)
        if NORM:  # LayerNorm without affine (folded into wkv/bkv by the model)
            mean_m = s1 / D
            s2 = tl.full([BLOCK_B], 0.0, mem_ptr.dtype.element_ty)
            tl.debug_barrier()  # (not relying on a load's layout matching the store's)
            for k0 in range(0, BD, BK):
                ks = k0 + tl.arange(0, BK)
                rkd = rmask[:, None] & (ks < D)[None, :]
                m_k = tl.load(scr + rows[:, None] * D + ks[None, :], mask=rkd, other=0.0)
                mc = tl.where(rkd, m_k - mean_m[:, None], 0.0)
                s2 += tl.reduce(mc * mc, 1, _SUM)
            rstd_m = 1.0 / tl.sqrt(s2 / D + eps)
            tl.store(mu_rec + rows, mean_m, mask=mrows)
            tl.store(rs_rec + rows, rstd_m, mask=mrows)
            tl.debug_barrier()
            for k0 in range(0, BD, BK):
                ks = k0 + tl.arange(0, BK)
                kd = ks < D
                at_k = rows[:, None] * D + ks[None, :]
                rkd = rmask[:, None] & kd[None, :]
                m_k = tl.load(scr + at_k, mask=rkd, other=0.0)
                m_k = tl.where(rkd, (m_k - mean_m[:, None]) * rstd_m[:, None], 0.0)
                tl.store(scr + at_k, m_k, mask=rkd)
                tl.store(mhat_rec + at_k, m_k, mask=mrows[:, None] & kd[None, :])
        tl.debug_barrier()  # the projection reads the scratch in another layout
        C: tl.constexpr = 2 * NKV * D
        for part in range(2 * NKV):  # keys of every set, then values
            col = part * D + h * DK + dks
            kv = tl.full([BLOCK_B, BDK], 0.0, mem_ptr.dtype.element_ty)
            for k0 in range(0, BD, BK):
                ks = k0 + tl.arange(0, BK)
                kd = ks < D
                m_k = tl.load(scr + rows[:, None] * D + ks[None, :],
                              mask=rmask[:, None] & kd[None, :], other=0.0)
                w_k = tl.load(wkv + ks[:, None] * C + col[None, :],
                              mask=kd[:, None] & kmask[None, :], other=0.0)
                kv += tl.dot(m_k, w_k, input_precision="ieee")
            if HAS_BIAS:
                kv += tl.load(bkv + col, mask=kmask, other=0.0)[None, :]
            addr = ((part * B + rows) * H + h) * S * DK + slot * DK
            tl.store(kv_ptr + addr[:, None] + dks[None, :], kv, mask=rk)
        tl.debug_barrier()  # layer 0's attention below reads the slot just written
    if ell > 0:
        s1 = tl.full([BLOCK_B], 0.0, o_part.dtype.element_ty)
        for k0 in range(0, BD, BK):  # LN1's statistics, two passes over chunks
            ks = k0 + tl.arange(0, BK)
            rkd = rmask[:, None] & (ks < D)[None, :]
            s1 += tl.reduce(tl.load(x_ptr + rows[:, None] * D + ks[None, :], mask=rkd,
                                    other=0.0), 1, _SUM)
        mean = s1 / D
        s2 = tl.full([BLOCK_B], 0.0, o_part.dtype.element_ty)
        for k0 in range(0, BD, BK):
            ks = k0 + tl.arange(0, BK)
            rkd = rmask[:, None] & (ks < D)[None, :]
            xc = tl.where(rkd, tl.load(x_ptr + rows[:, None] * D + ks[None, :], mask=rkd,
                                       other=0.0) - mean[:, None], 0.0)
            s2 += tl.reduce(xc * xc, 1, _SUM)
        rstd = 1.0 / tl.sqrt(s2 / D + eps)
        tl.store(mu1_rec + rows, mean, mask=wrows)
        tl.store(rs1_rec + rows, rstd, mask=wrows)
        hcols = h * DK + dks
        qu = tl.full([BLOCK_B, BDK], 0.0, o_part.dtype.element_ty)
        for k0 in range(0, BD, BK):  # LN1 chunk by chunk, straight into the query
            ks = k0 + tl.arange(0, BK)
            kd = ks < D
            rkd = rmask[:, None] & kd[None, :]
            x_k = tl.load(x_ptr + rows[:, None] * D + ks[None, :], mask=rkd, other=0.0)
            a_k = ((x_k - mean[:, None]) * rstd[:, None]
                   * tl.load(ln1_w + ks, mask=kd, other=0.0)[None, :]
                   + tl.load(ln1_b + ks, mask=kd, other=0.0)[None, :])
            a_k = tl.where(rkd, a_k, 0.0)
            tl.store(a_rec + rows[:, None] * D + ks[None, :], a_k,
                     mask=wrows[:, None] & kd[None, :])
            w_k = tl.load(wq + ks[:, None] * D + hcols[None, :],
                          mask=kd[:, None] & kmask[None, :], other=0.0)
            qu += tl.dot(a_k, w_k, input_precision="ieee")
        qu += tl.load(uq + hcols, mask=kmask, other=0.0)[None, :]
        tl.store(qu_rec + rows[:, None] * D + hcols[None, :], qu,
                 mask=(rows < B * (sp == 0))[:, None] & kmask[None, :])
        head = (rows * H + h) * S  # [BLOCK_B] first slot of (row, head)
        prob_row = (rows * H + h) * n_pos
        j_lo = sp * SPLIT  # this split's window slots: j_lo .. j_hi - 1
        j_hi = tl.minimum(ell, j_lo + SPLIT)
        m_run = tl.full([BLOCK_B], float("-inf"), dtype=qu.dtype)
        l_run = tl.full([BLOCK_B], 0.0, qu.dtype)
        # Pass 1: the scores (recorded), their max and sum.
        for j0 in range(j_lo, j_hi, BW):
            j = j0 + tl.arange(0, BW)
            jmask = j < j_hi
            pos = n_pos - ell + j  # position row: largest offset first
            kw = rmask[:, None, None] & jmask[None, :, None] & kmask[None, None, :]
            kt = tl.load(k_ptr + ((head[:, None] + lo + j[None, :]) * DK)[:, :, None]
                         + dks[None, None, :], mask=kw, other=0.0)
            r = tl.load(rt + (h * DK + dks[None, :]) * n_pos + pos[:, None],
                        mask=jmask[:, None] & kmask[None, :], other=0.0)  # [BW, BDK]
            # Content and position terms in one product: q.k + q.r = q.(k + r). (Not a
            # separate sum of q[:, :, None] * r[None]: Triton rewrites that broadcast-
            # multiply-reduce into a dot in TF32, which the compile check refuses.)
            s = tl.reduce(qu[:, None, :] * (kt + r[None, :, :]), 2, _SUM)
            s += tl.load(cpos + h * n_pos + pos, mask=jmask, other=0.0)[None, :]
            s = tl.where(jmask[None, :], s, float("-inf"))
            tl.store(score_rec + prob_row[:, None] + pos[None, :], s,
                     mask=rmask[:, None] & jmask[None, :])
            m_new = tl.maximum(m_run, tl.reduce(s, 1, _MAX))
            l_run = (l_run * tl.exp(m_run - m_new)
                     + tl.reduce(tl.exp(s - m_new[:, None]), 1, _SUM))
            m_run = m_new
        tl.debug_barrier()  # pass 2 reads what other threads of this program wrote
        o = tl.full([BLOCK_B, BDK], 0.0, qu.dtype)
        # Pass 2: dropout and the weighted sum of values, exp(s - max) unnormalised.
        for j0 in range(j_lo, j_hi, BW):
            j = j0 + tl.arange(0, BW)
            jmask = j < j_hi
            pos = n_pos - ell + j
            rj = rmask[:, None] & jmask[None, :]
            s = tl.load(score_rec + prob_row[:, None] + pos[None, :], mask=rj,
                        other=float("-inf"))
            p = tl.where(rj, tl.exp(s - m_run[:, None]), 0.0)
            if DROPOUT:
                p = p * tl.load(m_prob + ((rows * H + h) * ell)[:, None] + j[None, :],
                                mask=rj, other=0.0)
            kw = rmask[:, None, None] & jmask[None, :, None] & kmask[None, None, :]
            vt = tl.load(v_ptr + ((head[:, None] + lo + j[None, :]) * DK)[:, :, None]
                         + dks[None, None, :], mask=kw, other=0.0)
            o += tl.reduce(p[:, :, None] * vt, 1, _SUM)
        tl.store(o_part + sp * B * D + rows[:, None] * D + hcols[None, :], o, mask=rk)
        tl.store(m_part + (sp * B + rows) * H + h, m_run, mask=rmask)
        tl.store(l_part + (sp * B + rows) * H + h, l_run, mask=rmask)


def out_proj(
    x_ptr, o_part, m_part, l_part, n_split, wo, bo, m_att, o_rec, lse_rec, y_rec, B,
    D: tl.constexpr, H: tl.constexpr, DK: tl.constexpr, BLOCK_B: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, DROPOUT: tl.constexpr,
):
    """Columns n of y = x + Drop(o Wo + bo): x, o, y [B, D]; wo [D, D] (Wo transposed).
    o is the window splits' partial sums combined (o_part [n_split, B, D], their maxima
    m_part and sums l_part [n_split, B, H]); it and each head's log-sum-exp lse [B, H]
    (the backward's probabilities: exp(score - lse)) are recorded."""
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < B
    wrows = rows < B * (tl.program_id(1) == 0)  # the rows the tile's first program records
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = n < D
    rn = rmask[:, None] & nmask[None, :]
    z = tl.full([BLOCK_B, BN], 0.0, y_rec.dtype.element_ty)
    for k0 in range(0, D, BK):
        ks = k0 + tl.arange(0, BK)
        kd = ks < D
        rkd = rmask[:, None] & kd[None, :]
        at_k = rows[:, None] * D + ks[None, :]
        at_h = rows[:, None] * H + (ks // DK)[None, :]  # each column's (row, head)
        m_all = tl.full([BLOCK_B, BK], float("-inf"), dtype=z.dtype)
        for s in range(n_split):
            m_all = tl.maximum(m_all, tl.load(m_part + s * B * H + at_h, mask=rkd,
                                              other=float("-inf")))
        m_all = tl.where(rkd, m_all, 0.0)
        l_all = tl.full([BLOCK_B, BK], 0.0, z.dtype)
        o_k = tl.full([BLOCK_B, BK], 0.0, z.dtype)
        for s in range(n_split):  # each split's sums rescaled to the common max
            e = tl.exp(tl.load(m_part + s * B * H + at_h, mask=rkd, other=0.0) - m_all)
            l_all += e * tl.load(l_part + s * B * H + at_h, mask=rkd, other=0.0)
            o_k += e * tl.load(o_part + s * B * D + at_k, mask=rkd, other=0.0)
        o_k = tl.where(rkd, o_k / tl.where(rkd, l_all, 1.0), 0.0)
        tl.store(o_rec + at_k, o_k, mask=wrows[:, None] & kd[None, :])
        tl.store(lse_rec + at_h, m_all + tl.log(tl.where(rkd, l_all, 1.0)),
                 mask=wrows[:, None] & kd[None, :])
        w_k = tl.load(wo + ks[:, None] * D + n[None, :], mask=kd[:, None] & nmask[None, :],
                      other=0.0)
        z += tl.dot(o_k, w_k, input_precision="ieee")
    z += tl.load(bo + n, mask=nmask, other=0.0)[None, :]
    if DROPOUT:
        z = z * tl.load(m_att + rows[:, None] * D + n[None, :], mask=rn, other=0.0)
    y = tl.load(x_ptr + rows[:, None] * D + n[None, :], mask=rn, other=0.0) + z
    tl.store(y_rec + rows[:, None] * D + n[None, :], y, mask=rn)


def ff_in(
    y_ptr, ln2_w, ln2_b, w1, b1, m_h, mu2_rec, rs2_rec, c_rec, h_rec, B, eps,
    D: tl.constexpr, F: tl.constexpr, BLOCK_B: tl.constexpr, BD: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, DROPOUT: tl.constexpr,
):
    """Columns n of h = Drop(relu(LN2(y) W1 + b1)): y [B, D] -> h [B, F] (recorded after
    dropout: its sign still gives relu's derivative where the mask kept the unit);
    w1 [D, F] (W1 transposed)."""
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < B
    wrows = rows < B * (tl.program_id(1) == 0)  # the rows the tile's first program records
    s1 = tl.full([BLOCK_B], 0.0, h_rec.dtype.element_ty)
    for k0 in range(0, BD, BK):  # LN2's statistics, two passes over chunks
        ks = k0 + tl.arange(0, BK)
        rkd = rmask[:, None] & (ks < D)[None, :]
        s1 += tl.reduce(tl.load(y_ptr + rows[:, None] * D + ks[None, :], mask=rkd, other=0.0),
                        1, _SUM)
    mean = s1 / D
    s2 = tl.full([BLOCK_B], 0.0, h_rec.dtype.element_ty)
    for k0 in range(0, BD, BK):
        ks = k0 + tl.arange(0, BK)
        rkd = rmask[:, None] & (ks < D)[None, :]
        yc = tl.where(rkd, tl.load(y_ptr + rows[:, None] * D + ks[None, :], mask=rkd,
                                   other=0.0) - mean[:, None], 0.0)
        s2 += tl.reduce(yc * yc, 1, _SUM)
    rstd = 1.0 / tl.sqrt(s2 / D + eps)
    tl.store(mu2_rec + rows, mean, mask=wrows)
    tl.store(rs2_rec + rows, rstd, mask=wrows)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = n < F
    rn = rmask[:, None] & nmask[None, :]
    acc = tl.full([BLOCK_B, BN], 0.0, h_rec.dtype.element_ty)
    for k0 in range(0, BD, BK):
        ks = k0 + tl.arange(0, BK)
        kd = ks < D
        rkd = rmask[:, None] & kd[None, :]
        y_k = tl.load(y_ptr + rows[:, None] * D + ks[None, :], mask=rkd, other=0.0)
        c_k = ((y_k - mean[:, None]) * rstd[:, None]
               * tl.load(ln2_w + ks, mask=kd, other=0.0)[None, :]
               + tl.load(ln2_b + ks, mask=kd, other=0.0)[None, :])
        c_k = tl.where(rkd, c_k, 0.0)
        tl.store(c_rec + rows[:, None] * D + ks[None, :], c_k, mask=wrows[:, None] & kd[None, :])
        w_k = tl.load(w1 + ks[:, None] * F + n[None, :], mask=kd[:, None] & nmask[None, :],
                      other=0.0)
        acc += tl.dot(c_k, w_k, input_precision="ieee")
    hv = tl.maximum(acc + tl.load(b1 + n, mask=nmask, other=0.0)[None, :], 0.0)
    if DROPOUT:
        hv = hv * tl.load(m_h + rows[:, None] * F + n[None, :], mask=rn, other=0.0)
    tl.store(h_rec + rows[:, None] * F + n[None, :], hv, mask=rn)


def ff_out(
    y_ptr, h_rec, w2, b2, m_ff, out_ptr, B,
    D: tl.constexpr, F: tl.constexpr, BLOCK_B: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, DROPOUT: tl.constexpr,
):
    """Columns n of out = y + Drop(h W2 + b2): h [B, F], y and out [B, D]; w2 [F, D]."""
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < B
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = n < D
    rn = rmask[:, None] & nmask[None, :]
    f = tl.full([BLOCK_B, BN], 0.0, out_ptr.dtype.element_ty)
    for k0 in range(0, F, BK):
        ks = k0 + tl.arange(0, BK)
        kf = ks < F
        h_k = tl.load(h_rec + rows[:, None] * F + ks[None, :], mask=rmask[:, None] & kf[None, :],
                      other=0.0)
        w_k = tl.load(w2 + ks[:, None] * D + n[None, :], mask=kf[:, None] & nmask[None, :],
                      other=0.0)
        f += tl.dot(h_k, w_k, input_precision="ieee")
    f += tl.load(b2 + n, mask=nmask, other=0.0)[None, :]
    if DROPOUT:
        f = f * tl.load(m_ff + rows[:, None] * D + n[None, :], mask=rn, other=0.0)
    y = tl.load(y_ptr + rows[:, None] * D + n[None, :], mask=rn, other=0.0)
    tl.store(out_ptr + rows[:, None] * D + n[None, :], y + f, mask=rn)
