"""The ``headsweep`` command line."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import signal
import sys
import traceback
from typing import TYPE_CHECKING, NoReturn

from headsweep.errors import HeadsweepError
from headsweep.sweep.output import console, signals

if TYPE_CHECKING:
    from headsweep.results.store import ResultStore

DEFAULT_STORE = "headsweep-store"


def _store_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--store",
        default=os.environ.get("HEADSWEEP_STORE", DEFAULT_STORE),
        help="results store URI: a local path or any pyarrow filesystem URI (default: $HEADSWEEP_STORE or "
        f"./{DEFAULT_STORE})",
    )


def _job_address_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--address",
        default=os.environ.get("RAY_API_SERVER_ADDRESS"),
        help="the cluster's Ray job API, http://HEAD:8265 (default: $RAY_API_SERVER_ADDRESS)",
    )


def _force_arg(p: argparse.ArgumentParser, what: str) -> None:
    help_text = ("replace an existing --out FILE" if what == "FILE" else
                 "write into an --out folder that holds files headsweep did not write (they are kept: only what "
                 "headsweep wrote there is replaced)")
    p.add_argument("--force", action="store_true", help=help_text)


VERBOSE_HELP = ("also show other libraries' messages (Ray, torch, transformers, fairseq, hydra, matplotlib) on "
                "stderr; by default they go to a log file whose path is printed")


def _verbose_arg(p: argparse.ArgumentParser, default=False) -> None:
    p.add_argument("-v", "--verbose", action="store_true", default=default, help=VERBOSE_HELP)


class _Subparsers(argparse._SubParsersAction):
    """Every command takes the global ``--verbose`` after its name too (``headsweep demo --verbose``)."""

    def add_parser(self, name, **kwargs):
        p = super().add_parser(name, **kwargs)
        p.register("action", "parsers", _Subparsers)  # and the commands of `jobs`
        # SUPPRESS: a command that does not name it keeps the value given before the command.
        _verbose_arg(p, default=argparse.SUPPRESS)
        return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="headsweep", description="Which attention heads does this trained Transformer need?"
    )
    parser.register("action", "parsers", _Subparsers)
    _verbose_arg(parser)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a sweep from a config file; prints the run id")
    run.add_argument("config", help="YAML config file (see conf/)")
    run.add_argument("overrides", nargs="*", help="config overrides, key=value (e.g. sweep.workers=2)")
    _store_arg(run)
    run.add_argument("--workers", type=int, help="number of worker actors (sweep.workers)")
    run.add_argument("--address", help="Ray cluster address; default: an embedded local Ray instance")
    run.add_argument("--keep-workers", metavar="SECONDS", help="with --address: keep the workers warm this long "
                     "after the run, for the next run with workers of the same shape (no process start); default "
                     "$HEADSWEEP_KEEP_WORKERS, else 0 (they end with the run)")
    run.add_argument("--quiet", action="store_true", help="no progress lines")
    run.add_argument("--resume", metavar="RUN_ID", help="continue this run (same config); default: the newest "
                     "unfinished run of the same config in the store, if any")
    run.add_argument("--new", action="store_true", help="always start a new run, even if one could be resumed or "
                     "one of this config is complete (without it, a complete run is not run again)")

    query = sub.add_parser("query", help="SQL over the results tables (DuckDB)")
    query.add_argument("sql", help="SQL; the tables runs, evaluations, examples, significance, importance are views, "
                       "and so are deltas, heads, layers, pruning, summary (see results/README.md)")
    _store_arg(query)
    query.add_argument("--format", default="table", choices=["table", "csv", "json", "parquet"])
    query.add_argument("--out", metavar="FILE", help="write the result to FILE (needed for --format parquet)")
    _force_arg(query, "FILE")

    runs = sub.add_parser("runs", help="list the runs of a store: status, model, data, metric, baseline, counts")
    _store_arg(runs)
    runs.add_argument("--format", default="table", choices=["table", "csv", "json", "parquet"])
    runs.add_argument("--out", metavar="FILE", help="write the list to FILE (needed for --format parquet)")
    _force_arg(runs, "FILE")

    status = sub.add_parser("status", help="where one run stands: stored, significant so far, ETA")
    status.add_argument("run_id", metavar="RUN_ID")
    _store_arg(status)

    report = sub.add_parser("report", help="an interactive HTML page (the explorer) of one or more runs; prints its "
                            "path")
    report.add_argument("run_ids", nargs="+", metavar="RUN_ID")
    _store_arg(report)
    report.add_argument("--out", metavar="DIR", help="folder for index.html, plotly.min.js and its PNG files "
                        "(default: ./headsweep-report/RUN_ID for one run, ./headsweep-report otherwise)")
    _force_arg(report, "DIR")
    report.add_argument("--attention", action="store_true", help="load each run's model again for the attention "
                        "patterns of the 8 most harmful heads on the examples they change most (and a language "
                        "model's per-token losses) in their drill-downs")

    submit = sub.add_parser("submit", help="submit a sweep as a Ray job to a running cluster; prints the job id")
    submit.add_argument("config", help="YAML config file; model, data and store paths must be valid on the cluster")
    submit.add_argument("overrides", nargs="*", help="config overrides, key=value")
    _job_address_arg(submit)
    submit.add_argument("--store", default=None,
                        help="store URI as the cluster sees it (shared storage); default: $HEADSWEEP_STORE there")
    submit.add_argument("--workers", type=int, help="number of worker actors (sweep.workers)")
    submit.add_argument("--python", default="python", help="the Python interpreter on the cluster (default: python)")
    submit.add_argument("--runtime-env-json", help="extra Ray runtime_env as JSON (e.g. pip packages, env vars)")
    submit.add_argument("--wait", action="store_true", help="follow the job until it ends")
    submit.add_argument("--entrypoint-num-cpus", type=float, default=None,
                        help="CPUs the driver holds; with this or --entrypoint-resources Ray may run the driver on "
                        "a worker node instead of the head")
    submit.add_argument("--entrypoint-resources", default=None, metavar="JSON",
                        help='custom resources the driver needs, as JSON (e.g. \'{"driver": 1}\')')

    jobs = sub.add_parser("jobs", help="follow submitted jobs: list, status, logs, stop, wait")
    jobs_sub = jobs.add_subparsers(dest="jobs_command", required=True)
    for name in ("list", "status", "logs", "stop", "wait"):
        p = jobs_sub.add_parser(name)
        if name != "list":
            p.add_argument("job_id")
        _job_address_arg(p)
        if name == "wait":
            p.add_argument("--timeout", type=float, default=None, help="seconds to wait at most")

    compare = sub.add_parser("compare", help="cross-domain consistency of two runs of one model (two data sets, "
                                             "or two ablation methods)")
    compare.add_argument("run_a")
    compare.add_argument("run_b")
    _store_arg(compare)
    compare.add_argument("--format", default="table", choices=["table", "csv", "json"])

    export = sub.add_parser("export", help="write the config's model with heads physically removed; prints the folder")
    export.add_argument("config", help="YAML config file (its model section names the model)")
    export.add_argument("overrides", nargs="*", help="config overrides, key=value")
    export.add_argument("--mask", help="heads to remove, comma-separated (e.g. self:0:1,self:2:3)")
    export.add_argument("--from-run", metavar="RUN_ID", help="take the mask of this run's --level or --eval-id")
    export.add_argument("--level", type=float, help="the prune_level evaluation at this level (e.g. 0.5)")
    export.add_argument("--eval-id", help="the evaluation with this id (e.g. custom/self:0:1,self:1:2)")
    export.add_argument("--out", required=True, metavar="DIR", help="a new or empty folder for the pruned model")
    export.add_argument("--stock", action=argparse.BooleanOptionalAction, default=None,
                        help="--stock: the model's own architecture with the pruned head counts in config.json "
                             "(from_pretrained loads it), or refuse the mask; --no-stock: config.pruned_heads "
                             "(headsweep.load_pruned loads it); default: stock where the mask fits")
    _force_arg(export, "DIR")
    _store_arg(export)

    demo = sub.add_parser("demo", help="the embedded default, end to end, offline")
    _store_arg(demo)
    demo.add_argument("--workers", type=int, default=2, help="number of worker actors (default 2)")
    demo.add_argument("--quiet", action="store_true", help="no progress lines")
    demo.add_argument("--report", metavar="DIR", help="folder of the runs' report (default: headsweep-report "
                      "beside the store)")
    _add_fetch(sub)
    return parser


def cmd_run(args: argparse.Namespace) -> int:
    from headsweep.sweep.configuration.config import check_data_files, load_config, workers_override

    if args.resume and args.new:
        raise HeadsweepError(f"--resume {args.resume} and --new ask for opposite things: give one (--resume continues "
                             "that run, --new starts another)")
    overrides = list(args.overrides)
    if args.workers is not None:
        overrides.append(workers_override(args.workers, overrides))
    from headsweep.sweep.cluster.keep_time import keep_seconds

    keep_s = keep_seconds(args.keep_workers, args.address)
    cfg = load_config(args.config, overrides)
    check_data_files(cfg)  # before Ray and the models start: a bad data file costs no worker
    # Ray, pyarrow's datasets and pandas cost the driver 2-4 s of imports: a config refused above never pays them.
    from headsweep.results.store import ResultStore
    from headsweep.sweep.run.driver import Sweep

    sweep = Sweep(cfg, ResultStore(args.store), address=args.address, show_progress=not args.quiet,
                  resume=args.resume, auto_resume=not args.new, keep_workers_s=keep_s)
    try:
        # stdout carries only the run id (RUN=$(headsweep run ...)): whatever a library prints to
        # sys.stdout goes where stderr goes (the log file, or the terminal with --verbose).
        with contextlib.redirect_stdout(sys.stderr):
            run_id = sweep.execute()
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (signals.Terminated)
        if sweep.record is not None and sweep.record.written:
            _interrupted(exc, f"run {sweep.run_id} is marked interrupted in {args.store}; run the same command "
                              "again to continue it")
        else:  # nothing of the run stored yet: Ray starting, the models loading, optimal ablation's training
            _interrupted(exc, "stopped before the run wrote anything; the store is as it was")
    console.out(run_id)
    return 0


def _existing_store(uri: str) -> ResultStore:
    """The store a reading command names; one line if nothing (or a file) is there, rather than an empty answer.

    The experiment kinds' tables and views are registered (the built-in kinds, and those defined outside headsweep
    that the store's runs ran), so that every query view reads them."""
    from headsweep.results.store import ResultStore
    from headsweep.sweep.experiments import register_stored_kinds

    store = ResultStore(uri)
    store.check_exists()
    register_stored_kinds(store)
    return store


