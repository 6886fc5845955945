"""`custody drain`: ask a front (the endpoint picker's HTTP port, or the custody router)
to move every session off one replica, with its state, before that replica stops. A
replica pod's preStop hook runs it with the pod's own name, so a rolling update or a
scale-down migrates sessions instead of dropping their device state."""

from __future__ import annotations

import json
import os
import socket
import urllib.error
import urllib.request


def admin_key() -> str | None:
    """The first operator key of `CUSTODY_ADMIN_API_KEYS` (the pod's, from its Secret)."""
    keys = [k.strip() for k in os.environ.get("CUSTODY_ADMIN_API_KEYS", "").split(",")]
    return next((k for k in keys if k), None)


def run(url: str, replica: str | None, timeout: float) -> int:
    """Drain `replica` (None: this machine's hostname, a pod's name) through the front
    at `url`; prints the front's count of sessions moved with state, re-homed from
    history, failed and gone. Exit status 0 when every session moved (state or history)."""
    body = json.dumps({"replica": replica or socket.gethostname()}).encode()
    headers = {"Content-Type": "application/json"}
    key = admin_key()
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(
        url.rstrip("/") + "/admin/drain", data=body, headers=headers, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            outcome = json.loads(answer.read())
    except urllib.error.HTTPError as err:
        print(f"drain refused: {err.code} {err.read().decode(errors='replace')}")
        return 1
    except (urllib.error.URLError, OSError, ValueError) as err:
        print(f"drain failed: {err}")
        return 1
    print(json.dumps(outcome))
    return 0 if outcome.get("failed", 1) == 0 else 1
