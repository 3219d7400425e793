"""Our GRPO step vs TRL 1.16's ``GRPOTrainer`` on the same tiny Qwen3-VL, prompts, images and settings; plus our
multi-turn throughput and time split on a local Ray.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python bench/trainer_vs_trl.py`` (a few minutes on 2 cores; ``--help`` for sizes).

Part 1, single turn, side by side in one process:

- Model: the tiny Qwen3-VL (:func:`daedalus_trainer.tiny.build_tiny_checkpoint`) after a short SFT
  (:func:`daedalus_trainer.sft.run_sft`, ``--sft-steps`` steps on first-move demonstrations, default 120) so that replies parse
  and rewards vary within a group; a random model would reward every episode 0, every group would have zero
  variance and our learner would skip the whole update (TRL would not), which would not be a like-for-like step.
- Task: one turn of Maze2D (size 7, 16 px cells): system instructions + the maze image; reward 1 if the parsed action
  is the first move of the BFS solution (:func:`first_move_reward`, the same function for both sides).
- Same mazes per step on both sides (``TrainingSampler(seed 0)``, step ``k`` -> mazes ``(k, 0..M-1)``), group size
  G, M*G samples per step, LoRA rank/alpha/targets, learning rate, clip range (0.2 / 0.28), token-mean ("dapo")
  loss, group-std advantages, no KL, temperature 1, top-p 1, no top-k, ``max tokens`` per reply, the same vision
  special tokens suppressed, fp32, one optimizer step per generation batch.
- TRL: ``GRPOTrainer`` with the transformers generation path, ``gradient_checkpointing=False`` and ``bf16=False``
  (GRPOConfig's defaults are True; both would only slow TRL down on CPU and our learner uses neither).
- Ours: the production classes without Ray: ``Learner.adapter_state`` + ``TransformersEngine.load_adapter`` (sync),
  ``RolloutWorker.rollout`` (``run_episodes`` with ``maxTurns: 1``), the reward, ``Learner.update``.
- Interleaving: a ``TrainerCallback`` runs one of our steps at each TRL ``on_step_end``, so step k of both sides
  runs back to back under the same machine load. TRL's step time is the wall time between its step boundaries minus
  the time our step took in between (all of TRL's own work: data loading, generation, scoring, loss, optimizer).
  The first ``--warmup`` pairs are discarded. TRL's generation time is read by a timing wrapper around
  ``GRPOTrainer._generate`` (it calls the original unchanged).

Part 2, multi-turn, ``daedalus_trainer.grpo.Trainer`` on a local Ray (``--mt-steps`` steps of 2 mazes x G=8 episodes
by default (a smaller batch than part 1 keeps the run within minutes), size-7 mazes with the
automatic turn limit, checkpoint every 2 steps, ``klCoef`` 1e-3 so that the learner trains on every episode even
though the briefly-SFT'd policy rarely solves a maze): env steps/s, generated tokens/s, and the split rollout /
learner / sync / checkpoint from the trainer's own step records and Prometheus histograms. Sync (adapter_state +
load_adapter) is inside the rollout time on Ray; its in-process value is taken from part 1.

Final line: ``trainer_vs_trl: <ours> samples/s (TRL 1.16 GRPOTrainer: <trl> samples/s, <ratio>x)``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lib"))

import torch  # noqa: E402

from benchutil import figure_line, print_load, summarize  # noqa: E402

ACTION_FORMAT = "function"


def job_dict(args, *, sft_dir: str | None, tiny_dir: str, max_turns: int, steps: int = 100,
             kl_coef: float = 0.0) -> dict:
    """The RLTrainingJob both sides are configured from."""
    return {
        "apiVersion": "daedalus.dev/v1alpha1", "kind": "RLTrainingJob", "metadata": {"name": "bench"},
        "spec": {
            "model": {"tiny": True, "path": tiny_dir, **({"sftAdapter": sft_dir} if sft_dir else {})},
            "lora": {"rank": args.rank, "alpha": 2 * args.rank, "dropout": 0.0, "targetModules": args.targets},
            "algorithm": {"groupSize": args.group, "mazesPerStep": args.mazes, "learningRate": args.lr,
                          "temperature": 1.0, "topP": 1.0, "maxTokensPerTurn": args.max_tokens, "klCoef": kl_coef,
                          "clipRatioLow": 0.2, "clipRatioHigh": 0.28, "lossAggregation": "token-mean",
                          "advantageNorm": "group-std", "steps": steps, "seed": 0},
            "environment": {"size": 7, "maxTurns": max_turns, "observation": "image", "historyTurns": 1,
                            "actionFormat": ACTION_FORMAT, "successOn": "stop-on-goal", "cellPixels": 16,
                            "evalMazes": 16},
            "sft": {"steps": args.sft_steps, "maxSeconds": 0, "batchSize": 32, "learningRate": 1e-3},
            "checkpoint": {"intervalSteps": 2, "keep": 2},
        },
    }


def first_move_reward(text: str, maze) -> float:
    """Single-turn reward: 1.0 when ``text`` parses (strict parser) to the first move of the BFS solution, else 0."""
    from daedalus_trainer.envs import parse_action, solve

    parsed = parse_action(text, ACTION_FORMAT)
    return 1.0 if parsed.ok and parsed.action == solve(maze)[0] else 0.0


def prepare_model(args, work: Path) -> tuple[Path, Path]:
    """Build the tiny base checkpoint and SFT it briefly; return ``(tiny_dir, sft_model_dir)``."""
    from daedalus_trainer.config import RLTrainingJob
    from daedalus_trainer.sft import run_sft
    from daedalus_trainer.tiny import build_tiny_checkpoint

    tiny_dir = build_tiny_checkpoint(work / "tiny")
    job = RLTrainingJob.model_validate(job_dict(args, sft_dir=None, tiny_dir=str(tiny_dir), max_turns=1))
    t0 = time.perf_counter()
    sft_dir = run_sft(job, work / "sft", resume=False, progress=False, final_eval=False)
    print(f"setup: tiny checkpoint + {args.sft_steps} SFT steps in {time.perf_counter() - t0:.1f} s -> {sft_dir}",
          flush=True)
    return tiny_dir, Path(sft_dir)


def single_turn_prompts(job, steps: int):
    """Per step the M mazes and their single-turn prompt (messages, image) exactly as ``run_episodes`` builds them."""
    from daedalus_trainer.layouts import TrainingSampler
    from daedalus_trainer.prompts import PromptSettings, build_conversation
    from daedalus_trainer.rollout.episode import make_env

    env_spec, algo = job.spec.environment, job.spec.algorithm
    settings = PromptSettings.from_env(env_spec)
    sampler = TrainingSampler.for_env(env_spec, seed=algo.seed)
    out = []
    for step in range(steps):
        rows = []
        for maze in sampler.mazes(step, algo.mazes_per_step):
            obs, _ = make_env(env_spec).reset(options={"maze": maze})
            messages, images = build_conversation([obs], [], settings)
            rows.append((maze, messages, images))
        out.append(rows)
    return out


def trl_dataset(prompts_by_step):
    """A ``datasets.Dataset`` in TRL's vision-language format: ``prompt`` (messages with an image placeholder),
    ``image`` (PIL), and the maze's solution as reward context. Row order = step order (no shuffling)."""
    from datasets import Dataset

    from daedalus_trainer.envs import solve
    from daedalus_trainer.policy import to_pil

    rows = []
    for step_rows in prompts_by_step:
        for maze, messages, images in step_rows:
            # Arrow needs one content type per column: string contents become one text part (same rendering).
            msgs = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]
                     if isinstance(m["content"], str) else m["content"]} for m in messages]
            rows.append({"prompt": msgs, "image": to_pil(images[0]), "first_move": solve(maze)[0],
                         "maze_ascii": maze_ascii(maze)})
    return Dataset.from_list(rows)


