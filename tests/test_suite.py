"""The suite's own rules (tests/conftest.py): every test that reads a shared session fixture of real runs
runs in that fixture's group, on the xdist worker that builds the runs once."""
from __future__ import annotations

from tests.conftest import MISGROUPED


def test_every_reader_of_the_shared_runs_is_in_their_group(request):
    assert request.config.stash[MISGROUPED] == [], "\n".join(request.config.stash[MISGROUPED])
