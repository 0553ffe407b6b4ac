"""The fused core's gradients that no later step needs, made after the backward sweep for
all steps at once from its records: every layer weight's (batched matmuls over steps and
rows), and the LayerNorm backward the post-sweep gradients use."""

from __future__ import annotations

import torch
from torch import Tensor

from fbtrain.models.core.fused.tape import FusedTape
from fbtrain.models.core.spec import LAYER_PARAMS, CoreSpec


def ln_backward(d: Tensor, x: Tensor, mu: Tensor, rs: Tensor, w: Tensor) -> Tensor:
    """A LayerNorm's input gradient from its output's gradient ``d`` (rows of x [..., D],
    statistics mu and rs = 1/std [...], weight w [D]); as the kernels compute it."""
    g = d * w
    xhat = (x - mu.unsqueeze(-1)) * rs.unsqueeze(-1)
    return rs.unsqueeze(-1) * (g - g.mean(-1, keepdim=True)
                               - xhat * (g * xhat).mean(-1, keepdim=True))


def weight_grads(spec: CoreSpec, hidden: Tensor, memory: Tensor, tape: FusedTape,
                  params: list[dict[str, Tensor]], first_att: int, g: tuple[Tensor, ...]
                  ) -> list[Tensor]:
    """Every layer weight's gradient, batched over layers: one bmm per weight over all steps
    and rows (steps from ``first_att`` on for the attention block, which earlier steps skip)."""
    g_dz, g_dqu, g_da, g_df, g_dh, g_dc, g_ds = g
    L, T, B, D = g_df.shape
    H = g_ds.shape[3]

    def rows(x: Tensor, start: int = 0) -> Tensor:  # [L, T', B, n] -> [L, T'*B, n]
        x = x[:, start:]
        return x.reshape(L, -1, x.shape[-1])

    def bmm_t(x: Tensor, y: Tensor) -> Tensor:  # sum over rows of x^T y: [L, n, m]
        return torch.bmm(x.transpose(1, 2), y)

    def ln_affine(d: Tensor, x: Tensor, mu: Tensor, rs: Tensor) -> tuple[Tensor, Tensor]:
        return (d * (x - mu.unsqueeze(-1)) * rs.unsqueeze(-1)).sum((1, 2)), d.sum((1, 2))

    h_used = tape.h  # after dropout
    out: dict[str, Tensor] = {
        "w2_t": bmm_t(rows(h_used), rows(g_df)), "b2": g_df.sum((1, 2)),
        "w1_t": bmm_t(rows(tape.c), rows(g_dh)), "b1": g_dh.sum((1, 2)),
    }
    out["ln2_w"], out["ln2_b"] = ln_affine(g_dc, tape.y, tape.mu2, tape.rs2)
    a = first_att
    out["wo_t"], out["bo"] = bmm_t(rows(tape.o, a), rows(g_dz, a)), g_dz[:, a:].sum((1, 2))
    out["wq"], out["uq"] = bmm_t(rows(tape.a, a), rows(g_dqu, a)), g_dqu[:, a:].sum((1, 2))
    x_att = hidden[a:, :L].transpose(0, 1)  # [L, T', B, D] each attending layer's input
    out["ln1_w"], out["ln1_b"] = ln_affine(g_da[:, a:], x_att, tape.mu1[:, a:], tape.rs1[:, a:])
    qu = tape.qu[:, a:].reshape(L, -1, B, H, D // H)
    ds = g_ds[:, a:]
    out["rt"] = torch.einsum("ltbhd,ltbhp->lhdp", qu, ds)
    out["c"] = ds.sum((1, 2)).unsqueeze(2)  # [L, H, 1, P]
    return [out[name][li] for li in range(L) for name in LAYER_PARAMS]
