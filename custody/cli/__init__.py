"""The `custody` command.

Parsing imports nothing heavy: each subcommand imports what it needs in its handler, so
`custody up` (a supervisor of child processes) never loads torch or a benchmark. The
command is a package of its own, above the rest of custody: the benchmarks and the soak
build on `custody.up`, and only this package imports them.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from shared.config import Settings
from shared.sglang_flags import add_sglang_flags, apply_sglang_flags

if TYPE_CHECKING:
    from custody.bench.multiturn_workload import Workload

# The choices of `custody bench`, known without importing the benchmarks (torch); a test
# checks them against `benchmarks()`.
BENCHMARK_NAMES = (
    "allocators",
    "e2e",
    "events",
    "executor",
    "multiturn",
    "orchestration",
    "prefix",
    "scaleout",
    "serving",
    "sessions",
    "spec",
    "structured",
)
REPEATS = 7  # --repeats when not given; multiturn: 1 (a run pools clients x rounds requests)
# benchmarks whose --repeats defaults to 1 (prefix: its series; orchestration: its sweep of
# cells, a stack each; serving: bench_serving's percentiles over its own requests)
ONCE = ("multiturn", "orchestration", "prefix", "serving")
REPEATS_OF = {"spec": 3, "structured": 3}  # interleaved runs of every cell: 3 keep it to a minute
# --repeats with --baseline: each side's figures the median of three alternated runs
BASELINE_REPEATS = 3
BASELINE_BENCHMARKS = ("e2e", "orchestration")
# `custody bench multiturn`'s workload flags (SGLang bench_multiturn's names): the fields of
# custody.bench.multiturn_workload.Workload, whose defaults apply when a flag is not given.
MULTITURN_FLAGS = {
    "num_clients": (int, "conversations, one session each in the sessions mode"),
    "num_rounds": (int, "rounds per conversation"),
    "request_length": (int, "tokens of each conversation's first prompt"),
    "sub_question_input_length": (int, "new tokens of every later round"),
    "output_length": (int, "tokens generated per round"),
    "max_parallel": (int, "rounds in flight at once, over all clients"),
    "seed": (int, "seed of the prompts and of the arrival gaps"),
}


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand's arguments; apart from `main` so a test can parse `up` in a
    fresh interpreter and see that nothing heavy was loaded."""
    parser = argparse.ArgumentParser(prog="custody", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="measure custody side by side with its references")
    bench.add_argument("name", nargs="?", choices=BENCHMARK_NAMES, help="one (default: all)")
    bench.add_argument("--json", action="store_true", help="print the combined JSON object")
    bench.add_argument(
        "--repeats",
        type=int,
        default=None,
        help=f"repeats per figure (default {REPEATS}; multiturn and prefix 1; "
        f"{BASELINE_REPEATS} with --baseline)",
    )
    bench.add_argument(
        "--gateway",
        choices=["router", "epp"],
        help="scaleout: the front its workload goes through (default router; epp: the "
        "endpoint picker, asked over ext_proc as a gateway asks it)",
    )
    bench.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="executor and orchestration: cuda runs the real executor on the GPU at the "
        "published 8B shape (docs/gpu.md)",
    )
    _add_baseline_arguments(bench)
    _add_multiturn_arguments(bench)
    demo = sub.add_parser("demo", help="one streaming session, scheduler and executor in process")
    demo.add_argument(
        "--model",
        type=Path,
        default=None,
        help="a NemotronH checkpoint directory (default: the built-in tiny model)",
    )
    demo.add_argument("--turns", type=int, default=4)
    demo.add_argument("--max-new-tokens", type=int, default=24)
    soak = sub.add_parser("soak", help="concurrent sessions, aborts and faults; then checks")
    soak.add_argument("--duration", type=float, default=180.0, help="seconds of load")
    soak.add_argument(
        "--chaos",
        action="store_true",
        help="small state tiers; kill services (the executor during tier moves), restart Redis",
    )
    soak.add_argument(
        "--faults",
        choices=["distributed"],
        help="distributed: pauses, partitions, Redis refusing writes, a lagging store, "
        "router kills mid-move and drains over --replicas, with a history checker",
    )
    soak.add_argument("--replicas", type=int, default=2, help="with --faults (default 2)")
    soak.add_argument(
        "--replica-dead-seconds",
        type=float,
        default=3.0,
        help="with --faults: when a silent replica is dead (default 3)",
    )
    soak.add_argument("--json", action="store_true")
    tokenizer = sub.add_parser("tokenizer", help="the built-in model's tokenizer as files")
    actions = tokenizer.add_subparsers(dest="action", required=True)
    export = actions.add_parser(
        "export", help="write tokenizer.json and tokenizer_config.json (for --tokenizer DIR)"
    )
    export.add_argument("directory", type=Path)
    export.add_argument(
        "--context-len",
        type=int,
        default=Settings.context_len,
        help=f"the model_max_length written (default {Settings.context_len})",
    )
    drain = sub.add_parser(
        "drain", help="move every session off a replica with its state (a preStop hook)"
    )
    drain.add_argument(
        "--url", required=True, help="the endpoint picker's HTTP port, or the custody router"
    )
    drain.add_argument("--replica", help="the replica's id (default: this hostname)")
    drain.add_argument(
        "--timeout", type=float, default=110.0, help="seconds to wait for the drain (110)"
    )
    up = sub.add_parser(
        "up",
        help="start Redis (unless given) and the three services",
        description="Every setting takes its custody name, and SGLang's where it has one; "
        "SGLang's other launch flags are accepted or refused by name.",
    )
    Settings.add_arguments(up)
    add_sglang_flags(up)
    return parser


