"""The on-disk kernel cache (COLIBRI_KERNEL_CACHE): every kernel goes through it, its folder follows the kernel
sources, an unusable folder costs only the compile time; on the GPU a second process compiles nothing."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from expert_service.kernels import jit_cache

REPO = Path(__file__).resolve().parents[3]
KERNELS = REPO / "expert_service" / "kernels"


def _is_cuda_jit(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "jit" and getattr(node.value, "id", None) == "cuda"


def _device_function(call: ast.Call) -> bool:
    return any(k.arg == "device" and getattr(k.value, "value", False) is True for k in call.keywords)


def test_every_kernel_compiles_through_cached_jit():
    """A kernel built with plain cuda.jit would compile in every process even with the cache set."""
    plain = []
    for path in sorted(KERNELS.glob("*.py")):
        if path.name == "jit_cache.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and _is_cuda_jit(node.func) and not _device_function(node):
                plain.append(f"{path.name}:{node.lineno}")
            if isinstance(node, ast.FunctionDef):
                plain += [f"{path.name}:{d.lineno}" for d in node.decorator_list if _is_cuda_jit(d)]
    assert not plain, f"kernels compiled with cuda.jit instead of cached_jit: {plain}"


def test_the_cache_folder_changes_with_any_kernel_source(tmp_path):
    copy = tmp_path / "kernels"
    shutil.copytree(KERNELS, copy, ignore=shutil.ignore_patterns("__pycache__"))
    before = jit_cache.source_digest(copy)
    assert before == jit_cache.source_digest(KERNELS)
    helper = copy / "numeric.py"  # a module of device functions only: no kernel of its own
    helper.write_text(helper.read_text() + "\n# edited\n")
    assert jit_cache.source_digest(copy) != before


def _cache_dir_in_a_fresh_process(env_value: str | None) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if k not in (jit_cache.CACHE_ENV, "NUMBA_CACHE_DIR")}
    env["NUMBA_ENABLE_CUDASIM"] = "0"
    if env_value is not None:
        env[jit_cache.CACHE_ENV] = env_value
    code = (
        "import json; from numba.cuda.core import config; from expert_service.kernels import jit_cache as j; "
        "print(json.dumps({'dir': str(j.CACHE_DIR) if j.CACHE_DIR else None, 'numba': config.CACHE_DIR, "
        "'digest': j.source_digest()}))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1]), done.stderr


def test_a_set_cache_points_numba_at_the_digest_folder(tmp_path):
    got, stderr = _cache_dir_in_a_fresh_process(str(tmp_path / "cache"))
    want = tmp_path / "cache" / got["digest"]
    assert got["dir"] == str(want) and got["numba"] == str(want) and want.is_dir()
    assert "WARNING" not in stderr.upper()


def test_unset_means_no_cache():
    got, _ = _cache_dir_in_a_fresh_process(None)
    assert got["dir"] is None and not got["numba"]


def test_an_unwritable_cache_warns_in_one_line_and_compiles_without(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    got, stderr = _cache_dir_in_a_fresh_process(str(blocker / "cache"))
    assert got["dir"] is None and not got["numba"]
    lines = [line for line in stderr.splitlines() if jit_cache.CACHE_ENV in line]
    assert len(lines) == 1 and "not writable" in lines[0] and "Traceback" not in stderr


CACHE_KEYS = """
import hashlib, importlib, json, pkgutil
import numpy as np
from numba.cuda.serialize import dumps
import expert_service.kernels as kernels
from expert_service.kernels import jit_cache
built = []
jit_cache.cached_jit = lambda kernel: built.append(kernel) or jit_cache.pin_closure_ids(kernel) or kernel
for module in pkgutil.iter_modules(kernels.__path__):
    importlib.import_module("expert_service.kernels." + module.name)
from expert_service.kernels import gemv, moe_ffn
gemv._build(np.dtype(np.uint16), True, 2, True)
moe_ffn._kernel(np.dtype(np.uint16), True, True)
# what Numba hashes into a cached kernel's key besides its bytecode: the pickled closure
print(json.dumps({k.__module__ + "." + k.__qualname__: hashlib.sha256(dumps(tuple(
    c.cell_contents for c in k.__closure__ or ()))).hexdigest() for k in built}))
"""


def test_cache_keys_are_the_same_in_every_process():
    """A factory-built kernel's closure holds device functions (and they intrinsics) whose pickles carry a
    per-process id unless pinned: two processes must agree on every key, or a restarted worker recompiles."""

    def keys() -> dict:
        env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
        done = subprocess.run(
            [sys.executable, "-c", CACHE_KEYS], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.splitlines()[-1])

    first, second = keys(), keys()
    assert "expert_service.kernels.gemv._build.<locals>.gemv_kernel" in first and len(first) >= 15
    assert first == second, [k for k in first if first[k] != second.get(k)]


LAUNCH_BOUNDS_KEYS = """
import json
from types import SimpleNamespace
from expert_service.kernels import jit_cache

def kernel(a):
    a[0] = 1

codegen = SimpleNamespace(magic_tuple=lambda: ("sm_90",))  # what a real codegen adds, without a driver
keys = [jit_cache.cached_jit(kernel, launch_bounds=b)._cache._index_key("(float32[::1],)", codegen)
        for b in ((128, 4), (128, 2), (128, 4))]
