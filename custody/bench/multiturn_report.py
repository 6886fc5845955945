"""The figures of `custody bench multiturn` from the rounds its clients recorded: per mode
and rate, latency percentiles, throughput and prefix reuse, over all rounds and per round;
then the markdown tables and the TTFT-against-rate plot. Times are in milliseconds."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from custody.bench.multiturn_workload import MODES, Turn, Workload


def _ms(seconds: list[float], *percentiles: int, mean: bool = True) -> dict[str, float | None]:
    """`mean` and `p<N>` of `seconds`, in milliseconds; None when there are none."""
    values = np.asarray(seconds) * 1e3
    keys = (["mean"] if mean else []) + [f"p{p}" for p in percentiles]
    if not len(values):
        return dict.fromkeys(keys)
    out = {"mean": round(float(values.mean()), 2)} if mean else {}
    return out | {f"p{p}": round(float(np.percentile(values, p)), 2) for p in percentiles}


def _reuse(turns: list[Turn]) -> dict[str, float]:
    cached = sum(t.cached_tokens for t in turns)
    prompt = sum(t.prompt_tokens for t in turns)
    return {
        "cached_tokens_mean": round(cached / len(turns), 1),
        "prompt_tokens_mean": round(prompt / len(turns), 1),
        "cache_hit_rate": round(cached / prompt, 4),
    }


def per_round(turns: list[Turn], num_rounds: int) -> list[dict]:
    rows = []
    for k in range(1, num_rounds + 1):
        mine = [t for t in turns if t.round == k]
        ttft = _ms([t.ttft_s for t in mine], 50, 90, 99)
        row = {"round": k, "requests": len(mine)}
        rows.append(row | {f"ttft_{key}_ms": v for key, v in ttft.items()} | _reuse(mine))
    return rows


def summarise(runs: list[tuple[list[Turn], float]], num_rounds: int) -> dict:
    """One mode at one rate: the rounds of every repeat pooled; throughput over the
    repeats' summed wall time (first arrival's wait to the last reply's end)."""
    turns = [t for run_turns, _ in runs for t in run_turns]
    seconds = sum(s for _, s in runs)
    ttft = _ms([t.ttft_s for t in turns], 50, 90, 99)
    tpot = _ms([t.tpot_s for t in turns if len(t.output_ids) > 1], 50)
    e2e = _ms([t.latency_s for t in turns], 50, 99)
    figures = {"requests": len(turns), "seconds": round(seconds, 2)}
    figures |= {f"ttft_{k}_ms": v for k, v in ttft.items()}
    figures |= {f"tpot_{k}_ms": v for k, v in tpot.items()}
    figures |= {f"e2e_{k}_ms": v for k, v in e2e.items()}
    output_tokens = sum(len(t.output_ids) for t in turns)
    figures["output_token_throughput"] = round(output_tokens / seconds, 1)
    figures["request_throughput"] = round(len(turns) / seconds, 2)
    figures |= _reuse(turns)
    figures["rounds"] = per_round(turns, num_rounds)
    return figures


def markdown(workload: Workload, rates: dict[str, dict]) -> str:
    w = workload
    lines = [
        f"{w.num_clients} clients x {w.num_rounds} rounds: first prompt {w.request_length} "
        f"tokens, then {w.sub_question_input_length} new per round, {w.output_length} out; "
        f"Poisson arrivals, max_parallel {w.max_parallel}",
        "",
        "| rate (req/s) | mode | TTFT p50 / p99 ms | TPOT mean / p50 ms | e2e mean / p50 / p99 ms "
        "| out tok/s | req/s | hit rate | session / stateless TTFT p50 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for rate, by_mode in rates.items():
        for mode in MODES:
            f = by_mode[mode]
            ratio = f"{by_mode['ttft_p50_ratio']:.3f}" if mode == "sessions" else ""
            lines.append(
                f"| {rate} | {mode} | {f['ttft_p50_ms']} / {f['ttft_p99_ms']} "
                f"| {f['tpot_mean_ms']} / {f['tpot_p50_ms']} "
                f"| {f['e2e_mean_ms']} / {f['e2e_p50_ms']} / {f['e2e_p99_ms']} "
                f"| {f['output_token_throughput']} | {f['request_throughput']} "
                f"| {f['cache_hit_rate']:.3f} | {ratio} |"
            )
    lines += [
        "",
        "| rate | mode | round | TTFT mean / p50 / p90 / p99 ms | cached / prompt tokens "
        "| hit rate |",
        "|---|---|---|---|---|---|",
    ]
    for rate, by_mode in rates.items():
        for mode in MODES:
            for r in by_mode[mode]["rounds"]:
                ttft = " / ".join(str(r[f"ttft_{k}_ms"]) for k in ("mean", "p50", "p90", "p99"))
                lines.append(
                    f"| {rate} | {mode} | {r['round']} | {ttft} "
                    f"| {r['cached_tokens_mean']} / {r['prompt_tokens_mean']} "
                    f"| {r['cache_hit_rate']:.3f} |"
                )
    return "\n".join(lines)


def plot_ttft(path: Path, workload: Workload, rates: dict[str, dict]) -> None:
    """TTFT p50 and p99 against the request rate, one line per mode and percentile."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = list(workload.request_rates)
    for mode, color in zip(MODES, ("tab:blue", "tab:orange"), strict=True):
        for key, style in (("p50", "-"), ("p99", "--")):
            ys = [rates[f"{x:g}"][mode][f"ttft_{key}_ms"] for x in xs]
            ax.plot(xs, ys, style, marker="o", color=color, label=f"{mode} {key}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.minorticks_off()
    ax.set_xlabel("request rate (requests/s)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title(f"multi-turn: {workload.num_clients} clients x {workload.num_rounds} rounds")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
