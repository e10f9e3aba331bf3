"""serve's worker socket lies in a private directory under TMPDIR: one so long that the socket's path passes what
a Unix socket address holds is refused before either process starts, naming TMPDIR and --worker-port."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import serve_env


def test_a_tmpdir_too_long_for_the_worker_socket_is_refused_before_starting(tmp_path, tiny_model):
    """The worker failed to bind 'unix:/.../worker.sock cannot be bound' (exit 7) with no word of why, and the
    path it named was one serve had chosen, not the operator."""
    tmpdir = tmp_path / ("t" * max(1, 100 - len(str(tmp_path))))
    tmpdir.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "colibri.cli", "serve", "--model", str(tiny_model), "--port", "0", "--metrics-port",
         "0", "--worker-metrics-port", "0"],
        env={**serve_env(), "TMPDIR": str(tmpdir)},
        capture_output=True,
        timeout=120,
    )  # fmt: skip
    lines = done.stderr.decode().splitlines()
    assert done.returncode == 2, lines[-5:]
    assert len(lines) == 1 and lines[0].startswith(f"colibri serve: error: the worker's socket {tmpdir}/"), lines
    assert lines[0].endswith(
        "; a Unix socket path holds at most 107: set TMPDIR to a shorter directory, or give --worker-port"
    ), lines
    assert not list(tmpdir.iterdir())  # its private directory removed
