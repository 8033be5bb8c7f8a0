"""The ``headsweep`` command line."""

from __future__ import annotations

import argparse
import os
import sys

from sweep.errors import HeadsweepError

DEFAULT_STORE = "headsweep-store"


def _store_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--store",
        default=os.environ.get("HEADSWEEP_STORE", DEFAULT_STORE),
        help="results store URI: a local path or any pyarrow filesystem URI (default: $HEADSWEEP_STORE or "
        f"./{DEFAULT_STORE})",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="headsweep", description="Which attention heads does this trained Transformer need?"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a sweep from a config file; prints the run id")
    run.add_argument("config", help="YAML config file (see conf/)")
    run.add_argument("overrides", nargs="*", help="config overrides, key=value (e.g. sweep.workers=2)")
    _store_arg(run)
    run.add_argument("--workers", type=int, help="number of worker actors (sweep.workers)")
    run.add_argument("--address", help="Ray cluster address; default: an embedded local Ray instance")
    run.add_argument("--quiet", action="store_true", help="no progress lines")

    query = sub.add_parser("query", help="SQL over the results tables (DuckDB)")
    query.add_argument("sql", help="SQL; the tables runs, evaluations, examples, significance, importance are views")
    _store_arg(query)
    query.add_argument("--format", default="table", choices=["table", "csv", "json"])

    demo = sub.add_parser("demo", help="the embedded default, end to end, offline")
    _store_arg(demo)
    demo.add_argument("--workers", type=int, default=2, help="number of worker actors (default 2)")
    demo.add_argument("--quiet", action="store_true", help="no progress lines")
    return parser


def cmd_run(args: argparse.Namespace) -> int:
    from results.store import ResultStore
    from sweep.config import load_config
    from sweep.driver import Sweep

    overrides = list(args.overrides)
    if args.workers is not None:
        overrides.append(f"sweep.workers={args.workers}")
    cfg = load_config(args.config, overrides)
    sweep = Sweep(cfg, ResultStore(args.store), address=args.address, show_progress=not args.quiet)
    try:
        run_id = sweep.execute()
    except KeyboardInterrupt:
        print(f"headsweep: interrupted: run {sweep.run_id} is marked interrupted in {args.store}", file=sys.stderr)
        return 130
    print(run_id)
    return 0


def cmd_query(args: argparse.Namespace) -> int:
    from results.query import format_table, run_query
    from results.store import ResultStore

    print(format_table(run_query(ResultStore(args.store), args.sql), args.format))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from sweep.demo import run_demo

    return run_demo(args.store, workers=args.workers, show_progress=not args.quiet)


def _stop_ray() -> None:
    # Flush the workers' log lines now, so the error is the last line the user sees.
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


COMMANDS = {"run": cmd_run, "query": cmd_query, "demo": cmd_demo}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except HeadsweepError as exc:
        _stop_ray()
        print(f"headsweep: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("headsweep: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
