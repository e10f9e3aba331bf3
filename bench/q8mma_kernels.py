"""The grouped 8-bit tensor-core kernels (Q8_MMA, kernels/moe_gemm_q8mma.py) alone: gate|up and down of one MoE
layer of random experts per named tile config, at a decode batch and a prefill size, in one run on one GPU:

  per (shape, expert dtype, tokens T, config): GPU microseconds of each launch (--iters launches captured in one
  CUDA graph, replayed between two events), the fraction of the HBM roofline of the weight bytes it reads once
  (the active experts' matrices; padding rows and re-reads of a weight tile by other row tiles are the kernel's
  cost; the roofline is this GPU's streaming read rate, measured at the start of the run by bench/hbm_rate.py,
  --hbm-bytes-per-s to override), and the TFLOP/s of the routed rows;
  with --previous FILE (an earlier moe_gemm_q8mma.py, e.g. `git show REV:expert_service/kernels/moe_gemm_q8mma.py`)
  the same launches of that version on the same buffers, its outputs compared with the current ones (max relative
  difference of y) and the ratio previous us / current us printed.

Routing is uniform random top-K (distinct experts a token); int8 experts take per-channel scales, fp8 128x128 block
scales (the checkpoints' usual forms); weights are random bytes (bench/q8_kernels.py random_layer).

    python bench/q8mma_kernels.py --out out/q8mma.json [--shapes mixtral-shape,qwen3moe-shape] [--dtypes int8,fp8]
                                  [--tokens 16,512] [--previous old_moe_gemm_q8mma.py]
                                  [--configs m16,m16s4=1/4/1/4/128/4]

`--shapes tiny --tokens 4 --iters 1` runs under NUMBA_ENABLE_CUDASIM=1 (the simulator's own small config only).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import hbm_rate  # noqa: E402
from bench.q8_kernels import SHAPES, random_layer, timed  # noqa: E402


def configs(module, spec: str | None = None) -> dict:
    """The configs to time: the module's named ones (under the simulator its small one: the named ones run for
    minutes there), or `spec`: comma-separated names of the module's configs and new shapes written
    NAME=WM/WN/MT/NT/BK/STAGES (e.g. m16s4=1/4/1/4/128/4), to try a tile before it becomes a named one."""
    from expert_service.kernels.moe_gemm_mma import Config
    from expert_service.kernels.numeric import SIMULATOR

    named = {"sim": module.SIM_CONFIG} if SIMULATOR else dict(module.CONFIGS)
    if not spec:
        return named
    out = {}
    for item in spec.split(","):
        name, _, shape = item.partition("=")
        if not shape:
            if name not in named:
                raise SystemExit(f"--configs: unknown config {name!r} (named: {', '.join(named)})")
            out[name] = named[name]
            continue
        try:
            wm, wn, mt, nt, bk, stages = (int(v) for v in shape.split("/"))
        except ValueError:
            raise SystemExit(f"--configs: {item!r} is not NAME=WM/WN/MT/NT/BK/STAGES") from None
        out[name] = Config(wm, wn, mt, nt, bk=bk, stages=stages)
    return out


class Layer:
    """One routed step's device buffers for a tile config: sorted rows, gathered bf16 x, h and y."""

    def __init__(self, ids, x, E: int, F: int, D: int, block_m: int):
        from numba import cuda

        from expert_service.kernels.moe_align import launch_moe_align, launch_moe_gather_bf16, max_tiles

        T, K = ids.shape
        tiles = max_tiles(T * K, E, block_m)
        self.sorted_ids, self.tile_expert, self.num_tiles, position = (
            cuda.device_array(n, np.int32) for n in (tiles * block_m, tiles, 1, T * K)
        )
        launch_moe_align(cuda.to_device(ids), E, block_m, self.sorted_ids, self.tile_expert, self.num_tiles, position)
        self.xs = cuda.device_array((tiles * block_m, D), np.uint16)
        launch_moe_gather_bf16(cuda.to_device(x), self.sorted_ids, self.num_tiles, K, block_m, self.xs)
        self.h = cuda.device_array((tiles * block_m, F), np.uint16)
        self.y = cuda.device_array((T * K, D), np.float32)

    def gate_up(self, module, W, meta, F: int, D: int, cfg, stream) -> None:
        module.launch_q8mma_gate_up(self.xs, self.tile_expert, self.num_tiles, W, meta, F, D, self.h, cfg, stream)

    def down(self, module, W, meta, F: int, D: int, cfg, stream) -> None:
        module.launch_q8mma_down(
            self.h, self.tile_expert, self.num_tiles, self.sorted_ids, W, meta, F, D, self.y, cfg, stream
        )


