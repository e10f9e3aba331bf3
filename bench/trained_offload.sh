#!/usr/bin/env bash
# The static routing table and the expert cache on LEARNED routing at scale, in one GPU run (about 6 min on an H200).
#   train the `large` preset (321 M parameters, 32 experts, top-2) -> convert to bf16 -> colibri router-gen on
#   the training split -> the table's recall on the held-out books (bench/table_recall.py) -> int8 / fp8 experts'
#   quality against bf16 on the held-out books (bench/quant_quality.py) -> bench/offload.py
#   at 100 / 50 / 25 % of the experts resident, prefetch none / plan (table) / lookahead / both, each plan mode
#   also from the table's rank-1 predictions alone (--plan-top-k 1,2: runs keyed plan/top1) and from its confident
#   predictions alone (--plan-min-share 0.3,0.5: runs keyed plan/share0.3, plan/share0.5), with the PCIe
#   bound and transformers + accelerate at the same budget, and one decode step of each run kernel by kernel ->
#   the same at 50 / 25 % with the lfu replacement policy (no HF) -> int8 experts in the cache against bf16 at
#   the same device bytes (bench/offload_q8.py).
# Every stage has a hard timeout inside one 555 s deadline; results are packed after each stage, so a stage
# that fails or runs out of time still leaves what came before. $OUT gets 3 files: results.tar.gz (the folder
# below), summary.txt (stage times, return codes, the printed tables) and offload.json.
#
# On a GPU machine with the project installed (the cuda extra; accelerate for the HF reference), from the checkout:
#     OUT=out bash bench/trained_offload.sh          (SKIP_QUALITY=1: without the 8-bit quality stage)
# The offload stages decode greedy continuations and, on new prompts, continuations sampled at temperature 0.8.
# PLAN_TOP_K (default 1,2) is the offload stage's --plan-top-k; PLAN_TOP_K= runs the table as it is only.
# PLAN_MIN_SHARE (default 0.3,0.5) is its --plan-min-share: the table gated by share, cut with the counts file
# router-gen --save-counts writes beside it (one trace for every F); PLAN_MIN_SHARE= runs no gated table.
# OFFLOAD_FRACTIONS (e.g. 1,0.25) replaces the offload stage's budgets, OFFLOAD_ARGS is added to its arguments
# (e.g. "--prefetch-yields on,off": every cached run with and without the prefetch yielding to demand copies).
# It needs training/data/corpus.txt (`python -m training.corpus` writes it; git-ignored). Wheels in .whl/extra
# (accelerate, psutil) are installed when the machine lacks accelerate; without them the HF reference is skipped.
# CPU dry run (no GPU, no HF): a tiny variant (the tiny preset with 1,024-token windows), 2 steps, cpu backend:
#     OFFLOAD_DRY_RUN=1 PY=.venv/bin/python OUT=/tmp/dry bash bench/trained_offload.sh
# Markdown for the docs afterwards:  python bench/offload_report.py <the unpacked results folder>
PY=${PY:-python3}
OUT=${OUT:?OUT must name the folder for the results}
DEADLINE=${DEADLINE:-555}
T0=$(date +%s)
W=${WORKDIR:-/dev/shm/colibri-large}
R=$W/results
rm -rf "$W" && mkdir -p "$R" "$OUT" || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH=${PYTHONPATH:-$PWD}
export COLIBRI_KERNEL_CACHE=${COLIBRI_KERNEL_CACHE:-/tmp/colibri-kernel-cache}   # compile once for all stages
HELDOUT=training/data/heldout.txt
if [ -n "$OFFLOAD_DRY_RUN" ]; then
  # a shared 2-core CPU: stage limits x 3, and router-gen on the first 60 chapters only
  PRESET=dry DEVICE=cpu BACKEND=cpu STEPS=2 BUDGET=60 DECODE_STEPS=2 DEADLINE=${DEADLINE_DRY:-2000} SLOW=3 CHAPTERS=60
  QUALITY_LIMITS="--max-windows 2 --prompts 2 --new-tokens 4"
else
  PRESET=large DEVICE=cuda BACKEND=cuda STEPS=${STEPS:-400} BUDGET=${BUDGET:-165} DECODE_STEPS=32 SLOW=1 CHAPTERS=
  QUALITY_LIMITS="--max-windows 20 --prompts 16"   # 4 variants x 62 windows took ~280 s on the H200: a third of them
fi

note() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$R/summary.txt"; }
pack() {
  tar -czf "$OUT/results.tar.gz.tmp" -C "$W" results && mv "$OUT/results.tar.gz.tmp" "$OUT/results.tar.gz"
  cp "$R/summary.txt" "$OUT/summary.txt"
  [ -f "$R/offload/offload.json" ] && cp "$R/offload/offload.json" "$OUT/offload.json"
  return 0
}
# stage NAME MAX_S RESERVE_S CMD...: runs CMD under `timeout`, at most MAX_S and never into the RESERVE_S that
# the later stages need; output in $R/NAME.log.
stage() {
  local name=$1 max=$(( $2 * SLOW )) reserve=$3; shift 3
  local left=$(( DEADLINE - ($(date +%s) - T0) - reserve ))
  local limit=$(( left < max ? left : max ))
  if [ "$limit" -lt 10 ]; then note "$name: skipped, ${left} s left"; return 124; fi
  local start=$(date +%s)
  timeout -k 5 "$limit" bash -c '"$@"' "$name" "$@" > "$R/$name.log" 2>&1     # bash: runs the functions below
  local rc=$?
  note "$name: rc=$rc in $(( $(date +%s) - start )) s (limit $limit s)"
  [ $rc -ne 0 ] && tail -5 "$R/$name.log" | sed 's/^/    /' | tee -a "$R/summary.txt"
  pack
  return $rc
}
# The training command: the dry run's tiny variant is a preset made on the fly (tiny with 1,024-token windows,
# so that the bench's 512-token prompts fit its positions).
train() {
  if [ "$PRESET" = dry ]; then
    "$PY" -c 'import sys; from dataclasses import replace; from training import model, train
model.PRESETS["dry"] = replace(model.PRESETS["tiny"], sequence_length=1024, batch_size=2)
sys.exit(train.main(sys.argv[1:]))' "$@"
  else
    "$PY" -m training.train "$@"
  fi
}
# GROUPED_MMA (bf16, E >= 32) is new: if the first engine stage fails with it, later stages run without it.
MMA_OFF=
py_engine() {
  if [ -n "$MMA_OFF" ]; then
    "$PY" -c 'import runpy, sys; import expert_service.cuda.moe_strategy as strategy; strategy.GROUPED_MMA_MIN_EXPERTS = 1 << 30
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0][3:], run_name="__main__", alter_sys=True) if sys.argv[0].startswith("-m:") else runpy.run_path(sys.argv[0], run_name="__main__")' "$@"
  else
    case $1 in -m:*) local mod=${1#-m:}; shift; "$PY" -m "$mod" "$@";; *) "$PY" "$@";; esac
  fi
}

export PY PRESET MMA_OFF
export -f train py_engine

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU"
  "$PY" -c 'import sys, torch, transformers, numpy; print(sys.version.split()[0], "torch", torch.__version__,
"transformers", transformers.__version__, "numpy", numpy.__version__)'
  git log -1 --format='commit %h %s' 2>/dev/null; git status --short 2>/dev/null | head -20; } > "$R/env.txt" 2>&1
note "preset $PRESET, device $DEVICE, backend $BACKEND, deadline $DEADLINE s; $(head -2 "$R/env.txt" | tr '\n' ' ')"
[ -f training/data/corpus.txt ] || { note "training/data/corpus.txt missing: carry it"; pack; exit 1; }

