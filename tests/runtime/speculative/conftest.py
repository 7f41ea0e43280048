"""Engine tests here draft as much as they are allowed: the policy's cut depends on the clock (its
own tests are in test_policy.py), and these tests count drafts."""

import pytest

from runtime.speculative import speculator


@pytest.fixture(autouse=True)
def draft_everything(request, monkeypatch):
    if request.module.__name__.endswith("test_policy"):
        return
    monkeypatch.setattr(speculator, "plan_drafts", lambda gains, *rest: [len(g) for g in gains])
