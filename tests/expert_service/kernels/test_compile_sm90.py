"""Every kernel variant compiles to sm_90 PTX (no GPU needed): a subprocess without NUMBA_ENABLE_CUDASIM
imports each expert_service.kernels module that defines ``sm90_signatures()`` and runs
``numba.cuda.compile_ptx(fn, sig, cc=(9, 0))`` on each (python function, signature) it lists."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = r"""
import importlib, pkgutil, sys
import numba.cuda
import expert_service.kernels as pkg
failed, count = [], 0
for info in pkgutil.iter_modules(pkg.__path__):
    try:
        module = importlib.import_module(f"expert_service.kernels.{info.name}")
        signatures = module.sm90_signatures() if hasattr(module, "sm90_signatures") else []
    except Exception as e:
        count += 1
        failed.append(f"{info.name} (import / sm90_signatures): {type(e).__name__}: {e}")
        continue
    for fn, sig in signatures:
        count += 1
        try:
            numba.cuda.compile_ptx(fn, sig, cc=(9, 0))
        except Exception as e:
            failed.append(f"{info.name}.{fn.__name__}{tuple(str(a) for a in sig)}: {type(e).__name__}: {e}")
print(f"compiled {count - len(failed)}/{count}")
for line in failed:
    print("FAILED", line)
sys.exit(1 if failed or count == 0 else 0)
"""


def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
