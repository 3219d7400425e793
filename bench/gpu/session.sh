#!/usr/bin/env bash
# One device call that fits a lease of this workplace's GPU machine (10 minutes a command, 15 a session):
#
#   1. bench/gpu.sh: the random-weight Qwen3-VL-8B-shaped rollout + learner step (bounded by BENCH_S, default 300 s);
#   2. GRPO of the tiny model on the GPU from `make run`'s SFT start, for the time left (TOTAL_S, default 540 s, minus
#      what step 1 used): four bench/experiments/grpo_no_holdout.py runs side by side (3 CPU threads each), greedy
#      success on the 64 held-out and 64 training mazes every EVAL_EVERY steps. Question: does GRPO move held-out
#      success when it gets several times the steps a 2-core CPU gives it in `make run`?
#        sampler-default  the trainer's own sampler over all 128 training layouts, make run's settings
#        sampler-t05      the same at temperature 0.5, lr 1e-3, seq-mean-token-mean (best on training layouts, CPU)
#        sampler-lr1e3    the same at temperature 1, lr 1e-3
#        eval-t05         sampler-t05's settings trained on the 64 evaluation layouts (no hold-out: the control)
#
# Before the call, on the CPU machine (once): bench/gpu/fetch-wheels.sh (-> .whl/), then
#   mkdir -p .devcarry && cp -r runs/local-tiny/sft/model .devcarry/start-model
# and call the device tool with carry [".whl", ".devcarry"], command "bench/gpu/session.sh", timeout_s 600.
# Everything comes back in $OUT: gpu_bench.log/json, grpo_<variant>.log, session.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
T0=$SECONDS
TOTAL_S=${TOTAL_S:-540}
BENCH_S=${BENCH_S:-300}
EVAL_EVERY=${EVAL_EVERY:-20}
START=${START_MODEL:-.devcarry/start-model}
OUTDIR=${OUT:-/tmp/daedalus-device-out}
mkdir -p "$OUTDIR"
exec > >(tee "$OUTDIR/session.log") 2>&1
echo "== session.sh $(date -u +%FT%TZ) $(nproc) cpus; TOTAL_S=$TOTAL_S BENCH_S=$BENCH_S start=$START"

source bench/gpu/env.sh || exit 1   # carried wheels, PYTHONPATH (gpu.sh inherits them)
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  # gpu.sh's Python side starts no step after BENCH_S - 60 s.
  timeout "$BENCH_S" bench/gpu.sh --budget-s $((BENCH_S - 60))
  echo "== gpu.sh exit $? after $((SECONDS - T0)) s"
fi

export OMP_NUM_THREADS=3
if [ ! -f "$START/config.json" ]; then
  echo "no start model at $START (copy runs/local-tiny/sft/model there and carry it)"; exit 1
fi
LEFT=$((TOTAL_S - (SECONDS - T0) - 40))   # room for the last evaluation
echo "== GRPO variants: $LEFT s of steps each"
E=bench/experiments/grpo_no_holdout.py
COMMON=(--start "$START" --steps 2000 --eval-every "$EVAL_EVERY" --max-seconds "$LEFT")
T05=(algorithm.temperature=0.5 algorithm.learningRate=1e-3 algorithm.lossAggregation=seq-mean-token-mean)
PIDS=()
python3 $E "${COMMON[@]}" --work-dir /tmp/w1 --pool sampler > "$OUTDIR/grpo_sampler-default.log" 2>&1 & PIDS+=($!)
python3 $E "${COMMON[@]}" --work-dir /tmp/w2 --pool sampler "${T05[@]}" > "$OUTDIR/grpo_sampler-t05.log" 2>&1 &
PIDS+=($!)
python3 $E "${COMMON[@]}" --work-dir /tmp/w3 --pool sampler algorithm.learningRate=1e-3 \
  > "$OUTDIR/grpo_sampler-lr1e3.log" 2>&1 & PIDS+=($!)
python3 $E "${COMMON[@]}" --work-dir /tmp/w4 --pool eval "${T05[@]}" > "$OUTDIR/grpo_eval-t05.log" 2>&1 & PIDS+=($!)
wait "${PIDS[@]}"   # not a bare wait: that would also wait for the tee of this script's own output
for f in "$OUTDIR"/grpo_*.log; do
  echo "== $f"; grep -E "^device|^EVAL|budget|Error|error" "$f" | tail -20
done
echo "== session.sh done after $((SECONDS - T0)) s"
