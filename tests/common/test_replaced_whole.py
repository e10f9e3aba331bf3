"""common.files.replaced_whole (`colibri logits --out`): the new file takes the old one's permission bits (an
operator's 0600 file became 0644, readable by every local user), and a temporary file left by a killed run
(SIGKILL: no cleanup runs) is removed by the next run at that name, never one of a live process."""

from __future__ import annotations

import os
import random
import secrets
import stat
import subprocess
import sys

from common.files import replaced_whole


def test_the_replaced_file_keeps_its_permission_bits(tmp_path):
    path = tmp_path / f"out-{secrets.token_hex(3)}.npy"
    path.write_bytes(b"old")
    mode = random.choice([0o600, 0o640, 0o660, 0o604, 0o664])
    path.chmod(mode)
    data = secrets.token_bytes(64)
    with replaced_whole(path) as f:
        f.write(data)
    assert path.read_bytes() == data and stat.S_IMODE(path.stat().st_mode) == mode


def test_a_killed_runs_temporary_file_is_removed_by_the_next_run(tmp_path):
    path = tmp_path / f"out-{secrets.token_hex(3)}.npy"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, live = int(gone.stdout), os.getppid()
    stale, busy = tmp_path / f".{path.name}.{dead}.tmp", tmp_path / f".{path.name}.{live}.tmp"
    stale.write_bytes(secrets.token_bytes(32))
    busy.write_bytes(secrets.token_bytes(32))
    with replaced_whole(path) as f:
        f.write(b"new")
    assert path.read_bytes() == b"new"
    assert not stale.exists() and busy.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, busy.name])
