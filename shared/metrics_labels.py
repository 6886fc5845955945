"""The `replica` label every custody metric carries.

With several replicas scraped by one Prometheus, a series must say which replica it
describes, or the replicas' pools, queues and latencies fold into one meaningless series.
Each service labels its whole exposition at render time with `with_replica` rather than
declaring a `replica` label on each metric: no metric can forget it, metrics kept by
libraries (prometheus_client's process and GC collectors) carry it too, and a single
replica's dashboards and alerts read `replica="0"` exactly as N replicas' do.

A sample line is parsed, not split: label values may hold `}`, `,`, `=`, spaces and escaped
quotes (`\\"`), and only a parse knows where the label set really ends.
"""

from __future__ import annotations

import re

LABEL = "replica"
_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_PAIR = r'\s*[a-zA-Z_][a-zA-Z0-9_]*\s*=\s*"(?:[^"\\\n]|\\.)*"\s*'
# name, then an optional label set of pairs separated by commas (a trailing one allowed),
# then the value and an optional timestamp.
_SAMPLE = re.compile(
    rf"(?P<name>{_NAME})(?:\{{(?P<labels>(?:{_PAIR},)*(?:{_PAIR})?\s*)\}})?(?P<rest>\s.*)"
)
# One pair of a label set already matched by _SAMPLE, its name captured.
_LABEL_NAMES = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"(?:[^"\\\n]|\\.)*"\s*,?')


def escape(value: str) -> str:
    """A label value as the text format writes it."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def with_replica(exposition: bytes, replica: str) -> bytes:
    """The exposition with `replica="<replica>"` added to every sample that has none.

    Comment lines (`# HELP`, `# TYPE`) and blank lines are kept as they are. A sample that
    already names its replica keeps its own: a service holding several replicas' state
    (the session store) labels those samples itself."""
    label = f'{LABEL}="{escape(replica)}"'
    lines = exposition.decode("utf-8").split("\n")
    return "\n".join(_labelled(line, label) for line in lines).encode("utf-8")


def _labelled(line: str, label: str) -> str:
    if not line.strip() or line.lstrip().startswith("#"):
        return line
    match = _SAMPLE.fullmatch(line)
    if match is None:
        raise ValueError(f"not a sample line of the Prometheus text format: {line!r}")
    name, labels, rest = match.group("name", "labels", "rest")
    if labels is None or not labels.strip():
        return f"{name}{{{label}}}{rest}"
    if LABEL in {m.group(1) for m in _LABEL_NAMES.finditer(labels)}:
        return line
    kept = labels.rstrip().removesuffix(",").rstrip()
    return f"{name}{{{kept},{label}}}{rest}"
