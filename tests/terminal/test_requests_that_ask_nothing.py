"""Requests that ask for nothing, or for two opposite things, through the real CLI: one line, exit 2, nothing
written (they were answered with an empty table, a perfect correlation of a run with itself, or one of the two
options silently ignored)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import error_line, run_cli

from headsweep.errors import HeadsweepError
from headsweep.results.query import run_query
from headsweep.results.store import ResultStore

STORE_V1 = Path(__file__).resolve().parents[1] / "data" / "store_v1"
V1_CLASSIFIER = "20261122-180235-883e36"


def refused(proc, expected: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    assert error_line(proc.stderr) == f"headsweep: error: {expected}"


EMPTY_QUERY = ("query is empty (no SQL statement in it, only blanks, ';' or comments): give a SELECT, e.g. "
               '"SELECT * FROM runs"')


def test_an_empty_query_is_refused():
    refused(run_cli("query", "  ;  ", "--store", str(STORE_V1)), EMPTY_QUERY)
    for sql in ("", "-- nothing", "/* a comment */ ;"):
        with pytest.raises(HeadsweepError) as refusal:
            run_query(ResultStore(str(STORE_V1)), sql)
        assert str(refusal.value) == EMPTY_QUERY


def test_compare_of_a_run_with_itself_is_refused():
    refused(run_cli("compare", V1_CLASSIFIER, V1_CLASSIFIER, "--store", str(STORE_V1)),
            f"compare needs two different runs; {V1_CLASSIFIER} was given twice (a run agrees with itself)")


def test_resume_and_new_together_are_refused(tmp_path):
    config = Path(__file__).resolve().parents[2] / "conf" / "classifier_single_head.yaml"
    refused(run_cli("run", str(config), "--resume", "20261122-180235-883e36", "--new", "--store",
                    str(tmp_path / "store")),
            "--resume 20261122-180235-883e36 and --new ask for opposite things: give one (--resume continues that "
            "run, --new starts another)")
    assert not (tmp_path / "store").exists()
