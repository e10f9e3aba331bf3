"""Every kernel variant compiles to sm_90 PTX (no GPU needed): a subprocess without NUMBA_ENABLE_CUDASIM
imports each expert_service.kernels module that defines ``sm90_signatures()`` and runs
``numba.cuda.compile_ptx(fn, sig, cc=(9, 0))`` on each (python function, signature) it lists. The modules are
shared round-robin among one subprocess per CPU (up to 4): compiling is single-threaded and the slowest test."""
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
shard, shards = int(sys.argv[1]), int(sys.argv[2])
failed, count = [], 0
for index, info in enumerate(pkgutil.iter_modules(pkg.__path__)):
    if index % shards != shard:
        continue
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
sys.exit(1 if failed else 0)
"""


def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    shards = max(1, min(4, os.cpu_count() or 1))
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, str(i), str(shards)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(shards)]
    results = [p.communicate(timeout=600) + (p.returncode,) for p in procs]
    for out, err, code in results:
        assert code == 0, out[-4000:] + err[-4000:]
    counts = [out.split("compiled ")[1].split()[0].split("/") for out, _, _ in results]
    compiled, listed = sum(int(c) for c, _ in counts), sum(int(n) for _, n in counts)
    assert listed > 0 and compiled == listed, counts
