"""The `custody` command."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from custody.bench import BENCHMARKS
from shared.config import Settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="custody", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="measure custody side by side with its references")
    bench.add_argument(
        "name", nargs="?", choices=sorted(BENCHMARKS), help="one benchmark (default: all)"
    )
    bench.add_argument("--json", action="store_true", help="print the combined JSON object")
    bench.add_argument("--repeats", type=int, default=7, help="repeats per figure (median)")
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
    soak.add_argument("--chaos", action="store_true", help="kill services, restart Redis")
    soak.add_argument("--json", action="store_true")
    up = sub.add_parser("up", help="start Redis (unless given) and the three services")
    Settings.add_arguments(up)
    args = parser.parse_args(argv)
    if args.command == "up":
        from custody import up as up_job

        try:
            settings = Settings.resolve(args)
        except ValueError as err:
            parser.error(str(err))
        return up_job.run(settings)
    if args.command == "soak":
        from custody import soak as soak_job

        if args.duration <= 0:
            parser.error("--duration must be > 0")
        return soak_job.run(args.duration, args.chaos, args.json)
    if args.command == "demo":
        from custody import demo as demo_job

        if args.turns < 1 or args.max_new_tokens < 1:
            parser.error("--turns and --max-new-tokens must be >= 1")
        return demo_job.run(args.model, args.turns, args.max_new_tokens)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    names = [args.name] if args.name else sorted(BENCHMARKS)
    combined = {}
    for name in names:
        result = BENCHMARKS[name](args.repeats)
        combined[name] = {k: v for k, v in result.items() if k != "table"}
        if not args.json:
            print(f"## {name}\n\n{result['table']}\n")
    if args.json:
        print(json.dumps(combined[names[0]] if len(names) == 1 else combined, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
