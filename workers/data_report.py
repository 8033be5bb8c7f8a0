"""Suspicious evaluation data, counted and reported, never silently changed.

A family's reader finds what is odd in the data it read (empty texts, repeated inputs, examples
cut to the length limit...); :func:`report` turns the findings into facts for the run's
``runs.facts`` (one count per kind, zero included, so that queries can rely on the keys) and, when
anything was found, one warning line under ``facts["warnings"]`` that the driver prints once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

WARNINGS_KEY = "warnings"
SHOWN_IDS = 5  # example ids named in the warning line per kind (the counts are complete)


@dataclass
class Finding:
    """One kind of suspicious example: its ``runs.facts`` key, how the warning names it, and which examples."""

    key: str
    description: str
    ids: list[str] = field(default_factory=list)


def report(subject: str, findings: list[Finding]) -> dict[str, Any]:
    """Facts for ``runs.facts``: a count per finding, and ``warnings`` (one line) when any is non-zero."""
    facts: dict[str, Any] = {f.key: len(f.ids) for f in findings}
    found = [f for f in findings if f.ids]
    if found:
        parts = "; ".join(f"{f.description}: {len(f.ids)} ({_ids(f.ids)})" for f in found)
        facts[WARNINGS_KEY] = [f"{subject}: {parts} (counted in runs.facts)"]
    return facts


def _ids(ids: list[str]) -> str:
    shown = ", ".join(ids[:SHOWN_IDS])
    more = f" and {len(ids) - SHOWN_IDS} more" if len(ids) > SHOWN_IDS else ""
    return f"example id{'s' if len(ids) > 1 else ''} {shown}{more}"
