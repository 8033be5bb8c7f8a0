"""Translation metrics through sacrebleu: each sentence's sufficient statistics of detokenised hypotheses against
the references, for the corpus score and the paired bootstrap (:mod:`headsweep.workers.core.metrics` rescores summed
rows as sacrebleu does).

``bleu``: sacrebleu's BLEU (13a tokenisation, exp smoothing, ``force=True``: hypotheses are detokenised text, and
sacrebleu's warning about tokenised input would only reach the log); ``chrf``: sacrebleu's chrF with its defaults
(character orders 1-6, no word n-grams, beta 2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from headsweep.errors import HeadsweepError
from headsweep.workers.core.metrics import BLEU, CHRF, Metric

#: The metrics a translation family scores with, by the name ``data.metric`` takes.
TRANSLATION_METRICS: dict[str, Metric] = {m.name: m for m in (BLEU, CHRF)}


def check_translation_metric(name: str, key: str = "data.metric") -> None:
    """Refuse, in one line, a metric name no translation scorer has."""
    if name not in TRANSLATION_METRICS:
        raise HeadsweepError(f"{key} must be one of {', '.join(TRANSLATION_METRICS)} (sacrebleu's corpus BLEU or "
                             f"chrF), got {name!r}")


@dataclass
class SentenceScorer:
    """A sacrebleu metric holding the references, and the headsweep metric that rescores its summed statistics."""

    metric: Metric
    sacrebleu: Any

    def sentence_stats(self, hypotheses: Sequence[str]) -> np.ndarray:
        """Per-sentence statistics (n, len(metric.stat_names)) of ``hypotheses``, in the references' order."""
        stats = np.asarray(self.sacrebleu._extract_corpus_statistics(list(hypotheses), None), dtype=np.float64)
        return stats.reshape(len(hypotheses), len(self.metric.stat_names))

    @property
    def signature(self) -> str:
        """sacrebleu's signature of the metric (what a paper quotes beside the score)."""
        return str(self.sacrebleu.get_signature())


def sentence_scorer(name: str, references: Sequence[str]) -> SentenceScorer:
    """The scorer of metric ``name`` (``bleu`` or ``chrf``) over one reference per sentence."""
    from sacrebleu.metrics import BLEU as SacreBLEU
    from sacrebleu.metrics import CHRF as SacreCHRF

    check_translation_metric(name)
    refs = [list(references)]
    scorer = SacreBLEU(force=True, references=refs) if name == "bleu" else SacreCHRF(references=refs)
    return SentenceScorer(TRANSLATION_METRICS[name], scorer)