print(json.dumps([repr(k) for k in keys]))
"""


def test_launch_bounds_are_part_of_a_cached_kernels_key(tmp_path):
    """One kernel jitted for two launch bounds gets two cache keys (Numba's own key ignores them, so one would
    load the other's code); the same bounds give the same key."""
    script = tmp_path / "keys.py"  # Numba caches only kernels defined in a file
    script.write_text(LAUNCH_BOUNDS_KEYS)
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", PYTHONPATH=str(REPO), **{jit_cache.CACHE_ENV: str(tmp_path / "c")})
    done = subprocess.run([sys.executable, str(script)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    four, two, four_again = json.loads(done.stdout.splitlines()[-1])
    assert four != two and four == four_again and "(128, 4)" in four


def test_variants_saved_at_once_by_two_processes_each_keep_their_own_code(tmp_path):
    """Two processes save two variants of one kernel from index snapshots taken before either wrote (two workers
    compiling at once into one cache folder), their data files landing in either order: every entry the index
    ends with loads its own variant's code in a third process. (Numba's own numbering gave both variants data
    file 1, so the index could name one variant's entry with the other's code.)"""
    from numba.cuda.core.caching import IndexDataCacheFile

    keys, code = [("sig", "closure a"), ("sig", "closure b")], [b"code of a", b"code of b"]
    for order in ((0, 1), (1, 0)):
        folder = tmp_path / f"order{order[0]}"
        folder.mkdir()
        files = [IndexDataCacheFile(str(folder), "kernel-7.py311", "stamp") for _ in keys]
        writes = []
        for f in files:
            jit_cache.name_data_by_key(f)
            f._load_index = lambda: {}  # the snapshot from before either process wrote
            f._save_data = lambda name, data, f=f, writes=writes: writes.append(
                (f, name, data)
            )  # held back, landed below
        for f, key, data in zip(files, keys, code):
            f.save(key, data)
        for i in order:
            f, name, data = writes[i]
            IndexDataCacheFile._save_data(f, name, data)
        later = IndexDataCacheFile(str(folder), "kernel-7.py311", "stamp")
        jit_cache.name_data_by_key(later)
        loaded = {key: later.load(key) for key in keys}
        assert any(v is not None for v in loaded.values()), "the index kept no entry"
        for (key, got), want in zip(loaded.items(), code):
            assert got in (None, want), f"{key} loads another variant's code"
        assert len({name for _, name, _ in writes}) == 2, "two variants share a data file"


def test_variants_saved_one_after_another_all_stay_loadable(tmp_path):
    """Saves through the real index: every variant saved keeps its entry (the index is read again before each
    rewrite) and loads its own code, in the same process and in a later one; a data file holding another key's
    code is refused rather than loaded."""
    from numba.cuda.core.caching import IndexDataCacheFile

    def cache_file():
        f = IndexDataCacheFile(str(tmp_path), "kernel-7.py311", "stamp")
        jit_cache.name_data_by_key(f)
        return f

    first, second = cache_file(), cache_file()
    variants = {("sig", f"closure {i}"): f"code {i}".encode() for i in range(3)}
    for i, (key, code) in enumerate(variants.items()):
        (first if i % 2 else second).save(key, code)
    later = cache_file()
    for key, code in variants.items():
        assert first.load(key) == code and later.load(key) == code, key
    (a, _), (b, _) = list(variants.items())[:2]
    index = later._load_index()
    later._save_data(index[a], (b, variants[b]))  # a's file now holds b's code, as a digest collision would
    assert later.load(a) is None and later.load(b) == variants[b]


WARM_UP = """
import json, sys, time
from common.model_format import ModelDir
from expert_service.engine.config import EngineConfig
from expert_service.backends import build_engine
engine = build_engine(ModelDir.open(sys.argv[1]), EngineConfig(backend="cuda", kv_block_size=8, kv_cache_tokens=1024,
                                                         max_batch_tokens=128, max_batch_size=4))
started = time.monotonic()
engine.warmup()
ids = engine.generate([5, 9, 11], 4)[0]
print(json.dumps({"warmup_s": time.monotonic() - started, "ids": list(map(int, ids))}))
"""


@pytest.mark.gpu
def test_a_second_process_loads_every_kernel_from_the_cache(tmp_path):
    """Two processes warm up the same model with one cache folder: the first writes it, the second adds and
    rewrites nothing (every kernel it launched was found) and generates the same tokens."""
    from expert_service.tools.tiny_model import make_tiny

    model = make_tiny(tmp_path / "m", family="qwen3_moe", seed=4, progress=False)
    env = dict(os.environ, **{jit_cache.CACHE_ENV: str(tmp_path / "cache")})

    def warm_up() -> dict:
        done = subprocess.run(
            [sys.executable, "-c", WARM_UP, str(model)], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.splitlines()[-1])

    def files() -> dict:
        return {p: p.stat().st_mtime_ns for p in (tmp_path / "cache").rglob("*") if p.is_file()}

    first = warm_up()
    written = files()
    assert any(p.suffix == ".nbi" for p in written) and any(p.suffix == ".nbc" for p in written)
    second = warm_up()
    assert files() == written, "the second process compiled kernels the first had cached"
    assert second["ids"] == first["ids"]
