"""A --socket path longer than a Unix socket address holds (107 bytes on Linux) is refused in one line naming it and
its length, rather than gRPC's bare 'cannot be bound'."""

from __future__ import annotations

import pytest

from common.errors import ConfigError
from expert_service.serving.endpoints import prepare_socket

LONGEST = 107  # sockaddr_un.sun_path on Linux: 108 bytes, its terminating NUL included


def _path_of(tmp_path, size: int) -> str:
    path = f"{tmp_path}/" + "s" * (size - len(str(tmp_path)) - 1)
    assert len(path) == size
    return path


def test_a_socket_path_too_long_is_a_config_error_naming_it(tmp_path):
    path = _path_of(tmp_path, LONGEST + 1)
    with pytest.raises(ConfigError) as error:
        prepare_socket(path, "worker gRPC")
    assert str(error.value) == (
        f"socket: {path} is {LONGEST + 1} bytes long; a Unix socket path holds at most {LONGEST}: use a shorter one"
    )


def test_a_socket_path_of_the_longest_length_is_taken(tmp_path):
    path = _path_of(tmp_path, LONGEST)
    assert str(prepare_socket(path, "worker gRPC")) == path


def test_the_length_counts_bytes_not_characters(tmp_path):
    path = _path_of(tmp_path, LONGEST)[:-1] + "é"  # 107 characters, 108 bytes
    with pytest.raises(ConfigError, match=f"is {LONGEST + 1} bytes long"):
        prepare_socket(path, "worker gRPC")
