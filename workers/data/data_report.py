"""Suspicious evaluation data, counted and reported, never silently changed.

A family's reader finds what is odd in the data it read (empty texts, repeated inputs, examples
cut to the length limit...); :func:`report` turns the findings into facts for the run's
``runs.facts`` (one count per kind, zero included, so that queries can rely on the keys) and, when
anything was found, one warning line under ``facts["warnings"]`` that the driver prints once.
:func:`unknown_tokens` does the same for the share of tokens the model's tokenizer or dictionary
cannot read, and :func:`merge` puts several reports into one dict of facts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

WARNINGS_KEY = "warnings"
SHOWN_IDS = 5  # example ids named in the warning line per kind (the counts are complete)
# Above this share of unknown tokens the data are probably not what the model was trained on (another
# language or script, another model's tokenizer): every family warns.
UNKNOWN_SHARE_WARN = 0.10


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


def unknown_tokens(subject: str, unknown: int, total: int, token: str | None) -> dict[str, Any]:
    """Facts ``unknown_tokens`` and ``unknown_token_share`` (of ``total`` tokens, ``unknown`` were the unknown
    token ``token``), and a ``warnings`` line when the share is above :data:`UNKNOWN_SHARE_WARN`."""
    share = unknown / total if total else 0.0
    facts: dict[str, Any] = {"unknown_tokens": unknown, "unknown_token_share": share}
    if share > UNKNOWN_SHARE_WARN:
        facts[WARNINGS_KEY] = [
            f"{subject}: {share:.1%} of its tokens ({unknown} of {total}) are unknown to the model's tokenizer "
            f"(read as {token}): the model does not see those words, and its scores say little about the data "
            "(another language or script, or another model's tokenizer?)"
        ]
    return facts


def merge(*parts: dict[str, Any]) -> dict[str, Any]:
    """Several reports' facts in one dict, every report's ``warnings`` lines kept, in order."""
    facts: dict[str, Any] = {}
    lines: list[str] = []
    for part in parts:
        facts.update(part)
        lines += part.get(WARNINGS_KEY, [])
    if lines:
        facts[WARNINGS_KEY] = lines
    return facts