def _add_baseline_arguments(bench: argparse.ArgumentParser) -> None:
    """A figure of this machine means something only beside another revision's measured
    in the same hour: these flags ask for one, on the cells wanted."""
    bench.add_argument(
        "--baseline",
        metavar="REV",
        help="orchestration and e2e: also measure the services of git revision REV (its "
        "tree extracted to a temporary directory) with this revision's clients, each run "
        "of this revision followed by one of REV's; each side reports its own medians "
        "(docs/benchmarks.md)",
    )
    bench.add_argument(
        "--cells",
        metavar="KEYS",
        help="orchestration: only these cells of its sweep, comma-separated (e.g. "
        "b256_ctx8k_10ms,b64_ctx1k_10ms; default all 27)",
    )


def _add_multiturn_arguments(bench: argparse.ArgumentParser) -> None:
    group = bench.add_argument_group("multiturn", "read by `custody bench multiturn` only")
    for name, (kind, help_text) in MULTITURN_FLAGS.items():
        group.add_argument("--" + name.replace("_", "-"), type=kind, help=help_text)
    group.add_argument(
        "--request-rate",
        dest="request_rates",
        type=float,
        nargs="+",
        help="requests/s over all clients (Poisson); one run per rate and mode",
    )


def main(argv: list[str] | None = None) -> int:
    """Parse, then hand over to the subcommand's handler (which imports what it needs)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handlers = {
        "bench": _bench,
        "demo": _demo,
        "drain": _drain,
        "soak": _soak,
        "tokenizer": _tokenizer,
        "up": _up,
    }
    return handlers[args.command](parser, args)


def _up(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from custody import up

    try:
        apply_sglang_flags(args)
        settings = Settings.resolve(args)
    except ValueError as err:
        parser.error(str(err))
    return up.run(settings)


def _drain(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from custody import drain

    if args.timeout <= 0:
        parser.error("--timeout must be > 0")
    return drain.run(args.url, args.replica, args.timeout)


def _tokenizer(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from services.scheduler.text.tokenizer_files import export_byte_tokenizer

    if args.context_len < 2:
        parser.error("--context-len must be >= 2")
    print(export_byte_tokenizer(args.directory, args.context_len))
    return 0


def _soak(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from custody import soak

    if args.duration <= 0:
        parser.error("--duration must be > 0")
    if args.faults is not None:
        if args.chaos:
            parser.error("--faults and --chaos are separate soaks")
        if args.replicas < 2 or args.replica_dead_seconds <= 0:
            parser.error("--faults needs --replicas >= 2 and --replica-dead-seconds > 0")
        return soak.run_campaign(args.duration, args.replicas, args.replica_dead_seconds, args.json)
    return soak.run(args.duration, args.chaos, args.json)


def _demo(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from custody import demo

    if args.turns < 1 or args.max_new_tokens < 1:
        parser.error("--turns and --max-new-tokens must be >= 1")
    return demo.run(args.model, args.turns, args.max_new_tokens)


def benchmarks() -> dict[str, Callable[[int], dict]]:
    """Each benchmark's entry point (repeats -> result with a markdown "table"); imports
    them all, torch included."""
    from custody.bench import (
        allocators,
        e2e,
        events,
        executor,
        multiturn,
        orchestration,
        prefix,
        scaleout,
        serving,
        sessions,
        spec,
        structured,
    )

    return {
        "allocators": allocators.run,
        "e2e": e2e.run,
        "events": events.run,
        "executor": executor.run,
        "multiturn": multiturn.run,
        "orchestration": orchestration.run,
        "prefix": prefix.run,
        "scaleout": scaleout.run,
        "serving": serving.run,
        "sessions": sessions.run,
        "spec": spec.run,
        "structured": structured.run,
    }


def device_benchmarks() -> dict[str, Callable[[int], dict]]:
    """`--device cuda`'s two: the executor and the orchestration bench on the GPU at the
    published 8B shape (docs/gpu.md); the others' modules are not imported."""
    from custody.bench import executor_device, orchestration

    return {"executor": executor_device.run, "orchestration": orchestration.run_on_device}


