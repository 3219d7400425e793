"""GRPO whose groups restart where the greedy policy fails: does concentrating the episodes on those states help?

The diagnosis so far (bench/experiments/README.md): after the example's 48 GRPO steps, greedy success stops near 70%
on held-out *and* training layouts; the first wrong turn of a failed greedy episode is a close call (the solver's
reply has probability ~0.4 there), and a sampled episode from the maze's start spends most of its ~14 turns on
states the policy already gets right, so the group's advantage is spread over them.

Here each step first plays the ``mazesPerStep`` training mazes greedily (the rollout engine at temperature 0). A maze
the greedy policy solves gets an ordinary group from its start. A maze it fails gets its group from a cell of that
failed greedy episode, drawn uniformly among the cells it visited (not the solver's choice: no privileged
information; the maze, goal, rendering, sparse reward and the 2x turn limit, now from that cell, are unchanged). Then
one ordinary learner update (the trainer's own ``Learner``; the trainer's ``RolloutWorker`` plays every episode, in
one process, no Ray). Held-out greedy success on 256 episodes (64 layouts x 4 corner pairs) before and after, with the
paired gain, as ``paired_gain.py``.

Prints one line per step (sampled success, groups restarted, zero-variance groups, gradient norm), ``EVAL`` lines and
``gain <points> [<95% interval>]; fixed <n>, broken <n>``.

Figures: bench/experiments/README.md (row ``grpo_restart_states.py``). Run from the repository root::

    .venv/bin/python bench/experiments/grpo_restart_states.py runs/local-tiny-s9-engine/sft/model 48
"""

import dataclasses
import os
import sys
import time
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import apply_overrides, heldout_greedy, in_process_parser, load_example  # noqa: E402

ap = in_process_parser(__doc__, "runs/experiments/work-restart")
ap.add_argument("--restart", choices=("failed", "none"), default="failed",
                help="'none': every group from the maze's start (the control, same harness)")
a = ap.parse_args()

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)
from daedalus_trainer.actors import Learner, RolloutWorker  # noqa: E402
from daedalus_trainer.checkpoint import unpack_tensors  # noqa: E402
from daedalus_trainer.config import parse_job  # noqa: E402
from daedalus_trainer.evaluation import paired_gain  # noqa: E402
from daedalus_trainer.layouts import TrainingSampler, eval_mazes, with_corner_pairs  # noqa: E402
from daedalus_trainer.rollout.engine import SamplingParams  # noqa: E402
from daedalus_trainer.rollout.episode import run_episodes  # noqa: E402

job = parse_job(apply_overrides(load_example(), a.overrides))
learner = Learner(job, a.start, a.work_dir)
worker = RolloutWorker(job, a.start, a.work_dir)
sampler = TrainingSampler.for_env(job.spec.environment, seed=job.spec.algorithm.seed)
heldout = with_corner_pairs(eval_mazes(job.spec.environment), 4)
G, M = job.spec.algorithm.group_size, job.spec.algorithm.mazes_per_step
greedy = SamplingParams(0.0, 1.0, job.spec.algorithm.max_tokens_per_turn)
t0 = time.time()


first = heldout_greedy(worker, learner, heldout, 0, t0)
for step in range(a.steps):
    mazes = sampler.mazes(step, M)
    restarted = 0
    if a.restart == "failed":
        if worker.loaded_version != step:  # this step's adapter into the engine, as RolloutWorker.rollout does
            worker.engine.load_adapter(unpack_tensors(learner.adapter_state()), step)
            worker.loaded_version = step
        with torch.no_grad():
            plays = run_episodes(worker.engine, mazes, job.spec.environment, greedy)
        rng = np.random.default_rng([job.spec.algorithm.seed, step, 31])
        starts = []
        for maze, play in zip(mazes, plays):
            cells = sorted({t.state for t in play.turns if t.state is not None and t.state != maze.goal})
            if play.success or not cells:
                starts.append(maze)
            else:
                starts.append(dataclasses.replace(maze, start=cells[int(rng.integers(len(cells)))]))
                restarted += 1
        mazes = starts
    episodes = [m for m in mazes for _ in range(G)]
    trajs = worker.rollout(episodes, step, learner.adapter_state(), step)
    u = learner.update(trajs, G, step + 1)  # 1-based: the job's learning-rate schedule (cosine in the example)
    print(step, "success %.3f" % (sum(t.success for t in trajs) / len(trajs)), "restarted", restarted,
          "zero-variance groups", u.zero_variance_groups, "grad norm %.3f" % (u.grad_norm or 0),
          f"t={time.time() - t0:.0f}", flush=True)
last = heldout_greedy(worker, learner, heldout, a.steps, t0)
g = paired_gain(first, last, 4)
print(f"gain {100 * g['gain']:+.1f} points [{100 * g['ci_low']:+.1f}, {100 * g['ci_high']:+.1f}]; fixed {g['fixed']}, "
      f"broken {g['broken']}", flush=True)
