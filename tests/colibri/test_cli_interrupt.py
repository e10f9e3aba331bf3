"""Ctrl-C stops a `colibri` subcommand without a drain with exit 130 and one line, whenever it comes: during the
imports of the subcommand's module (they printed a KeyboardInterrupt traceback) as during its run."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from tests.helpers import serve_env


def interrupt_when_loaded(process: subprocess.Popen, library: str, timeout: float = 30.0) -> None:
    """SIGINT once `library` is mapped in the process: the imports that load it are under way."""
    deadline = time.monotonic() + timeout
    while True:
        with open(f"/proc/{process.pid}/maps") as f:
            if library in f.read():
                break
        assert process.poll() is None and time.monotonic() < deadline, f"{library} was never loaded"
        time.sleep(0.001)
    process.send_signal(signal.SIGINT)


def test_ctrl_c_while_the_subcommand_is_imported_is_one_line_and_130(tiny_model):
    # numpy comes with the subcommand's module (colibri.cli itself imports neither numpy nor numba), and numba
    # after it: the signal lands in the imports.
    command = [sys.executable, "-m", "colibri.cli", "complete", "--model", str(tiny_model), "--tokens", "1,2,3",
               "--max-new-tokens", "2000", "--ignore-eos"]  # fmt: skip
    process = subprocess.Popen(command, env=serve_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        interrupt_when_loaded(process, "_multiarray_umath")
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, err.decode()
    assert err.decode() == "colibri complete: interrupted\n"
    assert out == b""
