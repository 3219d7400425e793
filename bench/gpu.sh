#!/usr/bin/env bash
# GPU benchmark (only where a GPU machine is lent; not part of `make bench`): builds a random-weight Qwen3-VL-8B-shaped
# checkpoint on the GPU, runs multi-turn maze rollouts with a rank-32 LoRA adapter (vLLM when importable, else the
# transformers engine) and a GRPO learner step, and prints tokens/s and step time. Finishes within 10 minutes
# (a hard `timeout` stops it at 570 s; the Python side stops starting steps after --budget-s 540 by default).
#
#   bench/gpu.sh [rollout_step.py options]     e.g. bench/gpu.sh --engine transformers --steps 1
#
# On this workplace's device machine (no network; image: Python 3.12, torch 2.11, transformers 5.17, no pydantic,
# gymnasium or vLLM), first run once on the CPU machine:  bench/gpu/fetch-wheels.sh   (writes .whl/, ~17 MB)
# then call the device tool with carry [".whl"] and the command:  bench/gpu.sh
# Figures: the last two lines (gpu_step, gpu_rollout); all of them in $OUT/gpu_bench.json; the log in $OUT/gpu_bench.log.
# See bench/README.md.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUTDIR=${OUT:-/tmp/daedalus-gpu-bench-out}
mkdir -p "$OUTDIR"
source bench/gpu/env.sh || exit 1   # carried wheels, PYTHONPATH
{
  echo "== $(date -u +%FT%TZ) $(uname -m) $(nproc) cpus"
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.sm --format=csv 2>&1 || true
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), \
'transformers', transformers.__version__)"
  "$PY" -c "import vllm; print('vllm', vllm.__version__)" 2>/dev/null || echo "vllm: not importable"
  timeout 570 "$PY" bench/gpu/rollout_step.py --work /tmp/daedalus-gpu-bench --json "$OUTDIR/gpu_bench.json" "$@"
  rc=$?
  [ $rc -eq 124 ] && echo "gpu.sh: stopped by the 570 s timeout"
  rm -rf /tmp/daedalus-gpu-bench
  exit $rc
} 2>&1 | tee "$OUTDIR/gpu_bench.log"
exit "${PIPESTATUS[0]}"
