"""fit_open_files raises the soft open-file limit as far as the hard one allows, and warns in one line naming the
settings when the caps still do not fit (descriptors would run out before the caps refused anything)."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import serve_env

SHORT = """
import logging, resource
from common.connection_limits import fit_open_files
logging.basicConfig(format="%(levelname)s %(message)s")
resource.setrlimit(resource.RLIMIT_NOFILE, (300, 400))
fit_open_files(1000, "grpc_max_connections")
print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


def test_a_hard_limit_under_the_caps_is_reached_and_named():
    done = subprocess.run([sys.executable, "-c", SHORT], env=serve_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["400"]
    assert done.stderr.splitlines() == [
        "WARNING the open-file limit (400) leaves room for about 144 connections, fewer than grpc_max_connections "
        "allow (1000): raise the limit (ulimit -n, or the container's nofile) or lower the setting"
    ]
