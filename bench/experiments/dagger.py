"""Continuing SFT with DAgger: half of each batch is the policy's own greedy states labelled by the solver.

Method (DAgger: Ross, Gordon and Bagnell, "A Reduction of Imitation Learning and Structured Prediction to No-Regret
Online Learning", AISTATS 2011, arXiv:1011.0686): every 50 steps the current policy plays 32 training mazes
greedily; each distinct state it visited (repeats of the same prompt in a loop counted once) is labelled with the
solver's action (``sft.expert_action``, BFS distance map) and rendered as an SFT turn. Each step trains on 16 noisy
solver demonstrations (``sft.DemoSource``, DART noise ``sft.DEMO_NOISE``) + 16 turns drawn from that pool. Mode
``demo`` is the control: 32 noisy demonstrations per step, nothing on-policy. Full-model AdamW (``sft.ADAM_BETAS``,
no weight decay), LR constant for the first half then linear to 0, gradient norm clipped at 1, loss = mean negative
log-likelihood of the assistant tokens. Environment and evaluation from ``examples/local-tiny.yaml``.

Prints (dagger mode) every 50 steps the greedy success on that round's 32 training mazes and the pool size, then
``<mode> <steps> held-out greedy <success on the 64 held-out mazes> bumps <greedy wall-bump rate per turn>
t=<seconds>``. With the environment variable OUT set, the final model is saved there.

Figures (2026-11-30, shared 2-core machine, one seed each), from the 60.9% model (greedy wall-bump rate 0.338;
``sft_grid_padding.py`` PAD=1, 1000 steps)::

    .venv/bin/python bench/experiments/dagger.py runs/experiments/sft-pad1/model dagger 300 5e-4
    .venv/bin/python bench/experiments/dagger.py runs/experiments/sft-pad1/model demo 300 5e-4

dagger 64.1% held-out greedy success (wall-bump rate 0.149); demo-only control 40.6% (0.575). With 600 steps at
lr 3e-4 (``... dagger 600 3e-4`` and ``... demo 600 3e-4``): dagger 79.7% (0.072), demo-only 51.6% (0.448); with 300
steps at 2e-4: dagger 60.9% (0.136). From the random tiny model (``runs/experiments/sft-pad1/tiny-base``), 1000
steps at 1e-3: dagger 71.9% (0.064), demo-only 46.9% (0.466).
64 held-out mazes: 95% CI about +-12 points.

Run from the repository root.
"""

import argparse
import os
import sys
import time
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import load_example  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                             epilog="environment: OUT=<dir> saves the final model there")
ap.add_argument("start", help="start model directory (a full-model SFT model, e.g. runs/experiments/sft-pad1/model)")
ap.add_argument("mode", choices=["dagger", "demo"], help="dagger: half on-policy states; demo: the control")
ap.add_argument("steps", type=int, help="optimizer steps (batch 32)")
ap.add_argument("lr", nargs="?", type=float, default=5e-4, help="peak learning rate (default 5e-4)")
a = ap.parse_args()

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)
from daedalus_trainer import prompts, sft  # noqa: E402
from daedalus_trainer.config import parse_job  # noqa: E402
from daedalus_trainer.envs import distance_map, format_action  # noqa: E402
from daedalus_trainer.layouts import TrainingSampler  # noqa: E402
from daedalus_trainer.policy import load_pretrained  # noqa: E402
from daedalus_trainer.rollout.engine import SamplingParams, TransformersEngine  # noqa: E402
from daedalus_trainer.rollout.episode import make_env, run_episodes  # noqa: E402

start, mode, steps, lr = a.start, a.mode, a.steps, a.lr
job = parse_job(load_example())
env_spec = job.spec.environment
settings = prompts.PromptSettings.from_env(env_spec)
policy = load_pretrained(start, "float32")
params = policy.trainable_parameters()
opt = torch.optim.AdamW(params, lr=lr, betas=sft.ADAM_BETAS, weight_decay=0.0)
sampler = TrainingSampler.for_env(env_spec, 7)
source = sft.DemoSource(policy, env_spec, sampler, 7, noise=sft.DEMO_NOISE)
rng = np.random.default_rng(0)


def onpolicy_pool(round_):
    """Greedy episodes of the current policy on 32 training mazes -> (solver-labelled distinct turns, success)."""
    policy.model.eval()
    eng = TransformersEngine(policy)
    mazes = sampler.mazes(10_000 + round_, 32)
    with torch.no_grad():
        trajs = run_episodes(eng, mazes, env_spec, SamplingParams(0.0, 1.0, 12))
    pool = []
    for maze, t in zip(mazes, trajs):
        env = make_env(env_spec)
        obs, info = env.reset(options={"maze": maze})
        dist = distance_map(maze)
        observations, executed, labels = [obs], [], []
        for turn in t.turns:
            labels.append(format_action(sft.expert_action(maze, dist, tuple(info["agent"])), env_spec.action_format))
            executed.append(turn.text)
            obs, _, term, trunc, info = env.step(turn.text)
            if term or trunc:
                break
            observations.append(obs)
        # distinct states only (loops repeat the same prompt)
        seen = set()
        for k in range(len(labels)):
            key = (k and executed[k - 1], tuple(observations[k]["image"].sum(axis=(0, 1))), observations[k]["feedback"])
            if key in seen:
                continue
            seen.add(key)
            pool.append(sft._demo_turn(observations, executed, labels, k, settings))
    policy.model.train()
    return pool, sum(t.success for t in trajs) / len(trajs)


t0 = time.time()
policy.model.train()
pool = []
for step in range(steps):
    if mode == "dagger" and step % 50 == 0:
        pool, train_succ = onpolicy_pool(step // 50)
        print(f"step {step}: greedy success on 32 training mazes {train_succ:.2f}, pool {len(pool)} turns, "
              f"t={time.time()-t0:.0f}", flush=True)
    demo = source.turns(step, 32 if mode != "dagger" else 16)
    if mode == "dagger":
        demo += [pool[i] for i in rng.integers(len(pool), size=16)]
    seqs = sft.encode_turns(policy, demo)
    batch = policy.collate(seqs)
    for g in opt.param_groups:
        g["lr"] = lr * min(1.0, max(0.0, 1 - step / steps) / 0.5)
    logp = policy.response_logprobs(batch)
    loss = -logp.sum() / batch.assistant_mask.sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
policy.model.eval()
if os.environ.get("OUT"):
    policy.save_pretrained(os.environ["OUT"])
res = sft._greedy_eval(policy, job.spec)
print(mode, steps, "held-out greedy", res["success_rate"], "bumps", round(res["wall_bump_rate"], 3),
      f"t={time.time()-t0:.0f}", flush=True)