def _query_out(args: argparse.Namespace, sql: str, listing=None) -> int:
    """Run ``sql`` on the store (through ``listing(store, sql)`` where given); print the result, or write it to
    ``--out`` (never into the store, never over a file without ``--force``), batch by batch."""
    from headsweep.results.outputs import check_output
    from headsweep.results.query import check_format, consume_query, write_result

    store = _existing_store(args.store)
    out = check_output(args.out, "file", force=args.force, store=store) if args.out is not None else None
    check_format(args.format, out)

    def write(reader) -> None:
        write_result(reader, args.format, out, show=console.out)

    if listing is None:
        consume_query(store, sql, write)
    else:
        write(listing(store, sql).to_reader())
    return 0


def cmd_query(args: argparse.Namespace) -> int:
    return _query_out(args, args.sql)


def cmd_runs(args: argparse.Namespace) -> int:
    from headsweep.results.views import RUNS_LIST
    from headsweep.sweep.run.status import runs_listing

    return _query_out(args, RUNS_LIST, runs_listing)


def cmd_status(args: argparse.Namespace) -> int:
    from headsweep.sweep.run.status import status_lines

    console.out("\n".join(status_lines(_existing_store(args.store), args.run_id)))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from headsweep.sweep.reporting.report import default_report_dir, write_report

    store = _existing_store(args.store)
    out = args.out or default_report_dir(args.run_ids)
    console.out(write_report(store, args.run_ids, out, attention=args.attention, force=args.force))
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    from headsweep.sweep.cluster import jobs

    if not args.address:
        raise HeadsweepError("submit needs --address http://HEAD:8265 (or $RAY_API_SERVER_ADDRESS)")
    try:
        env = json.loads(args.runtime_env_json) if args.runtime_env_json else None
    except json.JSONDecodeError as exc:
        raise HeadsweepError(f"--runtime-env-json is not valid JSON: {exc}") from None
    try:
        resources = json.loads(args.entrypoint_resources) if args.entrypoint_resources else None
    except json.JSONDecodeError as exc:
        raise HeadsweepError(f"--entrypoint-resources is not valid JSON: {exc}") from None
    if resources is not None and not isinstance(resources, dict):
        raise HeadsweepError(f"--entrypoint-resources must be a JSON object of resource amounts, got {resources!r}")
    job_id = jobs.submit(args.config, args.overrides, args.address, args.store, args.workers, env, python=args.python,
                         entrypoint_num_cpus=args.entrypoint_num_cpus, entrypoint_resources=resources)
    console.out(job_id)
    if args.wait:
        jobs.follow(args.address, job_id)
    return 0


