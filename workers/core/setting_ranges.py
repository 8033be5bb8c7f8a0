"""The range of every numeric config setting, declared on the dataclass field that holds it.

One declaration, three readers: the config reader checks each value against its field's range as it builds a
section (``headsweep.sweep.configuration.reader.from_dict``: before Ray or a model starts, so ``flush_every: 0`` or
``model.max_len_b: -1`` is one line, not a hang or a worker's assertion), the configuration reference states it
(``tests/project/test_docs.py`` checks that each numeric key's row in docs/configuration.md carries
:meth:`Range.text`), and a test checks that no numeric field lacks one. Checks that need several keys (``min_len``
against ``max_len_b``) stay with the sections that know both.

Lives in ``workers`` because the model families' sections (``workers/families/*/config.py``) declare ranges too, and
``workers`` never imports the driver.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from headsweep.errors import HeadsweepError

METADATA_KEY = "headsweep.range"
SEED_MAX = 2**63 - 1


def _number(x: float) -> str:
    """A bound or value as configs write it: ``1``, ``0.5``, ``1e-05``, ``2**63 - 1``."""
    if isinstance(x, int):
        return "2**63 - 1" if x == SEED_MAX else str(x)
    if math.isfinite(x) and x.is_integer() and abs(x) < 1e16:
        return str(int(x))
    return f"{x:g}"


@dataclass(frozen=True)
class Range:
    """The values a numeric setting takes: ``low`` / ``high`` bounds (None: unbounded), each inclusive unless
    ``low_open`` / ``high_open``. A list setting's range holds for each of its elements; null (an optional setting
    left unset) is always allowed.

    ``words`` replaces the generated wording (:meth:`text`) where the bounds alone do not say it; ``why`` follows the
    range in a refusal (what the number counts); ``fix`` follows the value (what to do instead).
    """

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    words: str | None = None
    why: str = ""
    fix: str = ""

    def contains(self, value: float) -> bool:
        """Whether ``value`` lies in the range (NaN never does)."""
        if isinstance(value, float) and math.isnan(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return not (self.high is not None and (value >= self.high if self.high_open else value > self.high))

    def text(self) -> str:
        """The range as the reference and the refusals write it: ``at least 1``, ``positive``, ``in (0, 1]``,
        ``from 0 to 64``, ``any number``."""
        if self.words:
            return self.words
        low, high = self.low, self.high
        if low is not None and high is not None:
            if not self.low_open and not self.high_open:
                return f"from {_number(low)} to {_number(high)}"
            return f"in {'(' if self.low_open else '['}{_number(low)}, {_number(high)}{')' if self.high_open else ']'}"
        if low is not None:
            if self.low_open:
                return "positive" if low == 0 else f"more than {_number(low)}"
            return f"at least {_number(low)}"
        if high is not None:
            return f"less than {_number(high)}" if self.high_open else f"at most {_number(high)}"
        return "any number"

    def refusal(self, key: str, value: Any, in_list: bool = False) -> str:
        """The one line refusing ``value`` for config key ``key`` (``in_list``: one element of a list setting)."""
        subject = f"each value of {key}" if in_list else key
        fix = f"; {self.fix}" if self.fix else ""
        return f"{subject} must be {self.text()}{self.why}, got {_number(value)}{fix}"


SEED = Range(0, SEED_MAX, words="a whole number from 0 to 2**63 - 1")
SHARE = Range(0, 1, low_open=True, words="a share in (0, 1]")  # of something: more than none, at most all
PROBABILITY = Range(0, 1, low_open=True, high_open=True)
MAX_EXAMPLES = Range(1, words="a positive integer", why=" (how many examples to keep, from the start)",
                     fix="leave it out to keep every example")


def ranged(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
           at_least: float | None = None, above: float | None = None, at_most: float | None = None,
           below: float | None = None, within: Range | None = None, words: str | None = None, why: str = "",
           fix: str = "") -> Any:
    """A dataclass field holding a number (or a list of numbers) in the range the keywords give: ``at_least`` /
    ``above`` the low bound (inclusive / exclusive), ``at_most`` / ``below`` the high one, or ``within`` a
    :class:`Range` made already (``SEED``, ``SHARE``, ``PROBABILITY``). No bound at all: any number, stated so."""
    if within is None:
        within = Range(low=at_least if above is None else above, high=at_most if below is None else below,
                       low_open=above is not None, high_open=below is not None, words=words, why=why, fix=fix)
    return dataclasses.field(default=default, default_factory=default_factory, metadata={METADATA_KEY: within})


def range_of(f: dataclasses.Field) -> Range | None:
    """The range declared on field ``f``, or None."""
    return f.metadata.get(METADATA_KEY)


def check_ranges(section: Any, where: str = "") -> None:
    """Refuse, in one line naming the key, the first field of dataclass ``section`` (config key prefix ``where``)
    whose value lies outside its declared range; list values element by element."""
    for f in dataclasses.fields(section):
        bounds = range_of(f)
        if bounds is None:
            continue
        value = getattr(section, f.name)
        key = f"{where}.{f.name}" if where else f.name
        in_list = isinstance(value, list)
        for item in value if in_list else [value]:
            if isinstance(item, int | float) and not isinstance(item, bool) and not bounds.contains(item):
                raise HeadsweepError(bounds.refusal(key, item, in_list))
