"""The figures of `custody bench prefix` from its runs: per series and mode, the tokens
each request reused against what it shared, TTFT, the prefix counters' deltas and the
warm/cold check; the headline reuse shares with their targets; written as
bench-results/prefix.{json,md,png}."""

from __future__ import annotations

import json
import statistics

from custody.bench.harness import RESULTS_DIR, plot
from custody.bench.prefix_workloads import FORK_HEADLINE, JUNCTION_HEADLINE, Series, reuse_share
from custody.bench.sglang_reference import prefix_cache_reference
from shared.config import Settings

TARGETS = {JUNCTION_HEADLINE: 0.95, FORK_HEADLINE: 0.95}  # each >=, junctions on
COUNTED = (
    "kv_matched_tokens",
    "state_matched_tokens",
    "state_gap_tokens",
    "junction_checkpoints",
    "interval_checkpoints",
)
# the table's on / off columns after the series, its requests and shared tokens
COLUMNS = (
    ("reuse_share", "{:.3f}"),
    ("ttft_median_ms", "{:.1f}"),
    ("first_ttft_ms", "{:.1f}"),
    ("state_gap_tokens", "{:,}"),
    ("junction_checkpoints", "{}"),
    ("outputs_equal_cold", "{}"),
)


def _ms(seconds: list[float]) -> float:
    return round(statistics.median(seconds) * 1e3, 2)


def summarise(series: Series, runs: list[dict]) -> dict:
    """One mode's runs of `series`: the fewest tokens each request reused over the
    repeats, TTFT medians (the first request, cold; the third on, where reuse is due),
    the counters (median over repeats) and the check."""
    cached = [min(column) for column in zip(*(r["cached_tokens"] for r in runs), strict=True)]
    return {
        "cached_tokens": cached,
        "reuse_share": round(reuse_share(series.shared(), cached), 4),
        "first_ttft_ms": _ms([r["seconds"][0] for r in runs]),
        "ttft_median_ms": _ms([s for r in runs for s in r["seconds"][2:]]),
        **{key: int(statistics.median(r[key] for r in runs)) for key in COUNTED},
        "check_cached_tokens_warm_cold": runs[0]["check_cached_tokens"],
        "outputs_equal_cold": all(r["outputs_equal_cold"] for r in runs),
    }


def headline(workloads: tuple[Series, ...], figures: dict, key: str, mode: str) -> float:
    """The reuse share over every series counting towards `key`, requests 3.. pooled."""
    shared, cached = [], []
    for series in workloads:
        if series.headline == key:
            shared += series.shared()[2:]
            cached += figures[series.name][mode]["cached_tokens"][2:]
    return round(reuse_share(shared, cached, start=0), 4)


def report(
    workloads: tuple[Series, ...],
    repeats: int,
    settings: Settings,
    runs: dict[str, dict[str, list[dict]]],
    wall_s: float,
) -> dict:
    """The payload (headlines first, then every series), written to bench-results with
    its markdown table and chart; the table also under "table"."""
    figures = {
        s.name: {
            "source": s.source,
            "sessions": s.sessions,
            "prefixes": list(s.prefixes),
            "suffixes": list(s.suffixes),
            "shared": s.shared(),
            **{mode: summarise(s, by_mode) for mode, by_mode in runs[s.name].items()},
        }
        for s in workloads
    }
    payload: dict = {}
    for key, target in TARGETS.items():
        if any(s.headline == key for s in workloads):
            value = headline(workloads, figures, key, "on")
            payload[key] = value
            payload[f"{key}_off"] = headline(workloads, figures, key, "off")
            payload[f"{key}_target"] = f">= {target}"
            payload[f"{key}_met"] = value >= target
    payload["outputs_equal_cold"] = all(
        f[mode]["outputs_equal_cold"] for f in figures.values() for mode in ("on", "off")
    )
    payload["repeats"] = repeats
    payload["wall_s"] = round(wall_s, 1)
    payload["settings"] = {
        "page_size": settings.page_size,
        "chunk_size": settings.chunk_size,
        "max_step_tokens": settings.max_step_tokens,
        "kv_pages": settings.kv_pages,
        "mamba_slots": settings.mamba_slots,
        "state_checkpoint_interval": settings.state_checkpoint_interval,
    }
    payload["workloads"] = figures
    payload["sglang_reference"] = prefix_cache_reference()
    table = markdown(payload)
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "prefix.json").write_text(json.dumps(payload, indent=2) + "\n")
    (RESULTS_DIR / "prefix.md").write_text(table + "\n")
    plot(
        "prefix",
        "prefix: shared tokens reused from the third request on",
        list(figures),
        {f"junctions {m}": [f[m]["reuse_share"] for f in figures.values()] for m in ("on", "off")},
        "reuse share",
    )
    payload["table"] = table
    return payload


def _shared(values: list[int]) -> str:
    low, high = min(values[1:]), max(values[1:])
    return f"{low:,}" if low == high else f"{low:,}..{high:,}"


def markdown(payload: dict) -> str:
    """What ran, the headlines, then one row per series: on / off side by side."""
    s = payload["settings"]
    lines = [
        f"Built-in model, page {s['page_size']}, chunk {s['chunk_size']}; requests one at a "
        f"time, one greedy token each; {payload['repeats']} run(s) of each series per mode, "
        f"{payload['wall_s']:.0f} s (stacks started aside).",
        "",
    ]
    for key in TARGETS:
        if key in payload:
            verdict = "met" if payload[f"{key}_met"] else "NOT met"
            lines.append(
                f"- `{key}` = {payload[key]:.3f} (off: {payload[key + '_off']:.3f}), "
                f"target {payload[key + '_target']}: {verdict}"
            )
    lines += [
        f"- outputs equal to a cold run, every series and mode: {payload['outputs_equal_cold']}",
        f"- SGLang reference: not driven ({payload['sglang_reference']['reason']})",
        "",
        "Each cell: junctions on / off. Reuse share: requests 3.., min(cached, shared) over "
        "shared. TTFT: median of requests 3.. (one token; ms). Gap: state-gap tokens; "
        "junctions: junction checkpoints taken (both from /metrics, over the run).",
        "",
        "| series | requests | shared | reuse share | TTFT ms | first TTFT ms | gap | "
        "junctions | = cold |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, f in payload["workloads"].items():
        cells = [_pair(f, key, fmt) for key, fmt in COLUMNS]
        kind = " (sessions)" if f["sessions"] else ""
        row = [f"{name}{kind}", str(len(f["shared"])), _shared(f["shared"]), *cells]
        lines.append(f"| {' | '.join(row)} |")
    return "\n".join(lines)


def _pair(figures: dict, key: str, fmt: str) -> str:
    return f"{fmt.format(figures['on'][key])} / {fmt.format(figures['off'][key])}"