def _multiturn_workload(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Workload:
    """The workload the multiturn flags given describe (the defaults for the rest)."""
    from custody.bench.multiturn_workload import Workload

    knobs = {k: getattr(args, k) for k in [*MULTITURN_FLAGS, "request_rates"]}
    knobs = {k: tuple(v) if k == "request_rates" else v for k, v in knobs.items() if v is not None}
    if knobs and args.name != "multiturn":
        parser.error("the multiturn flags apply to `custody bench multiturn` only")
    try:
        return Workload(**knobs)
    except ValueError as err:
        parser.error(str(err))


def _bench_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """`--baseline` and `--cells` checked, before the benchmarks (torch) are imported:
    the revision resolved to its commit id, as the bench's `baseline` argument."""
    if args.baseline is not None and args.name not in BASELINE_BENCHMARKS:
        parser.error("--baseline applies to `custody bench orchestration` or `e2e` only")
    if args.cells is not None and args.name != "orchestration":
        parser.error("--cells applies to `custody bench orchestration` only")
    if args.device == "cuda" and (args.baseline is not None or args.cells is not None):
        parser.error("--baseline and --cells apply to the stand-in's sweep, not --device cuda")
    if args.baseline is None:
        return {}
    from custody.bench.baseline import revision

    try:
        return {"baseline": revision(args.baseline)}
    except ValueError as err:
        parser.error(str(err))


def _bench(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats must be >= 1")
    workload = _multiturn_workload(parser, args)
    if args.gateway is not None and args.name != "scaleout":
        parser.error("--gateway applies to `custody bench scaleout` only")
    if args.device == "cuda" and args.name not in ("executor", "orchestration"):
        parser.error("--device cuda applies to `custody bench executor` or `orchestration`")
    options = _bench_options(parser, args)
    runs = device_benchmarks() if args.device == "cuda" else benchmarks()
    if args.cells is not None:
        from custody.bench.orchestration import cells_named

        try:
            options["cells"] = cells_named([k.strip() for k in args.cells.split(",") if k.strip()])
        except ValueError as err:
            parser.error(str(err))
    if options:
        runs[args.name] = functools.partial(runs[args.name], **options)
    if "multiturn" in runs:
        runs["multiturn"] = functools.partial(runs["multiturn"], workload=workload)
    if args.gateway == "epp":
        from custody.bench import scaleout_gateway

        runs["scaleout"] = scaleout_gateway.run
    names = [args.name] if args.name else list(BENCHMARK_NAMES)
    combined = {}
    for name in names:
        default = 1 if name in ONCE else REPEATS_OF.get(name, REPEATS)
        if args.baseline is not None:
            default = BASELINE_REPEATS
        result = runs[name](default if args.repeats is None else args.repeats)
        combined[name] = {k: v for k, v in result.items() if k != "table"}
        if not args.json:
            print(f"## {name}\n\n{result['table']}\n")
    if args.json:
        print(json.dumps(combined[names[0]] if len(names) == 1 else combined, indent=2))
    return 0
