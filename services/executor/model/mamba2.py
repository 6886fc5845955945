"""The Mamba2 mixer of NemotronH over pooled state: every row reads the conv and SSM
state from one slot and writes the state after its tokens to another (or the same), and
can leave a snapshot of both, taken after a given position, in a third.

The conv window is computed in the model's dtype, the SSM scan and its state in float32,
and the scan's output is gated and normed in float32 before the out projection, as
transformers does. A state read from or written to a pool of another dtype converts: the
conv state to the model's dtype and back, the SSM state to float32 and back to the
pool's (`mamba_ssm_cache_dtype`, which may be 16-bit: only the storage rounds)."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from services.executor.model.batch import DecodeRows, ForwardBatch
from services.executor.model.layers import GatedRMSNorm
from services.executor.model.pools import DevicePools
from services.executor.model.ssd import chunked_scan, recurrent_step
from shared.messages.forward import StepRow
from shared.model_config import ModelConfig


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.heads, self.head_dim, self.n = (
            cfg.mamba_num_heads,
            cfg.mamba_head_dim,
            cfg.ssm_state_size,
        )
        self.inner = cfg.mamba_intermediate
        self.conv_dim = cfg.conv_dim
        self.in_proj = nn.Linear(
            cfg.hidden_size, self.inner + self.conv_dim + self.heads, bias=cfg.use_bias
        )
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            cfg.conv_kernel,
            groups=self.conv_dim,
            padding=cfg.conv_kernel - 1,
            bias=cfg.use_conv_bias,
        )
        self.dt_bias = nn.Parameter(torch.ones(self.heads))
        self.A_log = nn.Parameter(torch.zeros(self.heads))
        self.D = nn.Parameter(torch.ones(self.heads))
        self.norm = GatedRMSNorm(self.inner, cfg.n_groups, cfg.layer_norm_epsilon)
        self.out_proj = nn.Linear(self.inner, cfg.hidden_size, bias=cfg.use_bias)

    def forward(
        self, h: torch.Tensor, batch: ForwardBatch, pools: DevicePools, layer: int
    ) -> torch.Tensor:
        gate, xbc, dt, A = self._project(h)
        y = torch.empty(h.shape[0], self.heads, self.head_dim, dtype=torch.float32, device=h.device)
        if batch.decode_rows is not None:
            pos = batch.decode_positions
            y[pos] = self._step(xbc[pos], dt[pos], A, batch.decode_rows, pools, layer)
        for i in batch.prefill:
            self._prefill(xbc, dt, A, y, batch.rows[i], batch.span(i), pools, layer)
        return self._output(y, gate)

    def decode(
        self, h: torch.Tensor, rows: DecodeRows, pools: DevicePools, layer: int
    ) -> torch.Tensor:
        """A step of one-token rows only (`h` [R, hidden]): the compiled path."""
        gate, xbc, dt, A = self._project(h)
        return self._output(self._step(xbc, dt, A, rows, pools, layer), gate)

    def _project(self, h: torch.Tensor):
        """The gate, the conv input, dt (softplus'd, clamped) and A, for every token."""
        gate, xbc, dt = self.in_proj(h).split([self.inner, self.conv_dim, self.heads], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(min=self.cfg.time_step_min)
        return gate, xbc, dt, -torch.exp(self.A_log.float())

    def _output(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.norm(y.view(y.shape[0], self.inner), gate))

    def _split(self, conv_out: torch.Tensor):
        x, B, C = conv_out.split(
            [self.inner, self.n * self.cfg.n_groups, self.n * self.cfg.n_groups], dim=-1
        )
        per_group = self.heads // self.cfg.n_groups
        shape = (*x.shape[:-1], self.cfg.n_groups, self.n)
        B = B.reshape(shape).repeat_interleave(per_group, dim=-2)
        C = C.reshape(shape).repeat_interleave(per_group, dim=-2)
        return x.reshape(*x.shape[:-1], self.heads, self.head_dim), B, C

    def _step(self, xbc, dt, A, rows: DecodeRows, pools: DevicePools, layer: int) -> torch.Tensor:
        """One token per row: the conv window and the SSM state advanced from each row's
        slot, written to its out slot (and its snapshot slot, the sink if none); y [R, h, p]."""
        slots = rows.slots
        window = torch.cat([pools.conv[layer, slots].to(xbc.dtype), xbc[:, :, None]], dim=-1)
        conv = (window * self.conv1d.weight.squeeze(1)).sum(-1)
        if self.conv1d.bias is not None:
            conv = conv + self.conv1d.bias
        count, groups = slots.shape[0], self.cfg.n_groups
        x, B, C = F.silu(conv).split([self.inner, self.n * groups, self.n * groups], dim=-1)
        per_group = (groups, self.heads // groups)
        state = pools.ssm[layer, slots].float().view(count, *per_group, self.head_dim, self.n)
        out, state = recurrent_step(
            x.reshape(count, *per_group, self.head_dim),
            dt.view(count, *per_group),
            A.view(per_group),
            B.view(count, groups, self.n),
            C.view(count, groups, self.n),
            self.D.float().view(per_group),
            state,
        )
        state = state.view(count, self.heads, self.head_dim, self.n)
        kept = window[..., 1:]
        for target in (rows.out_slots, rows.snapshot_slots):
            pools.write(pools.conv, layer, target, kept)
            pools.write(pools.ssm, layer, target, state)
        return out.reshape(count, self.heads, self.head_dim)

    def _prefill(
        self, xbc, dt, A, y, row: StepRow, span: slice, pools: DevicePools, layer: int
    ) -> None:
        """A row of several tokens: the scan runs in pieces, ending at each position whose
        state is kept elsewhere too (its snapshot, a verify row's speculative slots), and
        the state after the last goes to its out slot."""
        keep = self.cfg.conv_kernel - 1
        full = torch.cat([pools.conv[layer, row.mamba_slot].to(xbc.dtype), xbc[span].T], dim=-1)
        conv = F.conv1d(full[None], self.conv1d.weight, self.conv1d.bias, groups=self.conv_dim)
        x, B, C = self._split(F.silu(conv[0].T))
        dts, D, state = dt[span], self.D.float(), pools.ssm[layer, row.mamba_slot].float()
        n = len(row.tokens)
        kept = save_points(row)
        outs = []
        for lo, hi in itertools.pairwise([0, *sorted({*kept, n})]):
            out, state = chunked_scan(
                x[lo:hi], dts[lo:hi], A, B[lo:hi], C[lo:hi], D, state, self.cfg.chunk_size
            )
            outs.append(out)
            for slot in kept.get(hi, ()):
                pools.conv[layer, slot] = full[:, hi : hi + keep].to(pools.conv.dtype)
                pools.ssm[layer, slot] = state
        y[span] = torch.cat(outs)
        pools.conv[layer, row.mamba_out] = full[:, full.shape[1] - keep :].to(pools.conv.dtype)
        pools.ssm[layer, row.mamba_out] = state


def save_points(row: StepRow) -> dict[int, list[int]]:
    """The slots that keep the state after a count of the row's positions (besides its
    out slot, which keeps the state after all of them), by that count: its snapshot,
    and a verify row's speculative slots (the state after j + 1 positions in
    spec_slots[j])."""
    points: dict[int, list[int]] = {}
    if row.snapshot_slot and 0 < row.snapshot_len - row.start <= len(row.tokens):
        points[row.snapshot_len - row.start] = [row.snapshot_slot]
    for j, slot in enumerate(row.spec_slots.tolist()):
        points.setdefault(j + 1, []).append(slot)
    return points