def cmd_jobs(args: argparse.Namespace) -> int:
    from headsweep.sweep.cluster import jobs

    if not args.address:
        raise HeadsweepError("jobs needs --address http://HEAD:8265 (or $RAY_API_SERVER_ADDRESS)")
    if args.jobs_command == "list":
        console.out(jobs.format_jobs(jobs.list_jobs(args.address)))
    elif args.jobs_command == "status":
        state, why = jobs.status_detail(args.address, args.job_id)
        console.out(state)  # the status word alone on its line, for scripts; why on the next
        if why:
            console.out(why)
    elif args.jobs_command == "logs":
        console.out(jobs.logs(args.address, args.job_id), end="")
    elif args.jobs_command == "stop":
        stopped = jobs.stop(args.address, args.job_id)
        console.out(f"stopping {args.job_id}" if stopped else f"{args.job_id} had already ended")
    else:
        final = jobs.wait(args.address, args.job_id, args.timeout)
        console.out(final)
        return 0 if final == "SUCCEEDED" else 1
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from headsweep.results.query import format_table
    from headsweep.sweep.reporting.compare import compare_runs

    correlations, overlap = compare_runs(_existing_store(args.store), args.run_a, args.run_b)
    console.out(format_table(correlations, args.format))
    console.out(format_table(overlap, args.format))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from headsweep.results.store import ResultStore
    from headsweep.sweep.configuration.config import load_config
    from headsweep.sweep.pruning.export import export_pruned

    store = _existing_store(args.store) if args.from_run else ResultStore(args.store)
    cfg = load_config(args.config, list(args.overrides))
    mask = args.mask.replace(",", " ").split() if args.mask is not None else None
    console.out(export_pruned(cfg, args.out, store, args.from_run, args.level, args.eval_id, mask, stock=args.stock,
                              force=args.force))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from headsweep.sweep.demo import run_demo

    return run_demo(args.store, workers=args.workers, show_progress=not args.quiet, report=args.report)


