"""Per-kernel sm_90 resources without a GPU: every signature in the kernel modules' `sm90_signatures()` compiled to
PTX by Numba and linked to a cubin by nvJitLink, which reports registers, spill bytes, stack, shared and local
memory; with `nvdisasm` (pip: nvidia-cuda-nvdisasm, or on PATH) also the SASS instruction mix: FFMA, shared and
global loads, SEL (select chains: per-thread arrays indexed in loops that did not unroll), local loads and stores,
and the subroutine calls (64-bit integer division, slow-path float division). Reading this before spending GPU time
catches the code-generation problems that made a decode-attention rewrite 2-4x slower (docs/kernels.md).

    python bench/kernel_resources.py --out out/kernel_resources.json [--modules attention_decode,attention_decode_tiled]
        [--resources-of attention_decode] [--shard 0/2]

--resources-of links (and reports) only those modules' kernels, the others are compiled to PTX only; --shard I/N
takes every N-th signature from the I-th on, so N processes share the compiles (they are single-threaded). A
failed import or compile is listed under "failed" in the JSON (exit status 1) and the other signatures still run:
the test suite's sm_90 compile check (tests/expert_service/kernels/test_compile_sm90.py) is this tool.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import pkgutil
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SASS_OPS = ("FFMA", "LDS", "LDG", "LDGSTS", "STS", "STG", "SEL", "SHFL", "BAR", "MUFU", "LDL", "STL")


def nvdisasm_path() -> str | None:
    """nvdisasm on PATH, else the one an installed nvidia-cuda-nvdisasm wheel ships."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    for root in spec.submodule_search_locations if spec else []:
        for candidate in Path(root).glob("cu*/bin/nvdisasm"):
            return str(candidate)
    return None


def link_report(ptx: str, arch: str = "sm_90") -> tuple[dict, bytes]:
    """(resources from nvJitLink's log, cubin) of one kernel's PTX for sm_90 (sm_90a: wgmma kernels)."""
    from cuda.bindings import nvjitlink

    handle = nvjitlink.create(2, [f"-arch={arch}", "-verbose"])
    try:
        data = ptx.encode()
        nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), "kernel.ptx")
        nvjitlink.complete(handle)
        log = bytearray(nvjitlink.get_info_log_size(handle))
        nvjitlink.get_info_log(handle, log)
        cubin = bytearray(nvjitlink.get_linked_cubin_size(handle))
        nvjitlink.get_linked_cubin(handle, cubin)
    finally:
        nvjitlink.destroy(handle)
    text = log.decode(errors="replace")
    found = {
        "registers": re.findall(r"used (\d+) registers", text),
        "spill_store_bytes": re.findall(r"(\d+) bytes spill stores", text),
        "stack_bytes": re.findall(r"(\d+) bytes stack frame", text),
        "shared_bytes": re.findall(r"(\d+) bytes smem", text),
        "local_bytes": re.findall(r"(\d+) bytes lmem", text),
    }
    report = {k: int(v[-1]) for k, v in found.items() if v}
    # ptxas serialises every wgmma of a kernel that calls a subroutine (warning C7509): a silent 2-3x
    report["wgmma_serialized"] = int("C7509" in text)
    return report, bytes(cubin)


def sass_mix(cubin: bytes, nvdisasm: str) -> dict:
    """Instruction counts of the SASS (static: each instruction once, loops not multiplied) and call targets."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([nvdisasm, f.name], capture_output=True, text=True, check=True).stdout
    ops = collections.Counter(re.findall(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]+)", sass))
    return {
        "instructions": sum(ops.values()),
        **{op: ops.get(op, 0) for op in SASS_OPS},
        "calls": dict(collections.Counter(re.findall(r"CALL\.\S+ `\((\w+)\)", sass))),
    }


# global memory accesses in SASS: loads (LDG; LD generic; LDGSTS, cp.async), stores, atomics and reductions
GLOBAL_ACCESS = re.compile(r"^(LDG|LD|LDGSTS|STG|ST|ATOMG|ATOM|RED)(\.|$)")


def wait_order(cubin: bytes, nvdisasm: str) -> dict:
    """Where a kernel's global memory accesses sit around `griddepcontrol.wait` (ACQBULK) in its SASS (static
    order), as `load_order` counts them. A kernel that waits for a programmatic predecessor must have no access but
    weight streams before its wait and no other `.nc` load anywhere (kernels/programmatic.py)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([nvdisasm, f.name], capture_output=True, text=True, check=True).stdout
    ops = [m.group(1) for m in re.finditer(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9._]*)", sass)]
    return load_order(ops)


def load_order(ops: list[str]) -> dict:
    """wait_order's figures from a kernel's SASS opcodes in order. A weight stream is an `.nc` load that skips L1
    (`LDG...NA...CONSTANT`); a coherent load that skips L1 is not one. Also counted: `.nc` loads that are not
    weight streams anywhere in the kernel (`LDG...CONSTANT` without `.NA`), which a waiting variant must not have
    (ptxas may move them above the wait)."""
    waits = [i for i, op in enumerate(ops) if op.startswith("ACQBULK")]
    first = waits[0] if waits else len(ops)

    def stream(op: str) -> bool:
        return ".NA" in op and ".CONSTANT" in op

    early = [op for op in ops[:first] if GLOBAL_ACCESS.match(op) and not stream(op)]
    nc = [op for op in ops if op.startswith("LDG") and ".CONSTANT" in op and ".NA" not in op]
    return {
        "waits": len(waits),
        "accesses_before_wait": len(early),
        "early_accesses": sorted(set(early)),
        "nc_activation_loads": len(nc),
    }


