"""headsweep: which attention heads does a trained Transformer need?

The installed import names all live under ``headsweep``: ``headsweep.sweep`` (the driver: configs,
experiment kinds, scheduling, statistics, CLI), ``headsweep.workers`` (Ray actors, gates and the
model families) and ``headsweep.results`` (the results store and its views). This module offers
the few entry points a notebook needs; they import their machinery on first use, so
``import headsweep`` stays cheap.

>>> import headsweep
>>> store = headsweep.open_store("headsweep-store")
>>> store.view("heads").df()                       # a DuckDB relation -> pandas
>>> store.sql("SELECT * FROM pruning WHERE run_id = ?", ["RUN"]).fetchall()
>>> store.head("self:3:7", run="RUN")              # the examples masking one head changes most, as pandas
>>> run_id = headsweep.run("conf/classifier_single_head.yaml", ["sweep.workers=1"])
>>> model = headsweep.load_pruned("exported-model/")
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from headsweep.errors import HeadsweepError

__all__ = ["HeadsweepError", "Store", "load_pruned", "open_store", "run"]


class Store:
    """A results store opened for reading: every table and view as a DuckDB relation.

    Views are those of ``headsweep query`` (the tables plus ``deltas``, ``heads``, ``layers``,
    ``pruning``, ``summary``); see ``results/README.md`` for their columns.
    """

    def __init__(self, uri: str):
        from headsweep.results.query import connect
        from headsweep.results.store import ResultStore
        from headsweep.sweep.experiments import register_stored_kinds  # the kinds' tables and views

        self.uri = uri
        store = ResultStore(uri)
        register_stored_kinds(store)
        self.connection = connect(store)

    def sql(self, query: str, params: Sequence[Any] | None = None):
        """A DuckDB relation (or result) for ``query``; ``?`` placeholders take ``params``."""
        if params is None:
            return self.connection.sql(query)
        return self.connection.execute(query, list(params))

    def view(self, name: str):
        """The table or view ``name`` as a DuckDB relation (``.df()``, ``.arrow()``, ``.pl()``)."""
        return self.connection.view(name)

    def df(self, name: str):
        """The table or view ``name`` as a pandas DataFrame (needs pandas)."""
        return self.view(name).df()

    def head(self, name: str, run: str, checkpoint: str | None = None):
        """The report's drill-down as a pandas DataFrame: every example of head ``name``'s single-head ablation in
        ``run`` (``checkpoint``: which model, for a run over several), most harmed first (ties by example id), with
        ``example_id``, ``input`` (null for runs before results schema version 10), ``reference``,
        ``baseline_output``, ``output``, ``baseline_value`` and ``value`` (the example's own score: correct, sentence
        BLEU, window perplexity...), ``change`` (value - baseline_value) and ``harm`` (the change in the metric's
        direction, positive = worse). An unknown run or head raises :class:`HeadsweepError` naming it."""
        from headsweep.sweep.reporting.example_changes import head_examples

        return head_examples(self.connection, run, name, checkpoint).to_pandas()

    def attention(self, name: str, run: str, examples: int = 3, checkpoint: str | None = None):
        """Attention patterns of head ``name`` on the ``examples`` examples its removal harms most, from the run's
        model (loaded again on this machine, ``checkpoint``: which one, default the run's first): a list of dicts
        with ``head``, ``example_id``, ``queries`` and ``keys`` (token strings) and ``weights`` (a query x key
        array: the model's own attention weights, the first ``MAX_TOKENS`` tokens). See
        ``headsweep.sweep.reporting.attention_maps``."""
        from headsweep.sweep.reporting.attention_maps import head_patterns

        return head_patterns(self.connection, run, name, examples, checkpoint)

    def close(self) -> None:
        self.connection.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_store(uri: str = "headsweep-store") -> Store:
    """Open the results store at ``uri`` (a path or any pyarrow filesystem URI) for queries."""
    return Store(uri)


def load_pruned(path: str):
    """A transformers model exported by ``headsweep export`` with its heads physically removed.

    Classifiers, causal LMs and encoder-decoder models alike: each built-in model family is asked whether the
    folder is one it exports (``config.json`` names the architecture), and that family rebuilds it.
    """
    from headsweep.workers.families.registry import family_of_export

    return family_of_export(path).load_exported(path)


def run(config: str, overrides: Sequence[str] = (), store: str = "headsweep-store", address: str | None = None,
        show_progress: bool = True, new: bool = False, keep_workers: float | None = None) -> str:
    """Run the sweep of the YAML ``config`` (with ``key=value`` overrides) into ``store``; returns the run id.

    With no ``address`` the sweep runs on an embedded local Ray instance, as ``headsweep run`` does. As there, an
    unfinished run of the config is continued, and a complete one is not run again (its id is returned) unless
    ``new`` (``--new``). ``keep_workers`` (``--keep-workers``, seconds; default ``$HEADSWEEP_KEEP_WORKERS``): on a
    cluster (``address``), the workers stay warm that long for the next run with workers of the same shape.
    """
    from headsweep.results.store import ResultStore
    from headsweep.sweep.cluster.keep_time import keep_seconds
    from headsweep.sweep.configuration.config import check_data_files, load_config
    from headsweep.sweep.run.driver import Sweep

    keep_s = keep_seconds(keep_workers, address)
    cfg = load_config(config, list(overrides))
    check_data_files(cfg)
    return Sweep(cfg, ResultStore(store), address=address, show_progress=show_progress,
                 auto_resume=not new, keep_workers_s=keep_s).execute()
