"""Every kernel variant compiles to sm_90 PTX (no GPU needed), and the decode-attention and 8-bit expert kernels'
sm_90 resources stay in bounds: bench/kernel_resources.py, outside the simulator, compiles every (python function,
signature) that the expert_service.kernels modules list in ``sm90_signatures()`` and links attention_decode's and
moe_q8's with nvJitLink. moe_q8 and moe_q8_dp4a(_grouped) stream weights from registers: local memory in its PTX (a per-thread array
indexed at run time) or spills would put its inner loop on the stack, so both must stay at zero. The warpgroup-MMA
kernels (linked for sm_90a) must keep their wgmma's unserialised (no subroutine call in the kernel) and unspilled. This is the suite's only sm_90 compile (compiling is its slowest work): the signatures are shared
among one subprocess per CPU (up to 4), and one test checks both what compiles and what it costs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
LINKED = "attention_decode"
STREAMED = ("moe_q8", "moe_q8_dp4a", "moe_q8_dp4a_grouped")
WGMMA = ("moe_gemm_wgmma", "moe_gemm_q8wgmma", "moe_gemm_w8a8")  # sm_90a: their warpgroup MMAs must not be serialised
PREFETCH = "l2_prefetch"  # inline cp.async.bulk.prefetch: linked, so ptxas reads the instruction
# the modules with kernels that wait for a programmatic predecessor: a one-token decode step's whole chain
WAITING = (
    "attention_decode",
    "attention_decode_tiled",
    "embedding",
    "gate_fused",
    "gather",
    "gemv",
    "greedy_split",
    "moe_combine",
    "moe_q8",
    "qk_norm_rope_kv_write",
    "rmsnorm",
    "rope_kv_write",
)
# W8A8's 128-register gate|up epilogue (int32 sums widened, two scales a sum) spills a few words once per tile, after
# the main loop; more than this would reach the loop
W8A8_EPILOGUE_SPILL_BYTES = 32


@pytest.mark.slow  # about two minutes of compiles: started first
@pytest.mark.timeout(1500)  # a loaded 2-core machine took over 600 s: the compiles are slow, never stuck
def test_every_kernel_compiles_for_sm90_and_decode_attention_fits(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    shards = max(1, min(4, os.cpu_count() or 1))
    outs = [tmp_path / f"shard{i}.json" for i in range(shards)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "bench/kernel_resources.py",
                "--resources-of",
                ",".join((LINKED, *STREAMED, *WGMMA, PREFETCH)),
                "--shard",
                f"{i}/{shards}",
                "--out",
                str(out),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i, out in enumerate(outs)
    ]
    results = [p.communicate(timeout=1400) + (p.returncode,) for p in procs]
    reports = [json.loads(out.read_text()) if out.exists() else None for out in outs]
    failed = sorted({line for report in reports if report for line in report["failed"]})
    for (stdout, stderr, code), report in zip(results, reports):
        assert report is not None and code == (1 if report["failed"] else 0), stdout[-4000:] + stderr[-4000:]
    assert not failed, "\n".join(failed)
    rows = [row for report in reports for row in report["kernels"]]
    assert rows and len({(r["module"], r["kernel"], r["signature"]) for r in rows}) == len(rows)

    linked = [r for r in rows if r["module"] == LINKED]
    assert {r["kernel"] for r in linked} == {"attention_decode_kernel", "attention_decode_reduce_kernel"}
    for r in linked:
        assert 8 <= r["registers"] <= 255 and r["spill_store_bytes"] == 0 and r["local_bytes"] == 0, r
    streamed = [r for r in rows if r["module"] in STREAMED]
    assert len(streamed) >= 13
    for r in streamed:
        assert r["ptx_ld_local"] == 0 and r["ptx_st_local"] == 0, r
        assert 32 <= r["registers"] <= 255 and r["spill_store_bytes"] == 0 and r["stack_bytes"] == 0, r
    wgmma = [r for r in rows if r["module"] in WGMMA]
    assert len(wgmma) >= 8
    for r in wgmma:  # no subroutine call (IEEE division, 64-bit division by a run-time value): ptxas warning C7509
        w8a8 = r["module"] == "moe_gemm_w8a8"  # its block-scaled tiles are 256-thread blocks: up to 255 registers
        spill, registers = (W8A8_EPILOGUE_SPILL_BYTES, 255) if w8a8 else (0, 168)
        assert r["wgmma_serialized"] == 0 and r["spill_store_bytes"] <= spill and r["registers"] <= registers, r
    prefetch = [r for r in rows if r["module"] == PREFETCH]
    assert len(prefetch) == 1 and prefetch[0]["spill_store_bytes"] == 0 and prefetch[0]["local_bytes"] == 0, prefetch
    # the waiting variants (kernels/programmatic.py) are linked and read: each waits, and nothing but a weight
    # stream touches global memory before it
    waiting = [r for r in rows if r.get("waiting")]
    assert {r["module"] for r in waiting} == set(WAITING), sorted({r["module"] for r in waiting})
    for r in waiting:
        assert r["waits"] >= 1 and r["accesses_before_wait"] == 0 and r["nc_activation_loads"] == 0, r
        assert r["spill_store_bytes"] == 0, r
    others = (LINKED, *STREAMED, *WGMMA, PREFETCH)
    assert not any("registers" in r for r in rows if r["module"] not in others and not r.get("waiting"))
