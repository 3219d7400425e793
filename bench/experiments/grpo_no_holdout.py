"""GRPO that trains on the evaluation layouts themselves: what a figure without a layout hold-out would show.

Measures: GRPO steps of the production ``Learner`` and ``RolloutWorker`` in this process (no Ray), each step on 8
mazes x G=8 drawn (seeded by the step, without replacement within a step) from a pool: ``--pool eval`` = the 64
evaluation layouts (``layouts.eval_mazes``, i.e. the held-out set is trained on), ``--pool train`` = 64 training mazes
(``TrainingSampler(seed=0).mazes(0, 64)``). Every ``--eval-every`` steps, greedy success on both the 64 evaluation
mazes and those 64 training mazes. Job settings from ``examples/local-tiny.yaml`` with ``key.path=value`` overrides.
Prints one line per step (rollout success, zero-variance groups, parse errors, seconds) and ``EVAL step <n>
eval-layouts <k>/64 training <k>/64`` lines.

Why: the GRPO issue quotes a prototype that went from 67% to 97% in 2 minutes; at maze size 7 there are only 192
layouts, so an evaluation set drawn by seed rather than held out by layout would mostly consist of layouts the policy
trained on, and GRPO does learn the layouts it trains on (``failure_states.py``: 48 -> 55 of 64 training mazes in 30
steps while held-out success fell).

Figures (2026-11-30, shared 2-core machine, one seed each; 64 mazes, 95% CI about +-12 points), from ``make run``'s
DAgger SFT model of that date (64.1%; greedy: evaluation layouts 41/64, training 48/64)::

    .venv/bin/python bench/experiments/grpo_no_holdout.py --pool eval algorithm.temperature=0.5 \\
        algorithm.learningRate=1e-3 algorithm.lossAggregation=seq-mean-token-mean

evaluation layouts 41 -> 47 -> 51 -> **52/64** (64.1% -> 81.3%) at steps 0 / 10 / 20 / 30, training mazes (now
unseen) 48 -> 51 -> 49 -> 50/64; 4 min 16 s in all, 5-10 s per step. The same settings on the training layouts
(``grpo_heldout.py`` at temperature 0.5, bench/experiments/README.md): held-out 64.1% -> 59.4%. At the prototype's
settings (``algorithm.learningRate=3e-3``, temperature 1, ``token-mean``), on the evaluation layouts: 41 -> 47 -> 46
-> 36/64 (5 min 7 s), training mazes 48 -> 55 -> 41 -> 38/64.

On a GPU machine (``bench/gpu/session.sh``, 2026-11-30; one H200, four runs side by side, ~358 s of steps each)
from the session-5 68.8% SFT model: ``--pool sampler`` (every training layout) raised held-out greedy success
44 -> 49-51/64 in 31-38 steps at three settings, ``--pool eval`` 44 -> 55/64 (steps 20 and 40); see
bench/experiments/README.md.

Run from the repository root.
"""

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, apply_overrides, load_example, override  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("overrides", nargs="*", type=override, metavar="KEY.PATH=VALUE",
                help="overrides under the spec of examples/local-tiny.yaml, values parsed as YAML")
ap.add_argument("--pool", choices=("eval", "train", "sampler"), default="eval",
                help="mazes GRPO trains on: the 64 evaluation layouts (default), the 64 training mazes, or "
                     "'sampler': the trainer's own stream over every training layout (what `daedalus train` draws)")
ap.add_argument("--steps", type=int, default=30, help="GRPO steps (default 30)")
ap.add_argument("--max-seconds", type=float, default=0.0,
                help="start no step after this many seconds (0: no limit); the last step is evaluated")
ap.add_argument("--eval-every", type=int, default=10, help="greedy evaluation interval in steps (default 10)")
ap.add_argument("--start", default=str(REPO / "runs/local-tiny/sft/model"),
                help="start model directory (default: make run's SFT model, runs/local-tiny/sft/model)")
ap.add_argument("--work-dir", default=str(REPO / "runs/experiments/work"),
                help="work directory of the learner and the rollout worker (default runs/experiments/work)")
a = ap.parse_args()

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
from daedalus_trainer.actors import Learner, RolloutWorker  # noqa: E402
from daedalus_trainer.config import parse_job  # noqa: E402
from daedalus_trainer.layouts import TrainingSampler, eval_mazes  # noqa: E402

doc = load_example()
apply_overrides(doc, a.overrides)
job = parse_job(doc)
algo = job.spec.algorithm
learner = Learner(job, a.start, a.work_dir)
worker = RolloutWorker(job, a.start, a.work_dir)
held_out = eval_mazes(job.spec.environment)
training = TrainingSampler.for_env(job.spec.environment, seed=0).mazes(0, 64)
pool = held_out if a.pool == "eval" else training
sampler = TrainingSampler.for_env(job.spec.environment, seed=algo.seed)
print(f"device {learner.policy.device}, pool {a.pool}, {a.steps} steps, overrides {a.overrides}", flush=True)
started = time.time()


def evaluate(step: int) -> None:
    """Print greedy success on both sets with the learner's current adapter."""
    adapter = learner.adapter_state()
    on_eval = sum(worker.evaluate(held_out, adapter, step))
    on_train = sum(worker.evaluate(training, adapter, step))
    print(f"EVAL step {step} eval-layouts {on_eval}/64 training {on_train}/64 t={time.time() - started:.0f}s",
          flush=True)


evaluate(0)
for step in range(1, a.steps + 1):
    t = time.time()
    if a.pool == "sampler":
        mazes = sampler.mazes(step, algo.mazes_per_step)
    else:
        rng = np.random.default_rng([algo.seed, step])
        mazes = [pool[i] for i in rng.choice(len(pool), algo.mazes_per_step, replace=False)]
    episodes = [m for m in mazes for _ in range(algo.group_size)]
    trajectories = worker.rollout(episodes, step, learner.adapter_state(), step)
    update = learner.update(trajectories, algo.group_size, step)  # the step sets lrSchedule's rate
    parse_errors = sum(turn.parse_error for tr in trajectories for turn in tr.turns)
    print(f"{step} success {np.mean([tr.success for tr in trajectories]):.3f} zero-var {update.zero_variance_groups} "
          f"parse-errors {parse_errors} {time.time() - t:.1f}s", flush=True)
    out_of_time = a.max_seconds > 0 and time.time() - started > a.max_seconds
    if step % a.eval_every == 0 or step == a.steps or out_of_time:
        evaluate(step)
    if out_of_time:
        print(f"time budget of {a.max_seconds:.0f} s reached after step {step}", flush=True)
        break
