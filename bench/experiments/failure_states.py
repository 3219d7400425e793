"""Where greedy episodes fail, and how close the policy was to the solver's move there.

Measures, for a start model and optionally GRPO adapters trained from it (each line one policy):

- greedy success on the 64 held-out mazes (``layouts.eval_mazes``) and on 64 training mazes
  (``TrainingSampler(seed=0).mazes(0, 64)``);
- for every failed greedy episode, the first turn whose action differs from the solver's
  (``sft.expert_action``): its kind (``bump`` into a wall, ``away`` = a legal move off the shortest path, ``stop``
  off the goal, ``parse`` error), and the probability the policy gives the solver's reply there (softmax over the
  log-likelihoods of the five canonical replies at temperature 1): near 0 means the policy is confidently wrong
  (exploration could not find the fix), near the winner's means a close call;
- per-turn accuracy (greedy decoding reproduces the solver's reply) and the mean log-likelihood of the solver's reply
  on 512 held-out demonstration turns (``sft.heldout_turns``): how far a GRPO run moved the policy where it is
  evaluated.

Uses the production ``RolloutWorker`` (no Ray) and the environment of ``examples/local-tiny.yaml``; an adapter is
loaded with ``RolloutEngine.load_adapter`` from its PEFT directory.

Figures (2026-11-30, shared 2-core machine; 64 mazes each, 95% CI about +-12 points), on ``make run``'s 64.1% DAgger SFT
model and the adapters of two GRPO runs from it::

    .venv/bin/python bench/experiments/failure_states.py runs/local-tiny/sft/model \\
        --adapter runs/local-tiny/exports/adapter

- start: held-out 41/64, training 48/64; first errors of the 23 held-out failures: 16 ``away``, 7 ``bump``;
  p(solver's reply) at the first error median 0.39 (>0.1 in 96% of them): close calls, not confident mistakes;
  per-turn accuracy 0.893, mean log-likelihood of the solver's reply -0.234;
- after ``make run``'s 30 GRPO steps (lr 5e-4, T=1): held-out 41/64, training 51/64, median 0.40; per-turn accuracy
  0.900, log-likelihood -0.223;
- after 30 steps at T=0.5, lr 1e-3, ``seq-mean-token-mean`` (``grpo_heldout.py`` row of that date, adapter
  ``--adapter <its --out>/exports/adapter``): held-out 38/64, **training 55/64**; per-turn accuracy 0.875,
  log-likelihood -0.232.

GRPO hardly moves the policy on held-out states in 30 steps (compare: the SFT stage's per-turn accuracy rises from
0.89 to 0.96 between 330 s and 660 s of DAgger SFT); what it gains, it gains on the layouts it trains on.

Run from the repository root.
"""

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, load_example  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("start", help="start model directory (e.g. runs/local-tiny/sft/model)")
ap.add_argument("--adapter", action="append", default=[], metavar="DIR",
                help="PEFT adapter directory trained from START (e.g. runs/local-tiny/exports/adapter); repeatable")
ap.add_argument("--work-dir", default=str(REPO / "runs/experiments/work"),
                help="work directory of the rollout worker (default runs/experiments/work)")
a = ap.parse_args()

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
from daedalus_trainer import sft  # noqa: E402
from daedalus_trainer.actors import RolloutWorker  # noqa: E402
from daedalus_trainer.config import parse_job  # noqa: E402
from daedalus_trainer.envs.actions import format_action  # noqa: E402
from daedalus_trainer.envs.maze import DELTAS, distance_map  # noqa: E402
from daedalus_trainer.layouts import TrainingSampler, eval_mazes  # noqa: E402
from daedalus_trainer.policy import TokenSequence  # noqa: E402
from daedalus_trainer.prompts import completion_ids  # noqa: E402
from daedalus_trainer.rollout.engine import SamplingParams  # noqa: E402
from daedalus_trainer.rollout.episode import run_episodes  # noqa: E402

job = parse_job(load_example())
env = job.spec.environment
worker = RolloutWorker(job, a.start, a.work_dir)
policy = worker.engine.policy
tokenizer = policy.tokenizer
im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
ACTIONS = ["up", "down", "left", "right", "stop"]
SETS = {"held-out": eval_mazes(env), "training": TrainingSampler.for_env(env, seed=0).mazes(0, 64)}
demo_sequences = sft._encode_chunked(policy, sft.heldout_turns(env, n=512))


@torch.no_grad()
def reply_probabilities(turn) -> list[float]:
    """Softmax over the five canonical replies' log-likelihoods in ``turn``'s context (temperature 1)."""
    seqs = [TokenSequence(list(turn.prompt_ids), completion_ids(tokenizer, format_action(x, env.action_format), im_end),
                          list(turn.images)) for x in ACTIONS]
    batch = policy.collate(seqs)
    scores = (policy.response_logprobs(batch, 1.0) * batch.assistant_mask).sum(1)
    return torch.softmax(scores, 0).tolist()


def first_error(traj) -> tuple[str, float] | None:
    """``(kind, p(solver's reply))`` at the first turn that leaves the solver's path, or None."""
    dist = distance_map(traj.maze)
    cell = tuple(traj.maze.start)
    for turn in traj.turns:
        expert = sft.expert_action(traj.maze, dist, cell)
        if turn.action != expert:
            kind = ("parse" if turn.action is None else "bump" if turn.wall_bump
                    else "stop" if turn.action == "stop" else "away")
            return kind, reply_probabilities(turn)[ACTIONS.index(expert)]
        if turn.action in DELTAS:
            dr, dc = DELTAS[turn.action]
            cell = (cell[0] + dr, cell[1] + dc)
    return None


@torch.no_grad()
def demo_figures() -> tuple[float, float]:
    """(per-turn greedy accuracy, mean log-likelihood of the solver's reply) on the held-out demonstration turns."""
    total = 0.0
    for lo in range(0, len(demo_sequences), 64):
        batch = policy.collate(demo_sequences[lo : lo + 64])
        total += float((policy.response_logprobs(batch, 1.0) * batch.assistant_mask).sum())
    return sft.step_accuracy(policy, demo_sequences), total / len(demo_sequences)


def report(name: str) -> None:
    """Print one policy's line."""
    parts = [name]
    for set_name, mazes in SETS.items():
        greedy = SamplingParams(0.0, 1.0, job.spec.algorithm.max_tokens_per_turn)
        trajs = run_episodes(worker.engine, mazes, env, greedy)
        errors = [e for e in (first_error(t) for t in trajs if not t.success) if e is not None]
        kinds = {k: sum(1 for e in errors if e[0] == k) for k in ("away", "bump", "stop", "parse")}
        p = np.array([e[1] for e in errors]) if errors else np.zeros(1)
        parts.append(f"{set_name} {sum(t.success for t in trajs)}/{len(trajs)} first errors {kinds} "
                     f"p(solver) median {np.median(p):.2f} >0.1 {np.mean(p > 0.1):.0%}")
    acc, loglik = demo_figures()
    parts.append(f"per-turn accuracy {acc:.3f} log-likelihood {loglik:.3f}")
    print(" | ".join(parts), flush=True)


report(f"start {a.start}")
for i, adapter in enumerate(a.adapter, start=1):
    worker.engine.load_adapter(adapter, i)
    report(f"adapter {adapter}")
