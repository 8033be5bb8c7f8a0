"""``sweep.ablation: zero`` (the default, Michel et al. 2019): a gated-off head leaves nothing behind, ``c_h = 0``.

No values: the gate alone (``heads * gates``), the path every run before other methods existed took; with
``ablation.keep_first`` an empty fill that keeps position 0. Export removes the head's weights and folds nothing.
"""

from __future__ import annotations

from typing import Any

from headsweep.workers.ablation.method import AblationMethod
from headsweep.workers.core.head_fill import HeadFill


class Zero(AblationMethod):
    name = "zero"
    fold = "nothing"

    def worker_fill(self, spec: Any) -> HeadFill | None:
        return HeadFill(keep_first=True) if spec.keep_first else None  # no values: zero, position 0 kept

    def facts(self, spec: Any, means: Any) -> dict[str, Any]:
        # zero without keep_first records nothing: the runs made before ablation methods existed read the same
        return super().facts(spec, means) if spec.keep_first else {}


ZERO = Zero()
