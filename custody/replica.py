"""`python -m custody.replica`: one replica, its scheduler and its executor, in one
container, so the compose `replica` service scales with `docker compose up --scale
replica=N`. Both children are supervised by `custody up`'s machinery (custody/up.py): one
that dies is restarted with backoff, as under `custody up --replicas N`.

Its id is the container's hostname unless `CUSTODY_REPLICA` names one (shared/config.py
`hostname_replica`), resolved here once and handed to both children, so they agree."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping

from custody.up import SERVICES, Stack, supervise
from shared.config import Settings


def one_replica(settings: Settings) -> dict[str, tuple[str, Settings]]:
    """The children of a replica container (Stack's `plan`): its executor and scheduler."""
    return {name: (SERVICES[name], settings) for name in ("executor", "scheduler")}


def replica_settings(argv: list[str] | None, environ: Mapping[str, str]) -> Settings:
    """The replica's settings, its id `auto` when none is given. It refuses what would cut
    it off from the other replicas: a private Redis (Stack starts one when no URL is set)
    or a private disk tier (a session moving here copies its blob from the other
    replica's directory under the state volume they all mount)."""
    parser = argparse.ArgumentParser(description="one custody replica: scheduler + executor")
    Settings.add_arguments(parser)
    env = dict(environ)
    env["CUSTODY_REPLICA"] = env.get("CUSTODY_REPLICA") or "auto"
    settings = Settings.resolve(parser.parse_args(argv), env)
    if not settings.redis_url:
        raise ValueError("a replica needs the stack's Redis: set CUSTODY_REDIS_URL")
    if settings.state_dir is None:
        raise ValueError(
            "a replica needs the state volume every replica mounts: set CUSTODY_STATE_DIR"
        )
    return settings


def main(argv: list[str] | None = None) -> int:
    try:
        settings = replica_settings(argv, os.environ)
    except ValueError as err:
        raise SystemExit(f"custody.replica: {err}") from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s replica %(message)s")
    stack = Stack(settings, plan=one_replica)
    return supervise(
        stack,
        f"custody replica {settings.replica}: API on {settings.host}:{settings.port}, "
        f"executor metrics on {settings.host}:{settings.executor_metrics_port}",
    )


if __name__ == "__main__":
    raise SystemExit(main())
