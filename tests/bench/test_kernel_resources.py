"""bench/kernel_resources.py without compiling: the SASS parsing, and a failed compile reported without stopping the
others. The tool end to end (every signature compiled for sm_90, nvJitLink's report of attention_decode) is the
suite's sm_90 compile check, tests/expert_service/kernels/test_compile_sm90.py: compiling is slow, so once."""

import argparse

import pytest

from bench import kernel_resources


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


def test_failed_compile_is_listed_and_the_other_signatures_still_run(monkeypatch):
    """Every gather signature through resources() with Numba's compile replaced: one raises, the rest yield rows."""
    from numba import cuda

    from expert_service.kernels import gather

    listed = gather.sm90_signatures()
    assert len(listed) >= 2
    broken = listed[0]

    def compile_ptx(fn, sig, cc):
        assert cc == (9, 0)
        if fn is broken[0] and sig == broken[1]:  # a waiting variant may share its plain twin's signature
            raise TypeError("no such overload")
        return "ptx", None

    monkeypatch.setattr(cuda, "compile_ptx", compile_ptx, raising=False)
    rows, failed = kernel_resources.resources(["gather"], resources_of=set())
    assert [r["signature"] for r in rows] == list(range(1, len(listed)))
    assert (
        len(failed) == 1 and failed[0].startswith(f"gather.{broken[0].__name__}(") and "no such overload" in failed[0]
    )


def test_shards_split_the_signatures_between_them(monkeypatch):
    from numba import cuda

    monkeypatch.setattr(cuda, "compile_ptx", lambda fn, sig, cc: ("ptx", None), raising=False)
    whole = kernel_resources.resources(["gather", "kv_write"], set())[0]
    parts = [kernel_resources.resources(["gather", "kv_write"], set(), (i, 3))[0] for i in range(3)]
    assert sorted(map(str, whole)) == sorted(str(r) for part in parts for r in part) and all(parts)


@pytest.mark.parametrize("text", ["2/2", "1", "a/2", "-1/2"])
def test_bad_shard_is_refused_naming_it(text):
    with pytest.raises(argparse.ArgumentTypeError, match=f"--shard '{text}'"):
        kernel_resources.parse_shard(text)


@pytest.mark.parametrize(
    "ops, early, nc",
    [
        (["ULDC", "LDG.E.NA.128.CONSTANT", "ACQBULK", "LDG.E.128", "STG.E"], 0, 0),  # a weight stream ahead: fine
        (["LDG.E.NA.128", "ACQBULK", "LDG.E.128"], 1, 0),  # coherent, skipping L1: not a weight stream
        (["LDG.E.128", "ACQBULK"], 1, 0),  # an activation before the wait
        (["ACQBULK", "LDG.E.128.CONSTANT"], 0, 1),  # an .nc activation load anywhere: ptxas may hoist it
        (["LDGSTS.E.BYPASS.128", "ACQBULK"], 1, 0),  # cp.async before the wait
        (["ST.E", "ATOMG.E.ADD", "ACQBULK"], 2, 0),
    ],
)
def test_load_order_tells_weight_streams_from_other_accesses(ops, early, nc):
    order = kernel_resources.load_order(ops)
    assert (order["accesses_before_wait"], order["nc_activation_loads"], order["waits"]) == (early, nc, 1)
