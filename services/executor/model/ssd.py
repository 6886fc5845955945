"""The Mamba2 state-space recurrence, in two forms.

For a head: S_t = exp(dt_t * A) * S_{t-1} + dt_t * x_t B_t^T and y_t = S_t C_t + D x_t.
`chunked_scan` runs a prefill chunk block by block (the SSD form: attention-like within
a block, the recurrence only between blocks), starting from a given state and returning
the final one. `recurrent_step` advances many rows by one token each (decode).
"""

from __future__ import annotations

import torch


def chunked_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    state: torch.Tensor,
    block: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence. x [T, h, p], dt [T, h] (already softplus'd), A [h] (negative),
    B and C [T, h, n] (groups broadcast to heads), D [h], state [h, p, n] float32.
    Returns y [T, h, p] and the state after the last token."""
    x, dt, B, C = x.float(), dt.float(), B.float(), C.float()
    ys = []
    for s in range(0, x.shape[0], block):
        xb, dtb, Bb, Cb = x[s : s + block], dt[s : s + block], B[s : s + block], C[s : s + block]
        acum = torch.cumsum(dtb * A, dim=0)  # [q, h] log-decay from the block start
        q = xb.shape[0]
        diff = acum[:, None, :] - acum[None, :, :]  # [l, s, h]
        causal = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()[:, :, None]
        decay = torch.exp(torch.where(causal, diff, float("-inf")))
        scores = torch.einsum("lhn,shn->lsh", Cb, Bb) * decay
        y_in = torch.einsum("lsh,shp->lhp", scores, xb * dtb[..., None])
        y_prev = torch.einsum("lhn,hpn->lhp", Cb, state) * torch.exp(acum)[..., None]
        ys.append(y_in + y_prev + D[None, :, None] * xb)
        to_end = torch.exp(acum[-1:] - acum) * dtb  # [s, h]
        state = state * torch.exp(acum[-1])[:, None, None] + torch.einsum(
            "sh,shp,shn->hpn", to_end, xb, Bb
        )
    return torch.cat(ys), state


def recurrent_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Many rows, one token each, heads in groups sharing B and C. x [R, g, k, p] (k heads
    per group), dt [R, g, k], A and D [g, k], B and C [R, g, n], state [R, g, k, p, n].
    Returns y [R, g, k, p] and the new states."""
    x32 = x.float()
    decay = torch.exp(dt * A)[..., None, None]
    inflow = (dt[..., None] * x32)[..., None] * B[:, :, None, None, :].float()
    state = torch.addcmul(inflow, state, decay)
    y = (state * C[:, :, None, None, :].float()).sum(-1) + D[..., None] * x32
    return y, state
