"""The report page and what an experiment kind's report part gets: :class:`ReportPart`.

The page collects HTML and the figures it names, all under one folder; the helpers render tables of rows as the
query views return them. A kind's ``report(part)`` (``headsweep.sweep.experiments.base``) adds its section for one
model of one run with ``part.page.add``, ``part.page.figure`` and ``part.table``, reading the views with
``part.rows`` and ``part.of_model``.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import duckdb

from headsweep.sweep.report_parts import figures

TOP_HEADS = 10


def rows(con: duckdb.DuckDBPyConnection, sql: str, params: Sequence = ()) -> list[dict]:
    """The rows of ``sql`` (``?`` placeholders filled from ``params``) as dicts."""
    # Through Arrow: DuckDB's own Python conversion of time-zone timestamps needs pytz.
    return con.sql(sql, params=list(params)).to_arrow_table().to_pylist()


def fmt(value) -> str:
    """A cell as the report shows it: floats to 4 significant digits, booleans as ``yes`` or nothing."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def html_table(table_rows: Sequence[dict], columns: Sequence[tuple[str, str]]) -> str:
    """An HTML table of ``table_rows`` with (key, header) ``columns``; text cells align left."""
    head = "".join(f"<th>{html.escape(title)}</th>" for _, title in columns)
    body = []
    for r in table_rows:
        cells = []
        for key, _ in columns:
            value = r.get(key)
            cls = ' class="text"' if isinstance(value, str) else ""
            cells.append(f"<td{cls}>{html.escape(fmt(value))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def facts_table(pairs: Sequence[tuple[str, object]]) -> str:
    """A two-column HTML table of (name, value) pairs."""
    cells = "".join(f'<tr><th>{html.escape(k)}</th><td class="text">{html.escape(fmt(v))}</td></tr>'
                    for k, v in pairs)
    return f"<table>{cells}</table>"


def same(column: str) -> str:
    """SQL: ``column`` equals the parameter, null matching null (a run's single model has checkpoint null)."""
    return f"{column} IS NOT DISTINCT FROM ?"


def score_column(metric: str | None) -> tuple[str, str]:
    """The (key, header) of the score column, named after the run's metric."""
    return "score", f"score ({figures.metric_name(metric)})"


class Page:
    """Collects HTML and the figures it names, all under one folder."""

    def __init__(self, out: Path):
        self.out = out
        self.parts: list[str] = []
        self.files: list[str] = []
        self.scripts: list[str] = []  # the figures' data blocks, after the page's text
        self.late: list[str] = []  # the drill-downs' data blocks, after the script that draws the figures

    def add(self, text: str) -> None:
        self.parts.append(text)

    def figure(self, fig, name: str, alt: str) -> None:
        width, height = figures.save(fig, str(self.out / name))
        self.files.append(name)
        self.add(f'<img src="{html.escape(name)}" width="{width}" height="{height}" alt="{html.escape(alt)}">')

    def file(self, name: str, text: str) -> None:
        (self.out / name).write_text(text, encoding="utf-8")
        self.files.append(name)


def ablation_label(run: dict) -> str:
    """What a gated-off head left behind in ``run`` (a ``runs`` row), for titles: ``zero ablation``, ``mean
    ablation``... (a row written before the ``ablation`` column: zero, the only method then)."""
    return f"{run.get('ablation') or 'zero'} ablation"


@dataclass
class ReportPart:
    """One model of one run, as a kind's report part sees it.

    ``run``: the run's ``runs`` row (baseline as ``summary`` gives it); ``checkpoint``: the model (None for a
    run of one model); ``order``: the attention types in model order; ``metric``: the run's metric;
    ``prefix``: the start of this model's figure file names; ``significance``: the run's significance config.
    """

    page: Page
    con: duckdb.DuckDBPyConnection
    run: dict
    checkpoint: str | None
    order: list[str]
    metric: str | None
    prefix: str
    significance: dict = field(default_factory=dict)

    @property
    def run_id(self) -> str:
        return self.run["run_id"]

    @property
    def ablation(self) -> str:
        """``mean ablation``: the run's ``sweep.ablation`` as report titles name it (runs before schema v9: zero)."""
        return ablation_label(self.run)

    def rows(self, sql: str, params: Sequence = ()) -> list[dict]:
        """The rows of any query over the store's tables and views."""
        return rows(self.con, sql, params)

    def of_model(self, name: str, order_by: str = "") -> list[dict]:
        """The rows of table or view ``name`` for this run and model (``order_by``: an SQL ORDER BY list)."""
        order = f" ORDER BY {order_by}" if order_by else ""
        return self.rows(f"SELECT * FROM {name} WHERE run_id = ? AND {same('checkpoint')}{order}",
                         [self.run_id, self.checkpoint])

    @cached_property
    def heads(self) -> list[dict]:
        """The ``heads`` view's rows of this model, in model order (shared by the parts that read them)."""
        return self.of_model("heads", "attention, layer, head")

    def table(self, table_rows: Sequence[dict], columns: Sequence[tuple[str, str]]) -> None:
        """Add an HTML table of ``table_rows`` with (key, header) ``columns``."""
        self.page.add(html_table(table_rows, columns))
