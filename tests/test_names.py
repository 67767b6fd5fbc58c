"""Names with one meaning (issue 38 point 4): the probe's image/text choice is ``kind=`` (``branch`` is the CFG
branch everywhere else); the old spelling still works, with a DeprecationWarning naming the new one."""

from __future__ import annotations

import pytest

import ipa_probe
from ipa_probe.capture.config import ProbeConfig


def test_branch_is_now_kind(sd15):
    with pytest.warns(DeprecationWarning, match="kind="):
        config = ProbeConfig(branch="text")
    assert config.kind == "text" and config.describe()["kind"] == "text"
    with pytest.warns(DeprecationWarning, match="kind="):
        with ipa_probe.probe(sd15, branch="both") as run:
            pass
    assert run.config.kind == "both"
    with pytest.raises(ValueError, match="^kind: expected"):
        ProbeConfig(kind="cond")