SKIP_HF=
if [ -n "$OFFLOAD_DRY_RUN" ]; then SKIP_HF=--skip-hf
elif ! "$PY" -c 'import accelerate' 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/extra/*.whl \
    > "$R/accelerate.log" 2>&1
  export PYTHONPATH=$PYTHONPATH:/tmp/site   # where they went: for this check and every stage after it
  "$PY" -c 'import accelerate; print("accelerate", accelerate.__version__)' >> "$R/env.txt" 2>&1 || SKIP_HF=--skip-hf
fi
[ -n "$SKIP_HF" ] && note "HF reference skipped (dry run or no accelerate)"

# 1. train (reserve: convert 20 + router-gen 60 + recall 30 + quality 100 + offload 120; the lfu and int8 stages
#    after the offload stage take what is left: ~60 s on the H200)
stage train 240 330 train --preset "$PRESET" --device "$DEVICE" --steps "$STEPS" --time-budget-s "$BUDGET" \
  --out "$W/hf" || { note "training failed: nothing to measure"; exit 1; }
cp "$W/hf/training_log.json" "$R/training_log.json"
"$PY" -c 'import json, sys; log = json.load(open(sys.argv[1])); final = log["final"]
steps, tokens, wall, best = log["steps"], log["tokens_seen"] / 1e6, log["wall_s"], log["best_step"]
params, ppl = log["model"]["parameters"]["total"] / 1e6, final["heldout_perplexity"]
print(f"trained {steps} steps ({tokens:.1f} M tokens) in {wall} s; held-out perplexity {ppl:.1f}, best step {best}; "
      f"{params:.0f} M parameters")' "$R/training_log.json" | tee -a "$R/summary.txt"
grep -E "^(time budget|step )" "$R/train.log" | tail -6 | sed 's/^/    /' | tee -a "$R/summary.txt"

# 2. the training split (every chapter but the held-out books) for router-gen, and the held-out books
timeout 60 "$PY" -c 'import sys; from training.corpus import read_chapters, split_heldout, write_chapters
from pathlib import Path
train, held = split_heldout(read_chapters(sys.argv[1])); write_chapters(train[:int(sys.argv[3] or len(train))], Path(sys.argv[2]))
print(f"training split: {len(train)} chapters (router-gen: {sys.argv[3] or len(train)}); held out: {len(held)} chapters")' \
  training/data/corpus.txt "$W/train-split.txt" "$CHAPTERS" | tee -a "$R/summary.txt"

# 3. convert (bf16: the GROUPED_MMA path of bf16 models with >= 32 experts)
stage convert 60 210 "$PY" -m colibri.cli convert "$W/hf" "$W/model" --dtype bfloat16 --no-progress || exit 1

# 4. router-gen on the training split (all of it: the held-out recall comes from the next stage)
ROUTER_GEN=(-m:colibri.cli router-gen "$W/model" --corpus "$W/train-split.txt" --holdout 0 --backend "$BACKEND"
            --save-counts --no-progress)
stage router_gen 150 150 py_engine "${ROUTER_GEN[@]}"
rc=$?
if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $rc -ne 137 ] && [ "$BACKEND" = cuda ]; then    # failed, not out of time
  export MMA_OFF=1
  note "router-gen failed: again with GROUPED_MMA off (and every later stage)"
  stage router_gen_mma_off 120 130 py_engine "${ROUTER_GEN[@]}"
fi
cp "$W/model/routing_table.bin.report.json" "$R/" 2>/dev/null

# 5. the table's recall on the held-out books, per layer, against the fallback and chance
if [ -f "$W/model/routing_table.bin" ]; then
  stage recall 90 120 py_engine bench/table_recall.py "$W/model" --text "$HELDOUT" --train-text "$W/train-split.txt" \
    --backend "$BACKEND" --out "$R/recall.json"
  tail -12 "$R/recall.log" | tee -a "$R/summary.txt"
  MODES=none,plan,lookahead,plan+lookahead
  PLAN_RUNS=${PLAN_TOP_K-1,2}
  SHARE_RUNS=${PLAN_MIN_SHARE-0.3,0.5}
  [ -f "$W/model/routing_table.bin.counts.npz" ] || SHARE_RUNS=
else
  note "no routing table: offload runs without the plan prefetch"
  MODES=none,lookahead
fi

# 6. what 8-bit experts cost this model in quality (docs/quantization.md): held-out perplexity, top-1 agreement,
#    logit error and greedy agreement with int8 and fp8 experts against bf16 (reserve: offload 150)
if [ -n "$SKIP_QUALITY" ]; then
  note "quality: skipped (SKIP_QUALITY)"
else
  stage quality 120 150 py_engine bench/quant_quality.py --hf-model "$W/hf" --heldout "$HELDOUT" --backend "$BACKEND" \
    --out "$R/quality.json" $QUALITY_LIMITS
  sed -n '/^variant/,/^wrote/p' "$R/quality.log" | tee -a "$R/summary.txt"
fi

# 7. the offload benchmark: Colibri at 100/50/25 % x prefetch modes (each plan mode with the top-2 table, its
#    rank-1 cut and its share cuts), the PCIe bound, HF + accelerate
stage offload 400 100 py_engine bench/offload.py --model "$W/model" --prompts "$HELDOUT" --hf-model "$W/hf" $SKIP_HF \
  --fractions 1,0.5,0.25 --prefetch-modes "$MODES" --decode-steps "$DECODE_STEPS" --backend "$BACKEND" \
  --out "$R/offload" --workdir "$W/offload-work" --timeline ${PLAN_RUNS:+--plan-top-k "$PLAN_RUNS"} \
  ${SHARE_RUNS:+--plan-min-share "$SHARE_RUNS"} ${OFFLOAD_FRACTIONS:+--fractions "$OFFLOAD_FRACTIONS"} $OFFLOAD_ARGS
sed -n '/experts x/,$p' "$R/offload.log" | tee -a "$R/summary.txt"

# 8. the frequency-aware replacement (lfu) against the runs above (lru), where the cache is short: no HF
stage offload_lfu 120 50 py_engine bench/offload.py --model "$W/model" --prompts "$HELDOUT" --skip-hf --policy lfu \
  --fractions 0.5,0.25 --prefetch-modes none,plan --decode-steps "$DECODE_STEPS" --backend "$BACKEND" \
  --out "$R/offload_lfu" --workdir "$W/offload-work"
sed -n '/experts x/,$p' "$R/offload_lfu.log" | tee -a "$R/summary.txt"

# 9. int8 experts in the cache against bf16 ones at the same device bytes (25 % of the bf16 expert bytes: twice
#    the slots), prompts from the held-out books, greedy and sampled continuations (bench/offload_q8.py)
stage convert_int8 60 5 "$PY" -m colibri.cli convert "$W/hf" "$W/model-int8" --dtype bfloat16 --expert-dtype int8 \
  --no-progress && \
stage offload_q8 120 5 py_engine bench/offload_q8.py --models "$W/model,$W/model-int8" --prompts "$HELDOUT" \
  --fraction 0.25 --decode-steps "$DECODE_STEPS" --backend "$BACKEND" --out "$R/offload_q8"
[ -f "$R/offload_q8.log" ] && grep -E "slots|prefill|vs bf16" "$R/offload_q8.log" | tee -a "$R/summary.txt"
note "done"
pack