def time_config(module, layer: Layer, W, meta, F: int, D: int, cfg, iters: int, stream) -> tuple[float, float]:
    """(gate|up us, down us) of one version at one config."""
    gate_up = timed(lambda _i: layer.gate_up(module, W, meta, F, D, cfg, stream), iters, stream)
    down = timed(lambda _i: layer.down(module, W, meta, F, D, cfg, stream), iters, stream)
    return gate_up, down


def bench_case(
    shape: str, dtype: str, T: int, modules: dict, iters: int, rng, rate: float, spec: str | None = None
) -> list[dict]:
    from numba import cuda

    from expert_service.kernels import expert_quant as q

    D, F, E, K = SHAPES[shape]
    code, scheme = (q.CODE_INT8, q.SCALE_CHANNEL) if dtype == "int8" else (q.CODE_FP8, q.SCALE_BLOCK)
    blocks, meta, _ = random_layer(rng, code, scheme, E, F, D)
    W, dmeta = cuda.to_device(blocks), cuda.to_device(meta)
    del blocks
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32)
    x = rng.standard_normal((T, D)).astype(np.float32)
    active = len(np.unique(ids))
    weight_bytes = {"gate_up": active * 2 * F * D, "down": active * D * F}
    flops = 2 * T * K * 3 * F * D
    stream = cuda.stream()
    current = modules["current"]
    chosen = current.choose_config(T * K, E)
    rows = []
    for name, cfg in configs(current, spec).items():
        layer = Layer(ids, x, E, F, D, cfg.block_m)
        row: dict = {"shape": shape, "dtype": dtype, "tokens": T, "config": name, "chosen": cfg == chosen}
        outputs = {}
        for version, module in modules.items():
            gate_up, down = time_config(module, layer, W, dmeta, F, D, cfg, iters, stream)
            outputs[version] = layer.y.copy_to_host()
            row[version] = {
                "gate_up_us": gate_up,
                "down_us": down,
                "gate_up_roofline": weight_bytes["gate_up"] / (gate_up * 1e-6) / rate,
                "down_roofline": weight_bytes["down"] / (down * 1e-6) / rate,
                "tflop_s": flops / ((gate_up + down) * 1e-6) / 1e12,
            }
        line = (
            f"{shape:15s} {dtype:4s} T={T:5d} {name:4s}{'*' if row['chosen'] else ' '} "
            f"gate|up {row['current']['gate_up_us']:8.1f} us ({row['current']['gate_up_roofline']:5.1%})  "
            f"down {row['current']['down_us']:8.1f} us ({row['current']['down_roofline']:5.1%})  "
            f"{row['current']['tflop_s']:6.1f} TFLOP/s"
        )
        if "previous" in modules:
            before = row["previous"]["gate_up_us"] + row["previous"]["down_us"]
            row["previous_over_current"] = before / (row["current"]["gate_up_us"] + row["current"]["down_us"])
            ours, theirs = outputs["current"], outputs["previous"]
            row["max_rel_diff_y"] = float(np.abs(ours - theirs).max() / max(float(np.abs(theirs).max()), 1e-30))
            line += f"  x{row['previous_over_current']:.2f} previous (y diff {row['max_rel_diff_y']:.1e})"
        print(line, flush=True)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/q8mma_kernels.json")
    parser.add_argument("--shapes", default="mixtral-shape,qwen3moe-shape")
    parser.add_argument("--dtypes", default="int8,fp8")
    parser.add_argument("--tokens", default="16,512", help="tokens of the step (each routed to K experts)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--previous", help="an earlier moe_gemm_q8mma.py, timed on the same buffers")
    parser.add_argument("--configs", help="names and NAME=WM/WN/MT/NT/BK/STAGES shapes (default: the named ones)")
    hbm_rate.add_argument(parser)
    args = parser.parse_args(argv)

    from bench.kernels import load_module
    from expert_service.kernels import moe_gemm_q8mma

    roofline = hbm_rate.roofline(args.hbm_bytes_per_s)
    print(roofline.summary(), flush=True)
    modules = {"current": moe_gemm_q8mma}
    if args.previous:
        modules["previous"] = load_module(args.previous)
    rng = np.random.default_rng(0)
    cases = []
    for shape in args.shapes.split(","):
        for dtype in args.dtypes.split(","):
            for T in (int(t) for t in args.tokens.split(",")):
                cases += bench_case(shape, dtype, T, modules, args.iters, rng, roofline.bytes_per_s, args.configs)
    out = {"benchmark": "q8mma-kernels", **roofline.record(), "cases": cases}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}; {roofline.summary()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
