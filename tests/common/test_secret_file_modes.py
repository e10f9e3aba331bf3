"""A token file (or TLS key) every local user can read is served, with one warning naming it and its mode: a token
there lets any local process call as the router, and nothing said so."""

from __future__ import annotations

import logging

import pytest

from common.auth import TokenSet
from router_service import security
from router_service.config import RouterConfig


@pytest.mark.parametrize("mode, warned", [(0o644, True), (0o604, True), (0o640, False), (0o600, False)])
def test_a_token_file_others_can_read_is_warned_about(tmp_path, caplog, mode, warned):
    path = tmp_path / "token"
    path.write_text("secret\n")
    path.chmod(mode)
    with caplog.at_level(logging.WARNING, logger="colibri.auth"):
        assert TokenSet(str(path)).accepts(b"Bearer secret")
    expected = f"auth_token_file: {path} is readable by every user (mode 0{mode:o}); chmod o-r it"
    assert [r.getMessage() for r in caplog.records if r.name == "colibri.auth"] == ([expected] if warned else [])


def test_the_router_warns_of_its_worker_token_file_too(tmp_path, caplog):
    path = tmp_path / "worker-token"
    path.write_text("secret\n")
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="colibri.auth"):
        assert security.worker_token_source(RouterConfig(worker_token_file=str(path)))() == "secret"
    assert f"worker_token_file: {path} is readable by every user (mode 0644); chmod o-r it" in caplog.messages
