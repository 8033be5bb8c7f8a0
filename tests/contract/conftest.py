"""Fixtures of the family contract suite: every test that takes ``case`` runs once per :data:`cases.CASES` entry."""

from __future__ import annotations

import pytest
import torch

from .cases import CASES, Built, FamilyCase


@pytest.fixture(scope="session", params=CASES, ids=[c.id for c in CASES])
def case(request) -> FamilyCase:
    """One model family (session-scoped, so pytest runs each family's tests together)."""
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
