"""The session limits the router counts across replicas, as one server would count them:
each replica counts only its own sessions, so without the router's count a key (or all
clients) could hold the limit on every replica at once.

- `--max-sessions-per-key`: a key's open sessions on every replica.
- `--max-sessions`, when set: open sessions on every replica together (left at 0, each
  replica's own pools bound it, and the router adds no limit).

Counted from the replicas' registrations and this router's opens since each was written
(`Replica.sessions`): routers opening at once may pass a limit by the opens in flight,
as each replica's own check (with the same settings) still holds for it. The waiting
queue (`--max-queued-requests`) stays each replica's own: a request waits on one
replica, and the router sends it to the least loaded one, so a 503 means that one is
full."""

from __future__ import annotations

from fronts.replicas import ReplicaTable


class SessionLimits:
    def __init__(self, table: ReplicaTable, per_key: int, total: int) -> None:
        self.table, self.per_key, self.total = table, per_key, total

    def refuse_open(self, tenant: str | None) -> str | None:
        """Why an open by `tenant` would pass a limit (its front answers 429), else None."""
        live = self.table.live.values()
        if tenant is not None and self.per_key:
            held = sum(r.sessions_of(tenant) for r in live)
            if held >= self.per_key:
                return (
                    f"this API key has {held} sessions open, its limit "
                    "(--max-sessions-per-key); close one first"
                )
        if self.total:
            held = sum(r.sessions for r in live)
            if held >= self.total:
                return (
                    f"{held} sessions are open on every replica together, as many as "
                    "this service holds (--max-sessions); close one or retry later"
                )
        return None
