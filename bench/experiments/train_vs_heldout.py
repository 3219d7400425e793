"""Greedy success of one model on 64 held-out mazes vs 64 of its training mazes.

Measures: whether a model memorises its training layouts (success much higher on training mazes than on held-out
ones) or is limited by what it can learn at all (about equal). Uses the production ``RolloutWorker`` in this
process (no Ray) with the model as loaded and the environment of ``examples/local-tiny.yaml``: the held-out set is
``layouts.eval_mazes`` (excluded from every training sampler), the training set
``TrainingSampler(seed=0).mazes(0, 64)``. Prints ``held-out <fraction>`` and ``train <fraction>``.

Figure (2026-11-30, shared 2-core machine), on ``make run``'s SFT model::

    .venv/bin/python bench/experiments/train_vs_heldout.py runs/local-tiny/sft/model

held-out 51.6%, training 42.2%: no memorisation. 64 mazes each: 95% CI about +-12 points.

Run from the repository root.
"""

import argparse
import os
import sys
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, load_example  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("start", help="model directory to evaluate (e.g. runs/local-tiny/sft/model)")
ap.add_argument("--work-dir", default=str(REPO / "runs/experiments/work"),
                help="work directory of the rollout worker (default runs/experiments/work)")
a = ap.parse_args()

import torch  # noqa: E402

torch.set_num_threads(1)
from daedalus_trainer.actors import RolloutWorker  # noqa: E402
from daedalus_trainer.config import parse_job  # noqa: E402
from daedalus_trainer.layouts import TrainingSampler, eval_mazes  # noqa: E402

job = parse_job(load_example())
W = RolloutWorker(job, a.start, a.work_dir)
ad = W.engine.policy.adapter_state()
held = eval_mazes(job.spec.environment)
s = TrainingSampler.for_env(job.spec.environment, seed=0)
train = s.mazes(0, 64)
print("held-out", sum(W.evaluate(held, ad, 0)) / 64)
print("train", sum(W.evaluate(train, ad, 0)) / 64)