def _add_fetch(sub: argparse._SubParsersAction) -> None:
    fetch = sub.add_parser("fetch", help="download a Hugging Face Hub model into the local Hugging Face cache, where "
                           "runs find it by id (the only command that downloads); prints its snapshot folder")
    fetch.add_argument("model", help="hub id: org/name or name, optionally @revision")
    fetch.add_argument("--revision", help="branch, tag or commit (default: main)")


def cmd_fetch(args: argparse.Namespace) -> int:
    from headsweep.workers.hub.cache import fetch

    console.out(fetch(args.model, args.revision, say=console.say).folder)
    return 0


def _stop_ray() -> None:
    # Flush the workers' log lines now, so the error is the last line the user sees. Also without a connection:
    # a ray.init that a signal cut short has local Ray processes to end (shutdown may run any number of times).
    ray = sys.modules.get("ray")
    if ray is not None:
        ray.shutdown()


def _interrupted(exc: KeyboardInterrupt, what: str = "") -> NoReturn:
    """End a command that Ctrl-C or SIGTERM stopped (the run's row is written by then): one ``headsweep:
    interrupted`` line (saying ``what`` was left, and which signal unless Ctrl-C's), Ray shut down, then the
    process ends with 130 or 143 at once."""
    signals.ignore_further()  # done by the signal's handler; not by a KeyboardInterrupt raised elsewhere
    console.finish()
    code = signals.exit_code(exc)
    by = "" if code == 128 + signal.SIGINT else f" ({signal.Signals(code - 128).name})"
    console.say(f"headsweep: interrupted{by}" + (f": {what}" if what else ""))
    # The line comes first: Ray's shutdown puts SIGTERM back to its default handler for a moment, and a SIGTERM
    # repeated then ends the process by the signal itself (status 143 all the same) before anything after it.
    _stop_ray()
    signals.exit_now(code)


