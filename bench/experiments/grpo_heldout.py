"""GRPO from a given start, with held-out greedy evaluation along the way.

Measures: whether GRPO (``daedalus_trainer.grpo.Trainer`` on a local Ray, the job of ``examples/local-tiny.yaml`` with
``--set`` overrides of its ``spec``) raises greedy success on the 64 held-out mazes. Prints one JSON line per step
(success ratio, turns, zero-variance groups, loss, grad norm, clip fraction, rollout/learner seconds, and
``eval_success_ratio`` every ``algorithm.evalIntervalSteps`` steps; ``t=`` seconds since start), then
``FINAL eval <greedy success after the last step> wall <seconds>``.

Figures (2026-11-30, shared 2-core machine, one seed each; 64 held-out mazes, 95% CI about +-12 points):

- from the 60.9% start (``sft_grid_padding.py`` with PAD=1, 1000 steps) ::

      .venv/bin/python bench/experiments/grpo_heldout.py --start runs/experiments/sft-pad1/model \\
          --out runs/experiments/grpo-smtm --set algorithm.learningRate=1e-3 \\
          --set algorithm.evalIntervalSteps=10 --set algorithm.lossAggregation=seq-mean-token-mean

  held-out greedy 53.1% / 54.7% / 57.8% at steps 10 / 20 / 30 (step 30 is the ``FINAL eval`` line);
- LoRA on the MLP projections as well, from ``make run``'s 51.6% SFT model (``--start runs/local-tiny/sft/model``
  ``--set 'lora.targetModules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]'``): 48.4% at step 10
  (stopped there);
- 16 mazes x G=4 per step (``--set algorithm.mazesPerStep=16 --set algorithm.groupSize=4
  --set algorithm.learningRate=2e-3``) from the 60.9% start: 51.6% / 56.2% / 43.8%;
- from the 4-layer model (``sft_architecture.py '{"text_layers": 4}' 1000``, 65.6%): 59.4% / 65.6% / 64.1%.

Run from the repository root; the job's checkpoints and the Ray actors' work files go to ``--out``.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import load_example, override  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--start", required=True, help="start model directory (an SFT model, e.g. runs/local-tiny/sft/model)")
ap.add_argument("--out", required=True, help="run directory for this GRPO run (checkpoints, work files)")
ap.add_argument("--set", action="append", default=[], type=override, metavar="KEY.PATH=VALUE",
                help="override under the spec of examples/local-tiny.yaml, value parsed as YAML "
                     "(e.g. algorithm.learningRate=1e-3); repeatable")
ap.add_argument("--workers", type=int, default=None, help="rollout actors (default: the trainer's choice)")
a = ap.parse_args()

from daedalus_trainer.config import parse_job  # noqa: E402

job = parse_job(load_example(a.set))
import torch  # noqa: E402

torch.set_num_threads(1)
from daedalus_trainer.grpo import Trainer, init_ray  # noqa: E402

init_ray(local=True)
t0 = time.time()
KEYS = ("step", "success_ratio", "episode_turns", "zero_variance_groups", "loss", "grad_norm", "clip_fraction",
        "rollout_seconds", "learner_seconds", "eval_success_ratio")


def on_step(r):
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k in KEYS}),
          f"t={time.time()-t0:.0f}", flush=True)


tr = Trainer(job, a.out, start_dir=a.start, work_dir=a.out, on_step=on_step, final_eval=True, rollout_workers=a.workers)
res = tr.train(resume="none")
print("FINAL eval", tr.final_eval_success, "wall", round(res.wall_seconds), flush=True)
