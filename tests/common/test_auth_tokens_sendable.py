"""Tokens the services accept or send must fit gRPC metadata (printable ASCII): one holding a newline, a control
character or a non-ASCII byte is refused at start-up in one line naming the file or variable, never the token.
A worker token with a newline inside used to fail every call to the worker (INTERNAL: Invalid metadata)."""

from __future__ import annotations

import secrets

import pytest

from common.auth import TokenSet
from common.errors import ConfigError
from expert_service.serving.main import worker_tokens
from router_service import security
from router_service.config import RouterConfig

BAD_BYTES = ["\n", "\t", "\x7f", "\x01", "é", "\u2028"]


def _token(bad: str) -> tuple[str, str]:
    """A fresh token with `bad` inside it (never at an end: whitespace there is stripped, as the services do)."""
    a, b = secrets.token_hex(6), secrets.token_hex(6)
    return a, f"{a}{bad}{b}"


def _refused(make, *names: str, secret: str) -> str:
    with pytest.raises(ConfigError) as e:
        make()
    message = str(e.value)
    assert "\n" not in message and all(name in message for name in names), message
    assert secret not in message, message
    return message


@pytest.mark.parametrize("bad", BAD_BYTES)
def test_a_fixed_token_gRPC_cannot_carry_is_refused_naming_its_variable(bad, monkeypatch):
    head, token = _token(bad)
    _refused(
        lambda: security.worker_token_source(RouterConfig(worker_token=token)), "COLIBRI_WORKER_TOKEN", secret=head
    )
    _refused(lambda: security.public_tokens(RouterConfig(auth_token=token)), "auth_token", secret=head)
    monkeypatch.setenv("COLIBRI_WORKER_TOKEN", token)
    _refused(lambda: worker_tokens(""), "COLIBRI_WORKER_TOKEN", secret=head)


@pytest.mark.parametrize("bad", [b for b in BAD_BYTES if b != "\n"] + ["\ufeff"])  # a newline parts file lines
def test_a_token_file_line_gRPC_cannot_carry_is_refused_naming_the_file(bad, tmp_path):
    head, token = _token(bad)
    path = tmp_path / f"tokens-{secrets.token_hex(3)}"
    path.write_text(f"# rotation\n{secrets.token_hex(8)}\n{token}\n", encoding="utf-8")
    _refused(lambda: security.worker_token_source(RouterConfig(worker_token_file=str(path))), str(path), secret=head)
    _refused(lambda: security.public_tokens(RouterConfig(auth_token_file=str(path))), str(path), secret=head)
    _refused(lambda: worker_tokens(str(path)), str(path), secret=head)


def test_sendable_tokens_still_work_and_the_fixed_one_is_stripped(tmp_path):
    token = secrets.token_urlsafe(16)
    assert security.worker_token_source(RouterConfig(worker_token=f"{token}\n"))() == token
    path = tmp_path / "tokens"
    path.write_text(f"\ufeff# comment\n{token}\n")  # a byte-order mark on a comment line is harmless
    assert security.worker_token_source(RouterConfig(worker_token_file=str(path)))() == token
    tokens = TokenSet(str(path), f" {secrets.token_hex(4)} ")
    assert tokens.accepts(f"Bearer {token}")


def test_a_rotated_token_file_with_an_unsendable_token_keeps_the_previous_tokens(tmp_path, monkeypatch):
    from common import auth

    path = tmp_path / "tokens"
    old = secrets.token_hex(8)
    path.write_text(f"{old}\n")
    tokens = TokenSet(str(path))
    path.write_text(f"{secrets.token_hex(4)}\x00{secrets.token_hex(4)}\n")
    monkeypatch.setattr(auth, "RECHECK_S", 0.0)
    assert tokens.accepts(f"Bearer {old}")