# Arguments that reach DuckDB, pyarrow or the store's file names, which take Unicode text only.
TEXT_ARGS = {"sql": "the SQL", "store": "--store", "out": "--out", "run_id": "RUN_ID", "run_ids": "RUN_ID",
             "run_a": "RUN_A", "run_b": "RUN_B", "from_run": "--from-run", "eval_id": "--eval-id", "mask": "--mask"}


def _check_text(args: argparse.Namespace) -> None:
    """Refuse an argument that is not valid UTF-8 (Python keeps such bytes as lone surrogates, which DuckDB and
    pyarrow cannot take): one line naming it, rather than an internal error."""
    for name, label in TEXT_ARGS.items():
        values = getattr(args, name, None)
        for value in values if isinstance(values, list) else [values]:
            if not isinstance(value, str):
                continue
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                shown = value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
                raise HeadsweepError(f"{label} is not valid UTF-8 text ({shown[:80]}): give it in UTF-8") from None


COMMANDS = {"run": cmd_run, "submit": cmd_submit, "jobs": cmd_jobs, "query": cmd_query, "runs": cmd_runs,
            "status": cmd_status, "report": cmd_report, "compare": cmd_compare, "export": cmd_export,
            "demo": cmd_demo, "fetch": cmd_fetch}


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Parse, letting ``key=value`` overrides stand anywhere after the config (even after options)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    takes_overrides = hasattr(args, "overrides")
    unknown = [a for a in extra if not (takes_overrides and "=" in a and not a.startswith("-"))]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


# Commands that run long and start Ray or train models: the log file's path is printed when they start.
# The others print it at the end, and only when another library wrote something into it.
ANNOUNCE_LOG = {"run", "demo"}


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit status. A command that Ctrl-C or SIGTERM stopped ends the process itself
    (exit 130 or 143), once it has cleaned up."""
    args = parse(argv)
    try:
        if not args.verbose:  # --verbose writes no log file
            console.check_log_dir()
    except HeadsweepError as exc:  # before the console routes output: the terminal is still the terminal
        print(f"headsweep: error: {exc}", file=sys.stderr)
        return 2
    # Set up here, never at import: a program that imports headsweep keeps its own logging and streams.
    # submit's --store is a path on the cluster: no folder of this machine's is made beside it for the log
    local_store = getattr(args, "store", None) if args.command != "submit" else None
    con = console.setup(args.command, args.verbose, local_store, announce=args.command in ANNOUNCE_LOG)
    signals.install()  # SIGTERM (a scheduler's stop) ends a command as Ctrl-C does
    try:
        _check_text(args)
        code = COMMANDS[args.command](args)
        # Inside the try: a Ctrl-C or SIGTERM while Ray shuts down after the command's work (bench/interrupt_stress:
        # 2 of 6 stops once every evaluation was stored) ends the command as any other, not in a traceback, exit 1.
        session = sys.modules.get("headsweep.sweep.cluster.ray_session")  # imported by the commands that use Ray
        if session is not None:
            session.end_ray()
    except HeadsweepError as exc:
        _stop_ray()
        console.finish(name_log=False)  # the error line is the one line that matters
        console.say(f"headsweep: error: {exc}")
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (signals.Terminated)
        _interrupted(exc)
    except BrokenPipeError:
        console.stdout_closed()  # e.g. `headsweep query ... | head -1`: the reader has what it wanted
        console.finish(name_log=False)
        return 0
    except Exception as exc:
        if con.log_path is None:
            raise  # --verbose: the traceback on the terminal, as Python prints it
        traceback.print_exc()  # into the log file
        _stop_ray()
        con.announce = True  # the error line below names the log file
        console.finish()
        first = (str(exc).splitlines() or [""])[0][:300]
        console.say(f"headsweep: error: unexpected {type(exc).__name__}: {first} (traceback in {con.log_path})")
        return 1
    console.finish()
    return code


def console_main() -> int:
    """The ``headsweep`` command (and ``python -m headsweep``): ``main`` in a process that ends with it."""
    code = main()
    # The process ends now: its last garbage collection would walk every object the command made (0.3 s after a
    # run) only to free memory the exit frees anyway. Every file the command wrote is closed by now.
    gc.freeze()
    return code


if __name__ == "__main__":
    sys.exit(console_main())
