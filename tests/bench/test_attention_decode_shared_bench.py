"""bench/attention_decode_shared.py end to end on a tiny case under the CUDA simulator, its graph timing replaced by
one launch: the kernels it times take the arguments it builds, and its outputs agree (the timing itself needs a
GPU)."""

import json

import bench.attention_decode_shared as bench


def test_the_bench_runs_every_kernel_on_one_tiny_case(monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "SHAPES", {"tiny": (4, 2)})
    monkeypatch.setattr(bench, "CASES", [(5, 64, 16)])
    monkeypatch.setattr(bench, "HEAD_DIM", 16)
    monkeypatch.setattr(bench, "BLOCK", 8)
    monkeypatch.setattr(bench, "MODEL_CONTEXT", 512)
    launched = []

    def one_launch(launch, stream, repeats):
        launch(0, stream)
        launched.append(launch.__name__)
        return 1e-6

    monkeypatch.setattr(bench, "graph_timed", one_launch)
    out = tmp_path / "shared.json"
    assert bench.main(["--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["cases"]
    assert launched == ["mma", "shared", "mma_distinct"]
    assert row["groups"] == 1 and row["shared_vs_mma_max_rel"] < 1e-2  # 2 heads a kv head: 8 to a group
