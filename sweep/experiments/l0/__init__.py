"""The ``l0`` kind (Voita et al. 2019 sec. 6): the kind (``kind.py``), its settings (``settings.py``), its table and
pruning curve (``tables.py``), and its worker-side code: the Hard Concrete distribution (``hard_concrete.py``) and
the gates' training, one Ray Tune trial per lambda (``training.py``)."""

from headsweep.sweep.experiments.l0.kind import L0, l0_data

__all__ = ["L0", "l0_data"]
