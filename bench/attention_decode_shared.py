"""Decode attention over a prompt prefix the batch shares -- attention_decode_shared (`shared`: the prefix's KV read
once per group of sequences) against attention_decode_mma (`mma`, the shipped kernel) on the same block tables, in
one run (GPU).

The batch is what a served shared-prefix workload decodes: S sequences whose block tables start with the same
blocks (the prefix cache hands every request of a system prompt the same ones), each followed by its own turn and
generated keys. `mma` reads the prefix's blocks once per sequence (from L2 after the first, when they fit) and
`shared` once per group; `mma_distinct` is `mma` on tables of the same lengths whose prefixes are copies in
blocks of their own (no reuse through L2: what caching off decodes over). Shapes: mixtral (H=32, Hkv=8: groups of 4) and qwen3moe (H=32, Hkv=4: pairs) at head size
128, 16-token blocks; split counts as the decoder takes them (decode_splits of the largest batch, 64, for `mma`;
workspace.shared_split_count for the prefix). Times are GPU time per launch sequence (graph replay); the roofline
is the unique K/V bytes (the prefix once, every sequence's own keys) / this GPU's streaming HBM read rate
(bench/hbm_rate.py, measured at the start of the run; --hbm-bytes-per-s to override). Both outputs are checked
against each other.

    python bench/attention_decode_shared.py --out out/attention_decode_shared.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import hbm_rate  # noqa: E402
from bench.kernels import graph_timed  # noqa: E402

SHAPES = {"mixtral-shape": (32, 8), "qwen3moe-shape": (32, 4)}
CASES = [(16, 2048, 128), (16, 512, 128), (64, 1024, 128), (4, 2048, 64)]  # (sequences, prefix keys, own keys at most)
HEAD_DIM, BLOCK, MODEL_CONTEXT, MAX_SEQS, REPEATS = 128, 16, 32768, 64, 50


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="attention_decode_shared.json")
    hbm_rate.add_argument(parser)
    args = parser.parse_args(argv)
    from numba import cuda

    from expert_service.cuda.shared_prefix import find_shared_prefixes
    from expert_service.cuda.workspace import shared_split_count
    from expert_service.kernels.attention_decode import decode_splits
    from expert_service.kernels.attention_decode_mma import launch_attention_decode_mma
    from expert_service.kernels.attention_decode_shared import launch_attention_decode_shared, max_members
    from tests.helpers import shared_cache

    roofline = hbm_rate.roofline(args.hbm_bytes_per_s)
    print(roofline.summary(), flush=True)
    stream = cuda.stream()
    rng = np.random.default_rng(0)
    results = []
    for shape, (H, Hkv) in SHAPES.items():
        for S, prefix, own_max in CASES:
            own = [int(n) for n in rng.integers(own_max // 2, own_max + 1, S)]
            k_pool, v_pool, tables, ctx, _ = shared_cache(rng, [("system", prefix)] * S, own, BLOCK, Hkv, HEAD_DIM)
            q = rng.standard_normal((S, H, HEAD_DIM), dtype=np.float32)
            members = max_members(H, Hkv)
            starts, groups = np.zeros(S, np.int32), np.zeros((S, members), np.int32)
            n_groups = find_shared_prefixes(tables, ctx, BLOCK, starts, groups)
            config = SimpleNamespace(num_key_value_heads=Hkv, max_position_embeddings=MODEL_CONTEXT)
            P, PS = decode_splits(MAX_SEQS, H, Hkv, MODEL_CONTEXT), shared_split_count(config, S, members)
            dev = [cuda.to_device(a, stream=stream) for a in (q, k_pool, v_pool, tables, ctx, ctx - 1)]
            copies = [(f"system{i}", prefix) for i in range(S)]  # the same lengths, every prefix in its own blocks
            k_own, v_own, own_tables, _, _ = shared_cache(rng, copies, own, BLOCK, Hkv, HEAD_DIM)
            distinct = [cuda.to_device(a, stream=stream) for a in (q, k_own, v_own, own_tables, ctx, ctx - 1)]
            groups_dev = [cuda.to_device(a, stream=stream) for a in (starts, groups)]

            def buffers(parts):
                return [cuda.device_array((S, H, parts, n), np.float32, stream=stream) for n in (HEAD_DIM, 2)]

            names = ("mma", "shared", "mma_distinct")
            outs = {name: cuda.device_array((S, H, HEAD_DIM), np.float32, stream=stream) for name in names}
            split, prefix_parts = buffers(P), buffers(PS)
            scale = HEAD_DIM**-0.5

            def mma(i, st):
                launch_attention_decode_mma(*dev, 0, scale, outs["mma"], *split, stream=st)

            def mma_distinct(i, st):
                launch_attention_decode_mma(*distinct, 0, scale, outs["mma_distinct"], *split, stream=st)

            def shared(i, st):
                launch_attention_decode_shared(
                    *dev, *groups_dev, 0, scale, outs["shared"], *split, *prefix_parts, stream=st
                )

            row = {"shape": shape, "sequences": S, "prefix": prefix, "own_keys": own_max, "groups": n_groups}
            row["splits"], row["shared_splits"] = P, PS
            row["mma_us"] = graph_timed(mma, stream, REPEATS) * 1e6
            row["shared_us"] = graph_timed(shared, stream, REPEATS) * 1e6
            row["mma_distinct_us"] = graph_timed(mma_distinct, stream, REPEATS) * 1e6
            unique = (prefix + sum(own)) * 2 * Hkv * HEAD_DIM * 2
            row["roofline_us"] = unique / roofline.bytes_per_s * 1e6
            got, want = outs["shared"].copy_to_host(), outs["mma"].copy_to_host()
            row["shared_vs_mma_max_rel"] = float(np.abs(got - want).max() / np.abs(want).max())
            row["shared_speedup"] = row["mma_us"] / row["shared_us"]
            results.append(row)
            print(
                f"{shape:15s} S={S:3d} prefix={prefix:5d} own<={own_max:4d} groups={n_groups:3d} P={P} PS={PS:3d}  "
                f"mma distinct {row['mma_distinct_us']:7.1f} us  mma {row['mma_us']:7.1f} us  shared {row['shared_us']:7.1f} us ({row['shared_speedup']:.2f}x)  "
                f"roofline of the unique bytes {row['roofline_us']:6.1f} us  diff {row['shared_vs_mma_max_rel']:.1e}",
                flush=True,
            )
            Path(args.out).write_text(json.dumps({**roofline.record(), "cases": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