def maze_ascii(maze) -> str:
    """The maze as text (for TRL's reward kwargs, which must be Arrow-serialisable)."""
    from daedalus_trainer.envs import render_ascii

    return render_ascii(maze, maze.start)


def check_same_prompt_tokens(processor, prompts_by_step) -> int:
    """Prompt token ids through TRL's path (``prepare_multimodal_messages`` + ``apply_chat_template(tokenize=True)``)
    and ours (:func:`daedalus_trainer.prompts.encode_prompt`) for the first prompt; returns the length.

    Raises:
        AssertionError: the two differ (the comparison would not be like for like).
    """
    from trl.data_utils import prepare_multimodal_messages

    from daedalus_trainer.policy import to_pil
    from daedalus_trainer.prompts import encode_prompt

    maze, messages, images = prompts_by_step[0][0]
    ours = encode_prompt(processor, messages, images)
    msgs = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]
             if isinstance(m["content"], str) else [dict(p) for p in m["content"]]} for m in messages]
    msgs = prepare_multimodal_messages(msgs, images=[to_pil(images[0])])
    theirs = processor.apply_chat_template(conversation=[msgs], add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"][0]
    theirs = theirs.tolist() if hasattr(theirs, "tolist") else list(theirs)
    assert ours == theirs, f"prompt tokens differ: ours {len(ours)} vs TRL {len(theirs)}"
    return len(ours)


class OurStep:
    """One production GRPO step in-process: sync -> rollout -> reward -> learner update (timed parts, seconds)."""

    def __init__(self, job, prompts_by_step, work: Path):
        from daedalus_trainer.actors import Learner, RolloutWorker

        self.job = job
        self.prompts = prompts_by_step
        self.worker = RolloutWorker(job, None, work_dir=str(work))
        self.learner = Learner(job, None, work_dir=str(work))
        self.version = 0
        self.records: list[dict] = []

    def run(self, step: int) -> dict:
        from daedalus_trainer.grpo import step_seed

        algo = self.job.spec.algorithm
        mazes = [maze for maze, _, _ in self.prompts[step]]
        episodes = [m for m in mazes for _ in range(algo.group_size)]
        t0 = time.perf_counter()
        adapter = self.learner.adapter_state()
        self.worker.engine.load_adapter(adapter, self.version)  # what RolloutWorker.rollout does on a new version
        self.worker.loaded_version = self.version
        t1 = time.perf_counter()
        trajectories = self.worker.rollout(episodes, step_seed(algo.seed, step, 0), adapter, self.version)
        t2 = time.perf_counter()
        for traj in trajectories:
            traj.reward = first_move_reward(traj.turns[0].text, traj.maze)
        t3 = time.perf_counter()
        update = self.learner.update(trajectories, algo.group_size)
        t4 = time.perf_counter()
        self.version += 1
        rec = {"step": step, "total": t4 - t0, "sync": t1 - t0, "rollout": t2 - t1, "reward": t3 - t2,
               "learner": t4 - t3, "samples": len(trajectories),
               "tokens": sum(len(tr.turns[0].completion_ids) for tr in trajectories),
               "reward_mean": sum(tr.reward for tr in trajectories) / len(trajectories),
               "zero_var_frac": update.zero_variance_groups / algo.mazes_per_step, "skipped": update.skipped}
        self.records.append(rec)
        return rec


def run_side_by_side(args, tiny_dir: Path, sft_dir: Path, work: Path) -> dict:
    """Part 1. Returns the summaries."""
    from peft import LoraConfig
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from daedalus_trainer.checkpoint import AdapterState, CheckpointManager, TrainerState
    from daedalus_trainer.config import RLTrainingJob
    from daedalus_trainer.policy import load_pretrained

    total_steps = args.warmup + args.repeats
    job = RLTrainingJob.model_validate(job_dict(args, sft_dir=str(sft_dir), tiny_dir=str(tiny_dir), max_turns=1))
    algo = job.spec.algorithm
    prompts_by_step = single_turn_prompts(job, total_steps)
    ours = OurStep(job, prompts_by_step, work)
    prompt_len = check_same_prompt_tokens(ours.worker.engine.policy.processor, prompts_by_step)
    print(f"part 1: {algo.mazes_per_step} mazes x G={algo.group_size} = {algo.mazes_per_step * algo.group_size} "
          f"samples/step, prompt {prompt_len} tokens (identical token ids on both sides), LoRA r={args.rank} on "
          f"{','.join(args.targets)}, max {args.max_tokens} new tokens; {args.warmup} warm-up + {args.repeats} "
          "measured step pairs", flush=True)

    policy = load_pretrained(sft_dir, "float32", "cpu")
    maze_by_ascii = {maze_ascii(m): m for rows in prompts_by_step for m, _, _ in rows}

    def reward(prompts, completions, maze_ascii, **kwargs):  # TRL reward-function signature
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [first_move_reward(t, maze_by_ascii[a]) for t, a in zip(texts, maze_ascii)]

    config = GRPOConfig(
        output_dir=str(work / "trl"), per_device_train_batch_size=algo.mazes_per_step * algo.group_size,
        num_generations=algo.group_size, max_completion_length=algo.max_tokens_per_turn, learning_rate=algo.learning_rate,
        beta=0.0, epsilon=algo.clip_ratio_low, epsilon_high=algo.clip_ratio_high, loss_type="dapo",
        scale_rewards="group", num_iterations=1, temperature=algo.temperature, top_p=algo.top_p, top_k=0,
        generation_kwargs={"suppress_tokens": policy.suppressed_token_ids}, max_grad_norm=algo.max_grad_norm,
        weight_decay=algo.weight_decay, lr_scheduler_type="constant", warmup_steps=0, max_steps=total_steps,
        gradient_checkpointing=False, bf16=False, use_cpu=True, shuffle_dataset=False, dataloader_num_workers=0,
        logging_steps=10**6, save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
    )
    lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, target_modules=list(args.targets),
                      bias="none")
    pairs: list[dict] = []

    class Interleave(TrainerCallback):
        """At each TRL step end: record TRL's step time, then run our step k (same mazes)."""

        def __init__(self):
            self.boundary = None
            self.gen = 0.0

        def on_step_begin(self, a, state, control, **kw):
            if self.boundary is None:
                self.boundary = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            trl_seconds = time.perf_counter() - self.boundary
            step = state.global_step - 1
            metrics = trainer._metrics["train"]
            trl = {"total": trl_seconds, "generate": self.gen,
                   "reward_mean": float(metrics["reward"][-1]),
                   "zero_var_frac": float(metrics["frac_reward_zero_std"][-1]),
                   "tokens_per_sample": float(metrics["completions/mean_length"][-1])}
            self.gen = 0.0
            rec = ours.run(step)
            pairs.append({"step": step, "trl": trl, "ours": rec})
            print(f"  step {step}{' (warm-up)' if step < args.warmup else ''}: TRL {trl_seconds:.3f} s "
                  f"(generate {trl['generate']:.3f}), ours {rec['total']:.3f} s (rollout {rec['rollout']:.3f}, "
                  f"learner {rec['learner']:.3f}, sync {rec['sync']:.4f}); reward TRL {trl['reward_mean']:.2f} / "
                  f"ours {rec['reward_mean']:.2f}", flush=True)
            self.boundary = time.perf_counter()

    callback = Interleave()
    torch.manual_seed(0)
    trainer = GRPOTrainer(model=policy.model, reward_funcs=reward, args=config, train_dataset=trl_dataset(prompts_by_step),
                          processing_class=policy.processor, peft_config=lora, callbacks=[callback])
    original_generate = trainer._generate

    def timed_generate(*a, **kw):  # instrumentation only: calls TRL's method unchanged
        t = time.perf_counter()
        try:
            return original_generate(*a, **kw)
        finally:
            callback.gen += time.perf_counter() - t

    trainer._generate = timed_generate
    trainer.remove_callback(PrinterCallback)  # no log dict printed at the end of train()
    trainer.train()

    # Checkpoint of the in-process learner (tiny adapter + AdamW state), through the production manager.
    manager = CheckpointManager(work / "ckpt-inprocess", keep=2)
    ckpt_seconds = []
    for i in range(5):
        t = time.perf_counter()
        adapter, cfg, optim = ours.learner.checkpoint_state()
        info = manager.save(100 + i, AdapterState(adapter, cfg), optim, TrainerState(sampler={"next_step": 100 + i}))
        ckpt_seconds.append(time.perf_counter() - t)

    measured = [p for p in pairs if p["step"] >= args.warmup]
    samples = algo.mazes_per_step * algo.group_size
    s = {
        "samples": samples,
        "pairs": len(measured),
        "trl_step": summarize([p["trl"]["total"] for p in measured]),
        "trl_generate": summarize([p["trl"]["generate"] for p in measured]),
        "our_step": summarize([p["ours"]["total"] for p in measured]),
        "our_rollout": summarize([p["ours"]["rollout"] for p in measured]),
        "our_learner": summarize([p["ours"]["learner"] for p in measured]),
        "our_sync": summarize([p["ours"]["sync"] for p in measured]),
        "our_reward": summarize([p["ours"]["reward"] for p in measured]),
        "pair_ratio": summarize([p["trl"]["total"] / p["ours"]["total"] for p in measured]),
        "trl_reward": summarize([p["trl"]["reward_mean"] for p in measured]),
        "our_reward_mean": summarize([p["ours"]["reward_mean"] for p in measured]),
        "trl_zero_var": summarize([p["trl"]["zero_var_frac"] for p in measured]),
        "our_zero_var": summarize([p["ours"]["zero_var_frac"] for p in measured]),
        "trl_tokens": summarize([p["trl"]["tokens_per_sample"] for p in measured]),
        "our_tokens": summarize([p["ours"]["tokens"] / p["ours"]["samples"] for p in measured]),
        "our_skipped": sum(p["ours"]["skipped"] for p in measured),
        "checkpoint": summarize(ckpt_seconds),
        "checkpoint_bytes": info.bytes,
    }
    return s


