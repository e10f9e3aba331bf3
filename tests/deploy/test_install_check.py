"""deploy/install-check.sh: the image's install steps in a fresh venv (CPU variant). Slow (a full pip
install), so it runs only when asked: COLIBRI_TEST_INSTALL=1 pytest tests/deploy/test_install_check.py"""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.deploy.k8s import DEPLOY, find_tool


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.skipif(
    os.environ.get("COLIBRI_TEST_INSTALL") != "1",
    reason="a full pip install into a fresh venv (minutes): set COLIBRI_TEST_INSTALL=1 to run it",
)
def test_install_check_cpu():
    bash = find_tool("bash")
    assert bash, "install-check.sh needs bash"
    proc = subprocess.run([bash, str(DEPLOY / "install-check.sh"), "cpu"], capture_output=True, text=True, timeout=1750)
    assert proc.returncode == 0, f"install-check failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert "install-check: cpu install ok" in proc.stdout
