"""A step's rows: `StepRow`, one row as the scheduler plans it and the executor runs it,
and `RowColumns`, how a step's rows travel: one array per field over every row, not one
map per row.

A decode step of 256 rows was 256 msgpack maps of 26 fields, each array field decoded by
a Python hook: about 2.3 µs a row to decode, paid by the executor and again by the
session store, whose write checker needs only five of the fields. As columns a step
decodes with a few dozen hooks whatever its rows; the store reads the columns it checks
(`RowColumns`), the executor the rows (`rows()`, built without the per-field hooks).

Arrays of varying length per row (tokens, KV indices, scored tokens) travel one after
another with each row's count; a row's KV count is not sent, since it is fixed by its
positions (start + tokens - kv_from, what `StepRow` requires). Penalties and grammars,
which few rows carry, travel by row index. Decoding checks what `StepRow` checks, for
every row at once, so a malformed step is refused as it is decoded, whether or not
anyone builds its rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter
from typing import Any

import msgspec
import numpy as np

from shared.messages.envelope import (
    F8,
    I4,
    I8,
    U1,
    U8,
    WIRE_DTYPES,
    Arrays,
    WireError,
    array,
    empty,
)
from shared.messages.grammar import RowGrammar
from shared.messages.sampling import Penalties

Ints = np.ndarray | Sequence[int]  # or a host torch tensor: anything np.asarray takes


class StepRow(Arrays, kw_only=True):
    """One row of a step: the positions it computes for one request, the Mamba slots it
    reads and writes, how it samples, and whom its writes are for."""

    rid: str
    tokens: I4  # fed at positions start..end-1
    start: int
    # The KV token index of positions kv_from..end-1; the executor's page table of `row`
    # holds those before kv_from. kv_from 0: the whole context, a new table for `row`.
    kv_indices: I4 = msgspec.field(name="kv")
    kv_from: int = 0  # at most start: the positions a row writes always travel
    row: int = 0  # the request row (the scheduler's row slot); 0: a table kept nowhere
    mamba_slot: int  # the state is read from here
    mamba_out: int  # and written here after the row's tokens (may be mamba_slot)
    snapshot_slot: int = 0  # 0: no snapshot this step
    snapshot_len: int = 0  # the state after this many positions is copied to snapshot_slot
    sample: bool = True  # the row produces a token, from its last position
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    min_p: float = 0.0  # tokens below min_p times the most likely one's probability go
    penalties: Penalties | None = None  # None: no penalty (sampling.py)
    top_logprobs: int = 0  # the top log probabilities wanted at the sampled position
    future: bool = False  # tokens[0] stands for the token the step before samples
    # Input log probabilities: position scored_from + i is scored by the log probability
    # of scored[i], the token after it (RowScores in the result); empty: none.
    scored_from: int = 0
    scored: I4 = msgspec.field(default_factory=empty(I4))
    grammar: RowGrammar | None = None  # a constrained sampling row (grammar.py)
    # A verify row (docs/speculative.md): its last len(spec_slots) tokens are drafts, and
    # the state after its first j+1 positions is written to spec_slots[j] (the state
    # after all of them to mamba_out), so the scheduler can keep the accepted one.
    spec_slots: I4 = msgspec.field(name="spec", default_factory=empty(I4))
    # drafts the model's MTP head guesses for the request's next row, from this row's
    # positions (a row that samples nothing only feeds the head's attention): 0, none
    propose: int = 0
    # Who the row writes for (ledger owner ids; 0: not named). The executor ignores them;
    # the session store checks each write against its own ledger.
    owner: int = 0  # the request: owns mamba_out and the KV of positions start..end-1
    track_owner: int = 0  # the request's track: owns snapshot_slot
    session_owner: int = 0  # the session whose turn this is: may own op destinations
    spec_owner: int = 0  # the request's speculative owner: owns spec_slots

    def __post_init__(self) -> None:
        """A row whose arrays are cut or disagree is refused as it is decoded."""
        n, kv = len(self.tokens), len(self.kv_indices)
        if self.kv_from and not self.row:
            raise WireError(f"row {self.rid}: a KV delta from {self.kv_from} names no row")
        if not 0 <= self.kv_from <= self.start or kv != self.start + n - self.kv_from:
            raise WireError(
                f"row {self.rid}: {kv} KV indices from position {self.kv_from} for {n} "
                f"tokens from {self.start}"
            )
        scored = len(self.scored)
        if scored and not self.start <= self.scored_from <= self.end - scored:
            raise WireError(
                f"row {self.rid}: {scored} scored positions from {self.scored_from} outside "
                f"{self.start}..{self.end - 1}"
            )
        if self.grammar is not None and not self.sample:
            raise WireError(f"row {self.rid}: a grammar on a row that samples nothing")
        if len(self.spec_slots) and not (self.sample and len(self.spec_slots) < n):
            raise WireError(
                f"row {self.rid}: {len(self.spec_slots)} drafts in {n} tokens of a row "
                f"that {'samples' if self.sample else 'samples nothing'}"
            )

    @property
    def drafts(self) -> int:
        """How many of the row's tokens are drafts to verify (0: a plain row)."""
        return len(self.spec_slots)

    @classmethod
    def of(
        cls,
        tokens: Ints,
        start: int,
        kv_indices: Ints,
        mamba_slot: int,
        *,
        rid: str = "",
        mamba_out: int = 0,
        scored: Ints = (),
        **facts: Any,
    ) -> StepRow:
        """A row from its arrays; `mamba_out` 0 updates the state in place. `facts`:
        any of the other fields."""
        return cls(
            rid=rid,
            tokens=array(tokens, I4),
            start=start,
            kv_indices=array(kv_indices, I4),
            mamba_slot=mamba_slot,
            mamba_out=mamba_out or mamba_slot,
            scored=array(scored, I4),
            **facts,
        )

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def written_kv(self) -> np.ndarray:
        """The KV indices of the positions this row writes (start..end-1): the last
        ones it carries, whether it holds its whole context or a delta."""
        return self.kv_indices[len(self.kv_indices) - len(self.tokens) :]

    def fill_future(self, token: int) -> None:
        """The executor's part: tokens[0] becomes what the step before sampled."""
        tokens = self.tokens.copy()
        tokens[:1] = token
        self.tokens = tokens


