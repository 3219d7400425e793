"""Where a GRPO step's time goes on CPU: cProfile of the rollout and the learner update, and what sharing the
system prompt's key/value cache would save in the rollout's prefill.

Measures, in this process (no Ray, one thread), from a start model and the example's settings:

1. three GRPO steps of the production ``RolloutWorker.rollout`` (8 training mazes x G=8, the trainer's sampler) and
   ``Learner.update``: seconds of each, turns, successes, then the rollout's and the update's cProfile (cumulative,
   top 30 / 15 entries) of the last step;
2. one forward over 64 rollout prompts (each episode's third turn, or its last) with the common prompt prefix encoded
   once (``Policy._hidden_states(share_prefix=True)``, what the learner does) and without: the saving the rollout's
   prefill would get from the same trick (``generate`` encodes every prompt whole).

Figure (2026-12-01, shared 2-core machine about 2.5x slower per core than the one of the earlier rows; from a
592-step `make run` SFT model)::

    .venv/bin/python bench/experiments/rollout_profile.py runs/local-tiny/sft/model

rollout 11-13 s and update 1.5-4 s per step (959-1071 turns). In the rollout (then on ``transformers.generate``),
``generate`` is 97%; its prefill 5.3-6.1 s (encoding 64 prompts of ~171 tokens, 140 of them the shared system
prompt), prompt encoding 3.0 s before the image cache (``Policy.encode_prompts``, 1.4 s of it the image processor)
and 1.65 s after, trajectories identical.
The forward over 64 prompts of 184 tokens: 0.64 s whole, 0.28 s with the 139-token prefix shared (2.3x); the
rollout engine now shares it (`TransformersEngine._decode`), which halved the rollout of a whole GRPO run.

Run from the repository root.
"""

import argparse
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, load_example  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("start", nargs="?", default=str(REPO / "runs/local-tiny/sft/model"),
                help="start model directory (default: make run's SFT model, runs/local-tiny/sft/model)")
ap.add_argument("--work-dir", default=str(REPO / "runs/experiments/work"),
                help="work directory of the learner and the rollout worker (default runs/experiments/work)")
ap.add_argument("--steps", type=int, default=3, help="GRPO steps to time (default 3)")
a = ap.parse_args()

import torch  # noqa: E402

torch.set_num_threads(1)
from daedalus_trainer.actors import Learner, RolloutWorker  # noqa: E402
from daedalus_trainer.config import parse_job  # noqa: E402
from daedalus_trainer.layouts import TrainingSampler  # noqa: E402

job = parse_job(load_example())
algo = job.spec.algorithm
L = Learner(job, a.start, a.work_dir)
W = RolloutWorker(job, a.start, a.work_dir)
sampler = TrainingSampler.for_env(job.spec.environment, seed=algo.seed)
for step in range(a.steps):
    episodes = [m for m in sampler.mazes(step, algo.mazes_per_step) for _ in range(algo.group_size)]
    rollout_profile, update_profile = cProfile.Profile(), cProfile.Profile()
    t0 = time.perf_counter()
    with rollout_profile:
        trajectories = W.rollout(episodes, step, L.adapter_state(), step)
    t1 = time.perf_counter()
    with update_profile:
        L.update(trajectories, algo.group_size, step + 1)
    t2 = time.perf_counter()
    print(f"step {step}: rollout {t1 - t0:.2f} s, update {t2 - t1:.2f} s, "
          f"{sum(t.num_turns for t in trajectories)} turns, {sum(t.success for t in trajectories)} solved", flush=True)
print("\n== rollout (last step)")
pstats.Stats(rollout_profile).sort_stats("cumulative").print_stats(30)
print("== update (last step)")
pstats.Stats(update_profile).sort_stats("cumulative").print_stats(15)

policy = W.engine.policy
batch = policy.collate([t.turns[min(2, len(t.turns) - 1)].sequence() for t in trajectories])
print(f"== one forward over {tuple(batch.input_ids.shape)} prompt tokens, shared prefix "
      f"{policy.shared_prefix_length(batch)} tokens")
with torch.no_grad():
    for share in (False, True, False, True):
        t = time.perf_counter()
        for _ in range(5):
            policy._hidden_states(batch, share)
        print(f"share_prefix={share}: {(time.perf_counter() - t) / 5:.3f} s", flush=True)
