"""bench/kernel_resources.py without a GPU: nvJitLink's resource report of real kernels, and the SASS parsing."""
import json
import os
import subprocess
import sys
from pathlib import Path

from bench import kernel_resources

ROOT = Path(__file__).resolve().parents[2]


def test_reports_registers_and_memory_of_every_signature(tmp_path):
    """The tool end to end on one module, outside the simulator (as the sm_90 compile check runs)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    out = tmp_path / "resources.json"
    proc = subprocess.run([sys.executable, "bench/kernel_resources.py", "--modules", "attention_decode",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["kernels"]
    assert {r["kernel"] for r in rows} == {"attention_decode_kernel", "attention_decode_reduce_kernel"}
    for r in rows:
        assert 8 <= r["registers"] <= 255 and r["spill_store_bytes"] == 0 and r["local_bytes"] == 0, r


def test_sass_mix_counts_opcodes_and_call_targets(monkeypatch, tmp_path):
    sass = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/              @P0 FFMA R3, R4, R5, RZ ;
        /*0020*/                   FFMA R5, R0, R3, -1 ;
        /*0030*/             @!P1 SEL R2, RZ, 0x1, !P0 ;
        /*0040*/                   CALL.ABS.NOINC `(__cuda_sm20_div_s64) ;
        /*0050*/                   LDS.64 R10, [R10] ;
"""
    class Done:
        stdout = sass
    monkeypatch.setattr(kernel_resources.subprocess, "run", lambda *a, **k: Done())
    mix = kernel_resources.sass_mix(b"\x7fELF", "nvdisasm")
    assert mix["FFMA"] == 2 and mix["SEL"] == 1 and mix["LDS"] == 1 and mix["instructions"] == 6
    assert mix["calls"] == {"__cuda_sm20_div_s64": 1}