# the per-row scalar fields of StepRow, each with the array kind it travels as
SCALARS = {
    "start": I8,
    "kv_from": I8,
    "row": I4,
    "mamba_slot": I4,
    "mamba_out": I4,
    "snapshot_slot": I4,
    "snapshot_len": I8,
    "sample": U1,
    "temperature": F8,
    "top_p": F8,
    "top_k": I8,
    "min_p": F8,
    "top_logprobs": I4,
    "future": U1,
    "scored_from": I8,
    "owner": I8,
    "track_owner": I8,
    "session_owner": I8,
    "spec_owner": I8,
    "propose": I4,
}


INTEGERS = tuple(name for name, kind in SCALARS.items() if kind is not F8)
FLOATS = tuple(name for name, kind in SCALARS.items() if kind is F8)
NARROW = [i for i, name in enumerate(INTEGERS) if SCALARS[name] is I4]  # int32 on the wire
INT32 = np.iinfo(np.int32)


class RowColumns(Arrays, kw_only=True):
    rids: list[str]
    start: I8
    token_counts: I4
    tokens: I4  # every row's, in row order
    kv_from: I8
    kv: I4  # every row's KV indices (positions kv_from..end-1), in row order
    row: I4
    mamba_slot: I4
    mamba_out: I4
    snapshot_slot: I4
    snapshot_len: I8
    sample: U1
    temperature: F8
    top_p: F8
    top_k: I8
    seeded: U1  # 0: no seed (the seed column holds 0 there)
    seed: U8
    min_p: F8
    top_logprobs: I4
    future: U1
    scored_from: I8
    scored_counts: I4
    scored: I4  # every row's scored tokens, in row order
    owner: I8
    track_owner: I8
    session_owner: I8
    spec_owner: I8
    propose: I4
    spec_counts: I4
    spec: I4  # every row's speculative slots, in row order
    penalties: dict[int, Penalties] = msgspec.field(default_factory=dict)  # by row index
    grammars: dict[int, RowGrammar] = msgspec.field(default_factory=dict)  # by row index

    def __post_init__(self) -> None:
        """What StepRow checks of each row, for every row at once."""
        n = len(self.rids)
        columns = [*SCALARS, "token_counts", "seeded", "seed", "scored_counts", "spec_counts"]
        for name in columns:
            if len(getattr(self, name)) != n:
                raise WireError(f"rows: {len(getattr(self, name))} {name} for {n} rows")
        counts, kv_counts = self.token_counts, self.kv_counts
        spec = self.spec_counts
        if n and min(counts.min(), self.scored_counts.min(), spec.min()) < 0:
            raise WireError("rows: a negative count")
        for what, total, have in (
            ("tokens", counts.sum(), len(self.tokens)),
            ("scored tokens", self.scored_counts.sum(), len(self.scored)),
            ("speculative slots", spec.sum(), len(self.spec)),
        ):
            if total != have:
                raise WireError(f"rows: {have} {what} where the counts say {total}")
        start, kv_from = self.start, self.kv_from
        bad = (kv_from < 0) | (kv_from > start) | (kv_counts < 0)
        bad |= (kv_from > 0) & (self.row == 0)  # a delta names the row whose table it extends
        if bad.any() or kv_counts.sum() != len(self.kv):
            i = int(np.argmax(bad)) if bad.any() else 0
            raise WireError(
                f"row {self.rids[i]}: KV indices from position {int(kv_from[i])} for "
                f"{int(counts[i])} tokens from {int(start[i])} ({len(self.kv)} in the step)"
            )
        scored, end = self.scored_counts, start + counts
        off = (scored > 0) & ((self.scored_from < start) | (self.scored_from > end - scored))
        if off.any():
            i = int(np.argmax(off))
            raise WireError(
                f"row {self.rids[i]}: {int(scored[i])} scored positions from "
                f"{int(self.scored_from[i])} outside {int(start[i])}..{int(end[i]) - 1}"
            )
        for name, by_row in (("penalties", self.penalties), ("a grammar", self.grammars)):
            if any(not 0 <= i < n for i in by_row):
                raise WireError(f"rows: {name} for a row of {sorted(by_row)} of {n}")
        if any(not self.sample[i] for i in self.grammars):
            raise WireError("rows: a grammar on a row that samples nothing")
        unverifiable = (spec > 0) & ((self.sample == 0) | (spec >= counts))
        if unverifiable.any():
            i = int(np.argmax(unverifiable))
            raise WireError(f"row {self.rids[i]}: {int(spec[i])} drafts in {int(counts[i])} tokens")

    @property
    def kv_counts(self) -> np.ndarray:
        """Each row's count of KV indices: its positions from kv_from to its end."""
        return self.start + self.token_counts - self.kv_from

    @classmethod
    def of(cls, rows: Sequence[StepRow]) -> RowColumns:
        """The columns of `rows` (the scheduler's side): the integer fields read in one
        pass and converted as one array (an id or slot that fits no int64 raises, as
        the encoder would), then the int32 columns checked to fit, all at once."""
        n = len(rows)
        table = np.array(list(map(attrgetter(*INTEGERS), rows)), np.int64).reshape(n, len(INTEGERS))
        real = np.array(list(map(attrgetter(*FLOATS), rows)), np.float64).reshape(n, len(FLOATS))
        narrow = table[:, NARROW]  # checked at once: numpy would wrap a value round
        if n and not INT32.min <= narrow.min() <= narrow.max() <= INT32.max:
            raise OverflowError(f"a slot or count of {narrow.tolist()} does not fit int32")
        columns = {
            name: table[:, i].astype(WIRE_DTYPES[SCALARS[name]]) for i, name in enumerate(INTEGERS)
        }
        columns |= {name: real[:, i].copy() for i, name in enumerate(FLOATS)}
        seeds = [r.seed for r in rows]

        def joined(arrays: list[np.ndarray]) -> np.ndarray:
            return array(np.concatenate(arrays) if arrays else (), I4)

        return cls(
            rids=[r.rid for r in rows],
            token_counts=array([len(r.tokens) for r in rows], I4),
            tokens=joined([r.tokens for r in rows]),
            kv=joined([r.kv_indices for r in rows]),
            seeded=array([s is not None for s in seeds], U1),
            seed=array([s or 0 for s in seeds], U8),
            scored_counts=array([len(r.scored) for r in rows], I4),
            scored=joined([r.scored for r in rows]),
            spec_counts=array([len(r.spec_slots) for r in rows], I4),
            spec=joined([r.spec_slots for r in rows]),
            penalties={i: r.penalties for i, r in enumerate(rows) if r.penalties is not None},
            grammars={i: r.grammar for i, r in enumerate(rows) if r.grammar is not None},
            **columns,
        )

    def rows(self) -> list[StepRow]:
        """Each row as a StepRow (the executor's side); its arrays are views of the
        columns'. Every field is named here, none through a dict: this runs for every
        row of every step."""

        def bounds(counts: np.ndarray) -> tuple[list[int], list[int]]:
            ends = np.cumsum(counts).tolist()
            return [0, *ends][: len(ends)], ends

        (t0, t1), (k0, k1), (s0, s1), (p0, p1) = map(
            bounds, (self.token_counts, self.kv_counts, self.scored_counts, self.spec_counts)
        )
        tokens, kv, scored, spec = self.tokens, self.kv, self.scored, self.spec
        seeds = [s if on else None for s, on in zip(self.seed.tolist(), self.seeded, strict=True)]
        penalties, grammars = self.penalties.get, self.grammars.get
        columns = zip(
            self.rids, t0, t1, k0, k1, s0, s1, p0, p1, seeds,
            *(getattr(self, name).tolist() for name in SCALARS),
            strict=True,
        )  # fmt: skip
        return [
            StepRow(
                rid=rid,
                tokens=tokens[ta:tb],
                kv_indices=kv[ka:kb],
                scored=scored[sa:sb],
                spec_slots=spec[pa:pb],
                seed=seed,
                penalties=penalties(i),
                grammar=grammars(i),
                start=start,
                kv_from=kv_from,
                row=row,
                mamba_slot=mamba_slot,
                mamba_out=mamba_out,
                snapshot_slot=snapshot_slot,
                snapshot_len=snapshot_len,
                sample=bool(sample),
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                min_p=min_p,
                top_logprobs=top_logprobs,
                future=bool(future),
                scored_from=scored_from,
                owner=owner,
                track_owner=track_owner,
                session_owner=session_owner,
                spec_owner=spec_owner,
                propose=propose,
            )
            for i, (
                rid, ta, tb, ka, kb, sa, sb, pa, pb, seed,
                start, kv_from, row, mamba_slot, mamba_out, snapshot_slot, snapshot_len,
                sample, temperature, top_p, top_k, min_p, top_logprobs, future, scored_from,
                owner, track_owner, session_owner, spec_owner, propose,
            ) in enumerate(columns)
        ]  # fmt: skip

    def written_kv(self) -> tuple[np.ndarray, np.ndarray]:
        """(row, KV index) of every position the rows write (each row's last `tokens`
        KV indices: its positions start..end-1), in row order."""
        ends = np.cumsum(self.kv_counts)
        counts = self.token_counts.astype(np.int64)
        rows = np.repeat(np.arange(len(self.rids)), counts)
        # each written position's place in `kv`: its row's end, less what is left of it
        before = np.repeat(np.cumsum(counts) - counts, counts)
        at = np.repeat(ends - counts, counts) + np.arange(counts.sum()) - before
        return rows, self.kv[at].astype(np.int64)
