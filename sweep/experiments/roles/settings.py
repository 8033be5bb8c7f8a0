"""The ``roles`` config section (Voita et al. 2019): what each head attends to, and which role thresholds apply.

One definition: the config reader builds it, and the workers take it as it is (``worker.py``,
``headsweep.workers.attention.head_roles``, ``headsweep.workers.analyses.role_inputs``). Imports only
``headsweep.workers.attention.syntax`` (no torch), so the driver reads a config without loading a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from headsweep.errors import HeadsweepError
from headsweep.sweep.configuration.data_sections import DATA, FILE
from headsweep.workers.attention.syntax import ALIASES, RELATIONS
from headsweep.workers.core.setting_ranges import SHARE, check_ranges, ranged


@dataclass
class RolesSection:
    """The ``roles`` experiment (Voita et al. 2019): what each head attends to
    (``headsweep.workers.attention.head_roles``).

    ``data`` has the keys of the model kind's ``data`` section (default: the evaluation set).
    ``frequencies``: ``dictionary`` (a fairseq model's dictionary counts, the default for fairseq), a
    corpus file (one sentence a line), or null (other families: no rare-word statistics).
    ``parses``: a CoNLL-U file, one parse per evaluation example (syntactic heads); else ``parser: spacy``
    parses with the installed pipeline ``spacy_model``. ``relations`` give ``syntactic:<relation>`` roles when
    a head's accuracy beats the most-frequent-offset baseline by ``syntactic_margin`` over at least
    ``syntactic_min_instances`` instances.
    """

    data: dict | None = field(default=None, metadata={DATA: True})
    frequencies: str | None = field(default=None, metadata={FILE: True})
    offsets: list[int] = ranged(default_factory=lambda: [-1, 1], words="any whole number but 0")
    positional_threshold: float = ranged(0.9, within=SHARE)
    rare_top: int = ranged(500, at_least=1)
    rare_threshold: float = ranged(0.5, within=SHARE)
    rare_min_sentences: int = ranged(10, at_least=1)
    # Syntactic heads (headsweep.workers.attention.syntax): a CoNLL-U file aligned with the evaluation text, or parser:
    # spacy.
    parses: str | None = field(default=None, metadata={FILE: True})
    parser: str | None = None
    spacy_model: str = "en_core_web_sm"
    relations: list[str] = field(default_factory=lambda: list(RELATIONS))
    syntactic_margin: float = ranged(0.1, within=SHARE)
    syntactic_min_instances: int = ranged(10, at_least=1)
    # Attention sinks (causal attention): role attention_sink when this share of a head's attention goes to the
    # first position.
    sink_threshold: float = ranged(0.5, within=SHARE)

    @property
    def syntax(self) -> bool:
        """Whether syntactic statistics are asked for."""
        return bool(self.parses) or self.parser == "spacy"

    def check(self) -> None:
        if self.parser not in (None, "spacy"):
            raise HeadsweepError(f"roles.parser must be spacy (or unset), got {self.parser!r}")
        unknown = [r for r in self.relations if ALIASES.get(r, r) not in RELATIONS]
        if unknown or not self.relations:
            raise HeadsweepError(f"roles.relations: unknown relation {unknown[0] if unknown else '(none given)'!r}"
                                 f" (known: {', '.join(RELATIONS)}; dobj counts as obj)")
        self.relations = list(dict.fromkeys(ALIASES.get(r, r) for r in self.relations))
        check_ranges(self, "roles")
        if not self.offsets:
            raise HeadsweepError("roles.offsets must name at least one relative offset (e.g. [-1, 1])")
        if 0 in self.offsets or len(set(self.offsets)) != len(self.offsets):
            raise HeadsweepError(f"roles.offsets must be distinct non-zero relative offsets (e.g. [-1, 1]: the "
                                 f"previous and the next token), got {self.offsets}")
