"""GRPO on 4 fixed training mazes: does the update raise success on what it trains on?

Measures: 15 GRPO steps of the production ``Learner`` and ``RolloutWorker`` in this process (no Ray) on the same
4 training mazes (``TrainingSampler(seed=0).mazes(3, 4)``) x 8 samples each, job settings from
``examples/local-tiny.yaml`` with the learning rate and ``key.path=value`` overrides given. Prints per step:
``<step> [successes of each group of 8] bumps <wall bumps> pe <parse errors> turns <turns> loss .. gn .. clip ..
<seconds>``. If the update is right, successes climb and wall bumps fall.

Figure (2026-11-30, shared 2-core machine, one seed), from ``make run``'s SFT model::

    .venv/bin/python bench/experiments/grpo_fixed_mazes.py 1e-3

17/32 -> 27/32 episodes solved over 15 steps, wall bumps 241 -> 122 per step.
(``tests/e2e/test_grpo_learns.py`` checks the same effect on every test run.)

Run from the repository root.
"""

import argparse
import os
import sys
import time
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, apply_overrides, load_example, override  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("lr", nargs="?", type=float, default=5e-4, help="algorithm.learningRate (default 5e-4)")
ap.add_argument("overrides", nargs="*", type=override, metavar="KEY.PATH=VALUE",
                help="overrides under the spec of examples/local-tiny.yaml, values parsed as YAML")
ap.add_argument("--start", default=str(REPO / "runs/local-tiny/sft/model"),
                help="start model directory (default: make run's SFT model, runs/local-tiny/sft/model)")
ap.add_argument("--work-dir", default=str(REPO / "runs/experiments/work"),
                help="work directory of the learner and the rollout worker (default runs/experiments/work)")
a = ap.parse_args()

import torch  # noqa: E402

torch.set_num_threads(1)
from daedalus_trainer.actors import Learner, RolloutWorker  # noqa: E402
from daedalus_trainer.config import parse_job  # noqa: E402
from daedalus_trainer.layouts import TrainingSampler  # noqa: E402

doc = load_example()
doc["spec"]["algorithm"]["learningRate"] = a.lr
apply_overrides(doc, a.overrides)  # after the learning rate: an override of it wins
job = parse_job(doc)
L = Learner(job, a.start, a.work_dir)
W = RolloutWorker(job, a.start, a.work_dir)
s = TrainingSampler.for_env(job.spec.environment, seed=0)
mazes = s.mazes(3, 4)
eps = [m for m in mazes for _ in range(8)]
for step in range(15):
    t = time.time()
    tr = W.rollout(eps, step, L.adapter_state(), step)
    succ = [sum(t.success for t in tr[g * 8:(g + 1) * 8]) for g in range(4)]
    bumps = sum(tt.wall_bump for t in tr for tt in t.turns)
    u = L.update(tr, 8)
    pe = sum(tt.parse_error for t in tr for tt in t.turns)
    print(step, succ, "bumps", bumps, "pe", pe, "turns", sum(t.num_turns for t in tr),
          "loss %.3f gn %.3f clip %.3f" % (u.loss or 0, u.grad_norm or 0, u.clip_fraction or 0),
          "%.1fs" % (time.time() - t), flush=True)
