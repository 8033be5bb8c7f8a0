"""The ``roles`` kind (Voita et al. 2019): the kind (``kind.py``), its settings (``settings.py``), its table and view
(``tables.py``), its report part (``report.py``) and its worker step (``worker.py``). The statistics it computes are
``headsweep.workers.attention.head_roles`` and ``headsweep.workers.attention.syntax``; what it reads them from,
``headsweep.workers.analyses.role_inputs`` and each model family's attention reader."""

from headsweep.sweep.experiments.roles.kind import ROLES, roles_data

__all__ = ["ROLES", "roles_data"]
