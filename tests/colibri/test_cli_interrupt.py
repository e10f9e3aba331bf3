"""Ctrl-C stops a `colibri` subcommand without a drain with exit 130 and one line, whenever it comes: during the
imports of the subcommand's module (they printed a KeyboardInterrupt traceback) as during its run."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from colibri import cli
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


FAKE_IMPORT = """
import os, signal, time
try:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)  # the handler runs here
except KeyboardInterrupt:  # as numpy's C import of datetime reports an interrupt landing in it
    raise ImportError('PyCapsule_Import could not import module "datetime"') from None
"""


@pytest.fixture
def interrupted_subcommand(tmp_path, monkeypatch):
    """A subcommand whose module's import is interrupted and reports it as an ImportError."""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    (tmp_path / "interrupted_import.py").write_text(FAKE_IMPORT)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.SUBCOMMANDS, "fake", ("interrupted_import", "a subcommand whose import is interrupted"))
    yield
    sys.modules.pop("interrupted_import", None)


def test_an_interrupt_an_import_turned_into_an_import_error_is_one_line_and_130(interrupted_subcommand, capsys):
    assert cli.main(["fake"]) == 130
    assert capsys.readouterr().err == "colibri fake: interrupted\n"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back


def test_an_import_error_without_an_interrupt_keeps_its_traceback(tmp_path, monkeypatch):
    (tmp_path / "broken_import.py").write_text("raise ImportError('a broken install')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.SUBCOMMANDS, "broken", ("broken_import", "a subcommand whose module does not import"))
    with pytest.raises(ImportError, match="a broken install"):
        cli.main(["broken"])
