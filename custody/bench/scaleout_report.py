"""`custody bench scaleout`'s results (scaleout.py): each target beside its figure
(`<key>_target`, `<key>_met`), a markdown table, a plot, bench-results/scaleout.*."""

from __future__ import annotations

import json
import operator

from custody.bench import harness

TARGETS = {  # key: (comparison, target)
    "affinity_hit_rate": (">=", 1.0),
    "router_overhead_p99_ms": ("<", 2.0),
    "prefix_hit_tokens_ratio_vs_random": (">=", 2.0),
}
COMPARE = {">=": operator.ge, "<": operator.lt}
NOTES = {
    "compile_note": "eager forward (compile=False): compiling costs ~45 s cold per executor, "
    "and neither the router's overhead nor where state lands depends on the forward",
    "quantile_note": "router overhead quantiles from the bucket counts of "
    "custody_router_overhead_seconds over the session runs, interpolated linearly inside "
    "the bucket holding the rank (as Prometheus' histogram_quantile)",
    "prefix_order_note": "iid: each request's prefix drawn uniformly at random (the "
    "headline); rounds: every prefix once per round, rounds shuffled. Under iid, random "
    "routing still hits about C/P of requests once the caches are warm (each replica's LRU "
    "over a uniform stream), which P x L <= two caches keeps >= 1/2, so the iid ratio "
    "stays below 2 even for a router that never misses after a prefix's first request",
    "prefix_ceiling_note": "max: the prompt tokens a router reuses if it misses only "
    "each prefix's first request; ceiling: max over the random router's reuse in the same "
    "run, the highest ratio any router could report then. A miss after its prefix was "
    "cached is mostly a KV eviction: a request needs a page past its cached prefix while "
    "it runs, and a cache full of prefixes frees it by evicting a whole prefix, so while "
    "requests run the two caches hold about P - 2 of the P prefixes",
    "router_first_note": "the router and Redis at nice -10, the same sessions again: "
    "what the router adds when a core is free for it as it wakes, as its own pod would "
    "have; a diagnostic, not the headline",
    "affinity_note": "a returning turn is a hit when its reply's cached_tokens >= its "
    "history - page_size (only the session's replica holds that state); "
    "affinity_counts_match_placement checks the router's affinity count per replica "
    "against the placement keys read after each open",
}


def targets(payload: dict) -> dict:
    out = {}
    for key, (op, target) in TARGETS.items():
        out[f"{key}_target"] = f"{op} {target:g}"
        out[f"{key}_met"] = bool(COMPARE[op](payload[key], target))
    return out


def table(p: dict) -> str:
    sizes, hits = p["prefix_sizes"], p["prefix_hit_tokens"]
    via, direct = p["client_through_router"], p["client_direct_to_replica"]
    lines = ["| figure | value | target |", "|---|---|---|"]
    for key, (op, target) in TARGETS.items():
        verdict = "met" if p[f"{key}_met"] else "NOT met"
        lines.append(f"| `{key}` | {p[key]} | {op} {target:g} {verdict} |")
    lines += [
        f"| `router_overhead_p50_ms` | {p['router_overhead_p50_ms']} | none |",
        f"| `prefix_hit_tokens_ratio_vs_random_rounds` | "
        f"{p['prefix_hit_tokens_ratio_vs_random_rounds']} | none |",
        "",
        f"Affinity: {p['affinity_hits']} of {p['returning_turns']} returning turns resumed "
        f"from their replica's state; the router's affinity counts match the placement "
        f"keys: {p['affinity_counts_match_placement']}. Overhead: "
        f"{p['router_overhead_requests']} requests through the router at "
        f"{p['sessions']['clients']} concurrent clients; {NOTES['quantile_note']}.",
        "",
        "| router overhead by kind | requests | p50 ms | p99 ms |",
        "|---|---|---|---|",
        *(
            f"| {kind} | {k['requests']} | {k['p50_ms']} | {k['p99_ms']} |"
            for kind, k in p["router_overhead_by_kind"].items()
        ),
        "",
        _router_first(p["router_first"]),
        "",
        "| client-side, ms | TTFT p50 | TTFT p99 | turn p50 | turn p99 |",
        "|---|---|---|---|---|",
        _times_row("through the router", via),
        _times_row("straight to a replica", direct),
        "",
        f"Prefix workload: P = {sizes['P']} prefixes of L = {sizes['L']} tokens "
        f"(P x L = {sizes['P'] * sizes['L']}) against a prefix cache of "
        f"{sizes['cache_capacity_tokens_per_replica']} tokens "
        f"({sizes['cache_capacity_prefixes_per_replica']} prefixes) per replica; "
        f"{sizes['requests_per_phase']} requests per phase, each a prefix and "
        f"{sizes['suffix']} unique tokens, {sizes['max_new_tokens']} out, "
        f"{sizes['clients']} at a time, caches flushed before each phase.",
        "",
        "| prompt tokens reused | prefix-aware router | random router | one replica, no router |",
        "|---|---|---|---|",
    ]
    for order, by in hits.items():
        one = by.get("one_replica", "-")
        lines.append(f"| {order} | {by['prefix']} | {by['random']} | {one} |")
    lines += ["", "| prefix-aware router | max | ceiling | misses | diverted by the bound |"]
    lines.append("|---|---|---|---|---|")
    for order, phase in p["prefix_phases"].items():
        aware, missed = phase["prefix"], phase["prefix"]["misses"]
        lines.append(
            f"| {order} | {p['prefix_hit_tokens_max'][order]} "
            f"| {p['prefix_hit_tokens_ratio_ceiling'][order]} "
            f"| {missed['first']} first, {missed['while_first_in_flight']} while the first "
            f"ran, {missed['after_cached']} after it was cached | {aware['diverted_by_bound']} |"
        )
    lines += [
        "",
        NOTES["prefix_order_note"] + ".",
        "",
        NOTES["prefix_ceiling_note"] + ".",
        "",
        f"Stack: 2 replicas, {NOTES['compile_note']}; {p['wall_seconds']} s in all.",
    ]
    return "\n".join(lines)


