"""Fixtures of the family contract suite: every test that takes ``case`` runs once per :data:`cases.CASES` entry, and a
test that also takes ``dtype`` once per entry and dtype the entry runs its exactness checks in (``FamilyCase.dtypes``).
"""

from __future__ import annotations

import pytest
import torch

from .cases import CASES, Built, FamilyCase


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``case`` over :data:`CASES` (with ``dtype``: over each case's dtypes too), session-scoped, so that pytest runs
    each family's tests together and builds its model once."""
    if "case" not in metafunc.fixturenames:
        return
    if "dtype" in metafunc.fixturenames:
        pairs = [(c, dtype) for c in CASES for dtype in c.dtypes]
        metafunc.parametrize(("case", "dtype"), pairs, ids=[f"{c.id}-{dtype}" for c, dtype in pairs],
                             indirect=["case"], scope="session")
    else:
        metafunc.parametrize("case", CASES, ids=[c.id for c in CASES], indirect=True, scope="session")


@pytest.fixture(scope="session")
def case(request) -> FamilyCase:
    """One model family (parametrised by :func:`pytest_generate_tests`)."""
    return request.param


@pytest.fixture(scope="session")
def built(case: FamilyCase, tmp_path_factory) -> Built:
    """The case's tiny model and data on disk, built once per session."""
    # One thread: tiny models run fastest so, and two threads thrash when other processes share the two cores.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return case.build(tmp_path_factory.mktemp(case.id))
    finally:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _known_failures(request) -> None:
    """A check the case declares a known failure of (``FamilyCase.known_failures``) runs as xfail(strict=True)."""
    if "case" in request.fixturenames:
        reason = request.getfixturevalue("case").known_failures.get(request.node.originalname)
        if reason:
            request.applymarker(pytest.mark.xfail(strict=True, reason=reason))