def run_multi_turn(args, tiny_dir: Path, sft_dir: Path, work: Path) -> dict | None:
    """Part 2: ``grpo.Trainer`` on a local Ray, multi-turn episodes. Returns per-step figures or None on failure."""
    import ray

    from daedalus_trainer.config import RLTrainingJob
    from daedalus_trainer.grpo import Trainer, init_ray

    # klCoef > 0: the briefly-SFT'd policy almost never solves a whole maze, so every group would have zero reward
    # variance and the learner would skip every update; with a KL term it processes every episode (plus a reference
    # forward), which is the upper bound of the learner's cost.
    mt_args = argparse.Namespace(**{**vars(args), "mazes": args.mt_mazes, "group": args.mt_group})
    job = RLTrainingJob.model_validate(job_dict(mt_args, sft_dir=str(sft_dir), tiny_dir=str(tiny_dir), max_turns=0,
                                                steps=args.mt_steps, kl_coef=args.mt_kl))
    records: list[dict] = []
    marks: list[float] = []
    t_start = time.perf_counter()
    init_ray(local=True)
    ray_seconds = time.perf_counter() - t_start

    def on_step(rec):
        marks.append(time.perf_counter())
        records.append(rec)
        print(f"  multi-turn step {rec['step']}: rollout {rec['rollout_seconds']:.2f} s, learner "
              f"{rec['learner_seconds']:.2f} s, {rec['episode_turns']:.1f} turns/episode, {rec['rollout_tokens']} "
              f"tokens, success {rec['success_ratio']:.2f}", flush=True)

    trainer = Trainer(job, work / "mt-run", start_dir=str(sft_dir), work_dir=work / "mt-work", on_step=on_step)
    t0 = time.perf_counter()
    try:
        result = trainer.train(resume="none")
    finally:
        ray.shutdown()
    wall = time.perf_counter() - t0
    labels = {"job": trainer.metrics.job, "namespace": trainer.metrics.namespace}
    reg = trainer.metrics.registry
    ck_sum = reg.get_sample_value("daedalus_checkpoint_save_seconds_sum", labels) or 0.0
    ck_count = reg.get_sample_value("daedalus_checkpoint_save_seconds_count", labels) or 0.0
    episodes = job.spec.algorithm.mazes_per_step * job.spec.algorithm.group_size
    # Skip the first step (actor warm-up) when there are enough steps.
    use = records[1:] if len(records) > 2 else records
    env_steps = [r["episode_turns"] * episodes for r in use]
    step_wall = [b - a for a, b in zip(marks, marks[1:])] if len(marks) > 2 else [r["rollout_seconds"] + r["learner_seconds"] for r in use]
    return {
        "steps": result.steps_done, "wall": wall, "ray_init": ray_seconds,
        "rollout": summarize([r["rollout_seconds"] for r in use]),
        "learner": summarize([r["learner_seconds"] for r in use]),
        "turns": summarize([r["episode_turns"] for r in use]),
        "env_steps_per_s": summarize([e / r["rollout_seconds"] for e, r in zip(env_steps, use)]),
        "tokens_per_s": summarize([r["rollout_tokens"] / r["rollout_seconds"] for r in use]),
        "step_wall": summarize(step_wall),
        "env_steps_per_s_wall": summarize([e / w for e, w in zip(env_steps[-len(step_wall):], step_wall)]),
        "checkpoint_mean": ck_sum / ck_count if ck_count else float("nan"), "checkpoints": int(ck_count),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mazes", type=int, default=4, help="mazes per step (M)")
    p.add_argument("--group", type=int, default=8, help="group size (G); samples per step = M*G")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2*rank)")
    p.add_argument("--targets", nargs="+",
                   default=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    p.add_argument("--max-tokens", type=int, default=12, help="max new tokens per reply")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--sft-steps", type=int, default=120,
                   help="SFT steps before GRPO (format + reward variance; 40 no longer gave parseable replies after "
                        "the SFT changes of sessions 5-8: every reward 0)")
    p.add_argument("--warmup", type=int, default=2, help="step pairs discarded")
    p.add_argument("--repeats", type=int, default=8, help="measured step pairs (>= 5)")
    p.add_argument("--mt-steps", type=int, default=6,
                   help="multi-turn Trainer steps on local Ray, the first is warm-up (0 skips part 2)")
    p.add_argument("--mt-mazes", type=int, default=2, help="mazes per step of the multi-turn part")
    p.add_argument("--mt-group", type=int, default=8, help="group size of the multi-turn part")
    p.add_argument("--mt-kl", type=float, default=1e-3, help="klCoef of the multi-turn part (see run_multi_turn)")
    args = p.parse_args(argv)
    if args.repeats < 5:
        p.error("--repeats must be >= 5")

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    import trl

    print_load("start")
    print(f"torch {torch.__version__}, trl {trl.__version__}, threads {torch.get_num_threads()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="daedalus-bench-") as tmp:
        work = Path(tmp)
        tiny_dir, sft_dir = prepare_model(args, work)
        s = run_side_by_side(args, tiny_dir, sft_dir, work)
        print_load("after part 1")
        mt = None
        if args.mt_steps > 0:
            print(f"part 2: grpo.Trainer on local Ray, {args.mt_steps} multi-turn steps of {args.mt_mazes} mazes x "
                  f"G={args.mt_group}", flush=True)
            try:
                mt = run_multi_turn(args, tiny_dir, sft_dir, work)
            except Exception as e:  # report, do not hide part 1's figures
                print(f"part 2 failed: {type(e).__name__}: {e}", flush=True)
        print_load("end")

    n = s["samples"]
    ours_sps, trl_sps = n / s["our_step"].median, n / s["trl_step"].median
    print("\n== single-turn GRPO step, side by side (median [min, max] over measured pairs) ==")
    print(f"ours step time      {s['our_step'].fmt(3, 's')}")
    print(f"  rollout           {s['our_rollout'].fmt(3, 's')}")
    print(f"  learner update    {s['our_learner'].fmt(3, 's')}")
    print(f"  sync (adapter)    {s['our_sync'].fmt(4, 's')}")
    print(f"  reward            {s['our_reward'].fmt(4, 's')}")
    print(f"TRL step time       {s['trl_step'].fmt(3, 's')}")
    print(f"  generate          {s['trl_generate'].fmt(3, 's')}")
    print(f"per-pair TRL/ours   {s['pair_ratio'].fmt(2, 'x')}")
    print(f"samples/s           ours {ours_sps:.1f}  TRL {trl_sps:.1f}  "
          f"(min/max ours {n / s['our_step'].max:.1f}/{n / s['our_step'].min:.1f}, "
          f"TRL {n / s['trl_step'].max:.1f}/{n / s['trl_step'].min:.1f})")
    print(f"reward mean         ours {s['our_reward_mean'].median:.2f}  TRL {s['trl_reward'].median:.2f}")
    print(f"zero-var groups     ours {s['our_zero_var'].median:.2f}  TRL {s['trl_zero_var'].median:.2f} "
          f"(ours skips them; skipped whole updates: {s['our_skipped']})")
    print(f"tokens/sample       ours {s['our_tokens'].median:.1f}  TRL {s['trl_tokens'].median:.1f}")
    print(f"checkpoint (in-process, {s['checkpoint_bytes']} bytes) {s['checkpoint'].fmt(3, 's')}")
    if mt:
        print("\n== multi-turn, grpo.Trainer on local Ray (steps after the first) ==")
        print(f"steps {mt['steps']} in {mt['wall']:.1f} s (ray init {mt['ray_init']:.1f} s), "
              f"{mt['turns'].median:.1f} turns/episode")
        print(f"rollout             {mt['rollout'].fmt(2, 's')}")
        print(f"learner             {mt['learner'].fmt(2, 's')}")
        print(f"step wall           {mt['step_wall'].fmt(2, 's')}")
        print(f"checkpoint          {mt['checkpoint_mean']:.3f} s mean over {mt['checkpoints']} saves "
              f"(every 2 steps)")
        print(f"sync (in-process)   {s['our_sync'].median:.4f} s (inside rollout on Ray)")
        parts = {"rollout": mt["rollout"].median - s["our_sync"].median, "learner": mt["learner"].median,
                 "sync": s["our_sync"].median, "checkpoint": mt["checkpoint_mean"] / 2}
        total = sum(parts.values())
        print("time split per step " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in parts.items()))
        print(f"env steps/s         {mt['env_steps_per_s'].fmt(1)} during rollout; "
              f"{mt['env_steps_per_s_wall'].median:.1f} over the whole step")
        print(f"tokens/s            {mt['tokens_per_s'].fmt(1)} generated during rollout")
    print()
    if s["our_skipped"]:
        # every group had equal rewards in some step: our learner skipped that update and TRL did not, so the step
        # times are not like for like (a too-short SFT whose replies do not parse gives reward 0 everywhere)
        print(f"trainer_vs_trl: no figure: our learner skipped {s['our_skipped']} of {s['pairs']} measured updates "
              f"(every group's rewards equal; reward mean {s['our_reward_mean'].median:.2f}); raise --sft-steps "
              f"(now {args.sft_steps})", file=sys.stderr)
        return 1
    print(figure_line("trainer_vs_trl", ours_sps, "samples/s", "TRL 1.16 GRPOTrainer", trl_sps, ours_sps / trl_sps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