def _router_first(first: dict | str) -> str:
    if isinstance(first, str):
        return f"Router first for the CPU: {first}."
    kinds = first["router_overhead_by_kind"]
    return (
        f"Router first for the CPU ({NOTES['router_first_note']}): p99 "
        f"{first['router_overhead_p99_ms']} ms over turns and opens (turns "
        f"{kinds['turn']['p99_ms']}, opens {kinds['open']['p99_ms']})."
    )


def _times_row(what: str, t: dict) -> str:
    return (
        f"| {what} | {t['ttft_ms_p50']} | {t['ttft_ms_p99']} | {t['turn_ms_p50']} "
        f"| {t['turn_ms_p99']} |"
    )


def plot(p: dict) -> None:
    """Reused prompt tokens by phase, and the router overhead's histogram."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = ("prefix", "random", "one_replica")
    orders = list(p["prefix_hit_tokens"])
    for i, name in enumerate(names):
        values = [p["prefix_hit_tokens"][o].get(name, 0) for o in orders]
        left.bar([x + i * 0.27 for x in range(len(orders))], values, 0.27, label=name)
    left.set_xticks([x + 0.27 for x in range(len(orders))], orders)
    left.set_ylabel("prompt tokens reused (sum of cached_tokens)")
    left.set_title("prefix-aware vs random routing")
    left.legend(fontsize=8)
    buckets = p["router_overhead_buckets"]
    labels = [b if isinstance(b, str) else f"<={b * 1e3:g}" for b, _ in buckets]
    right.bar(range(len(buckets)), [n for _, n in buckets])
    right.set_xticks(range(len(buckets)), labels, fontsize=7, rotation=45)
    right.set_xlabel("ms inside the router")
    right.set_ylabel("requests")
    right.set_title(f"router overhead (p99 {p['router_overhead_p99_ms']} ms)")
    fig.tight_layout()
    harness.RESULTS_DIR.mkdir(exist_ok=True)
    fig.savefig(harness.RESULTS_DIR / "scaleout.png", dpi=100)
    plt.close(fig)


def write(payload: dict) -> dict:
    """The payload with its targets and notes, written as JSON, markdown and a plot; the
    returned dict also carries the markdown as "table"."""
    payload |= targets(payload) | NOTES
    harness.RESULTS_DIR.mkdir(exist_ok=True)
    (harness.RESULTS_DIR / "scaleout.json").write_text(json.dumps(payload, indent=2) + "\n")
    text = table(payload)
    (harness.RESULTS_DIR / "scaleout.md").write_text(text + "\n")
    plot(payload)
    return payload | {"table": text}