def kernel_modules(names: list[str] | None):
    """(name, module or the import's exception) of each kernel module with sm90_signatures (default: all)."""
    import expert_service.kernels as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if names and info.name not in names:
            continue
        try:
            module = importlib.import_module(f"expert_service.kernels.{info.name}")
        except Exception as e:  # one broken module must not hide the others' results
            yield info.name, e
            continue
        if hasattr(module, "sm90_signatures"):
            yield info.name, module


def signatures(names: list[str] | None, failed: list[str]):
    """(module name, index, python function, signature, compile options) of every listed signature (a module lists
    (function, signature) or (function, signature, options for compile_ptx, e.g. launch_bounds)); import
    failures go to failed."""
    for name, module in kernel_modules(names):
        try:
            if isinstance(module, Exception):
                raise module
            listed = module.sm90_signatures()
        except Exception as e:
            failed.append(f"{name} (import / sm90_signatures): {type(e).__name__}: {e}")
            continue
        for index, (fn, sig, *options) in enumerate(listed):
            yield name, index, fn, sig, options[0] if options else {}


def resources(
    names: list[str] | None, resources_of: set[str] | None, shard: tuple[int, int] = (0, 1), nvdisasm: str | None = None
) -> tuple[list[dict], list[str]]:
    """(a row per compiled signature, failures): PTX for sm_90 by Numba, and for the modules in resources_of (None:
    all) the cubin's resources by nvJitLink and, with nvdisasm, its SASS mix."""
    from numba import cuda

    from expert_service.kernels import programmatic

    rows, failed = [], []
    for position, (name, index, fn, sig, options) in enumerate(signatures(names, failed)):
        if position % shard[1] != shard[0]:
            continue
        label = f"{name}.{fn.__name__}{tuple(str(a) for a in sig)}"
        options = dict(options)
        cc = options.pop("cc", (9, 0))  # (9, 0, "a"): kernels with sm_90a instructions (wgmma)
        try:
            ptx, _ = cuda.compile_ptx(fn, sig, cc=cc, **options)
        except Exception as e:
            failed.append(f"{label}: {type(e).__name__}: {e}")
            continue
        # local-memory traffic in the PTX: per-thread arrays that stayed on the stack (dynamic indices)
        row = {
            "module": name,
            "kernel": fn.__name__,
            "signature": index,
            "ptx_ld_local": len(re.findall(r"\bld\.local", ptx)),
            "ptx_st_local": len(re.findall(r"\bst\.local", ptx)),
        }
        waiting = fn in programmatic.waiting_functions()
        if waiting:
            row["waiting"] = True
        # waiting variants are linked and read whenever anything is (their load order is checked), not for an
        # explicitly empty resources_of
        if resources_of is None or name in resources_of or (waiting and resources_of):
            try:
                report, cubin = link_report(ptx, "sm_" + "".join(map(str, cc)))
                row.update(report)
                if nvdisasm:
                    row.update(sass_mix(cubin, nvdisasm))
                    if waiting:
                        row.update(wait_order(cubin, nvdisasm))
            except Exception as e:
                failed.append(f"{label} (link): {type(e).__name__}: {e}")
                continue
        rows.append(row)
        print_row(row)
    return rows, failed


def print_row(row: dict) -> None:
    mix = (
        (
            f"  instr {row['instructions']:5d} FFMA {row['FFMA']:4d} SEL {row['SEL']:4d} LDL {row['LDL']:3d} "
            f"calls {row['calls']}"
        )
        if "instructions" in row
        else ""
    )
    print(
        f"{row['module']:22s} {row['kernel'][:30]:30s} #{row['signature']}  regs {row.get('registers', '?'):>3}  "
        f"spill {row.get('spill_store_bytes', '?'):>4}  smem {row.get('shared_bytes', '?'):>6}  "
        f"ptx ld/st.local {row['ptx_ld_local']}/{row['ptx_st_local']}{mix}",
        flush=True,
    )


def parse_shard(text: str) -> tuple[int, int]:
    index, _, count = text.partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        raise argparse.ArgumentTypeError(f"--shard {text!r}: expected I/N with 0 <= I < N")
    return int(index), int(count)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="kernel_resources.json")
    parser.add_argument("--modules", help="comma-separated kernel modules (default: all with sm90_signatures)")
    parser.add_argument("--resources-of", help="comma-separated modules to link and report (default: all compiled)")
    parser.add_argument("--shard", type=parse_shard, default=(0, 1), help="I/N: every N-th signature from the I-th")
    args = parser.parse_args(argv)
    names = args.modules.split(",") if args.modules else None
    resources_of = set(args.resources_of.split(",")) if args.resources_of else None
    nvdisasm = nvdisasm_path()
    if nvdisasm is None:
        print("nvdisasm not found (pip install nvidia-cuda-nvdisasm): registers and memory only", file=sys.stderr)
    rows, failed = resources(names, resources_of, args.shard, nvdisasm)
    for line in failed:
        print("FAILED", line, flush=True)
    Path(args.out).write_text(json.dumps({"arch": "sm_90", "kernels": rows, "failed": failed}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
