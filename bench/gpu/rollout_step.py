"""GPU benchmark: a random-weight Qwen3-VL-8B-shaped checkpoint, multi-turn maze rollouts with a LoRA adapter (vLLM
when it is importable, else the transformers engine), and a GRPO learner step; prints tokens/s and step time.

Run through ``bench/gpu.sh`` (which sets ``PYTHONPATH``, installs carried wheels and enforces the 10-minute limit), or
directly: ``PYTHONPATH=trainer python3 bench/gpu/rollout_step.py [--scale 8b|tiny] [--engine auto|vllm|transformers]``.
``--scale tiny --device cpu`` is a dry run of the same code path on the CPU machine (used to test this script).

Steps (each timed):

1. Build the checkpoint on the device: Qwen3-VL-8B-Instruct's geometry (text: 36 layers, hidden 4096, intermediate
   12288, 32 heads / 8 KV heads x 128, vocab 151936, M-RoPE [24, 20, 20], rope theta 5e6; vision: 27 blocks, hidden
   1152, intermediate 4304, 16 heads, deepstack [8, 16, 24], 2304 position embeddings; sources in
   ``bench/checkpoint.py``), random bf16 weights, the project's locally built tokenizer and processor
   (:mod:`daedalus_trainer.tiny`, its vocabulary filled up to 151,936 decodable ids by :func:`extend_vocab`; Qwen's
   image settings: mean/std 0.5, at least 256x256 px per image), saved with
   ``save_pretrained`` so vLLM and transformers load it like a real checkpoint.
2. Rollout engine: :class:`daedalus_trainer.rollout.vllm_engine.VLLMEngine` (vLLM ``LLM(enable_lora=True)``, started
   before the learner so that its memory share is free), or, where vLLM is not importable, :class:`TransformersEngine`
   on the learner's own policy.
3. Learner: :class:`daedalus_trainer.actors.Learner` (rank-32 LoRA on q/k/v/o/gate/up/down, AdamW) loads the
   checkpoint on the GPU.
4. Per step: sync (the adapter as a PEFT directory at first, then ``Learner.adapter_state()`` -> engine
   ``load_adapter``), rollout (``run_episodes``: M mazes x G
   episodes, size-9 mazes, 25 px cells, ``--max-turns`` turns), learner update (``Learner.update``). A random model
   never solves a maze, so every group would have zero reward variance and the update would be skipped: rewards are
   replaced by a fixed 0/1 pattern within each group, so that the update does its full work.

Output: a line per step, then ``gpu_step: <s> s (anchor ...)`` and, last, ``gpu_rollout: <tokens/s> tokens/s
(weight-streaming bound ...)``; ``$OUT/gpu_bench.json`` (or ``--json``) holds every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

#: Qwen3-VL-8B-Instruct's text_config.vocab_size (embedding and lm_head rows).
QWEN3_VL_VOCAB = 151936
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: Measured on this workplace's H200 (KINDS.md, 2026-10-28): device-to-device copy ~4.3 TB/s (read + write).
H200_COPY_BYTES_PER_S = 4.3e12


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def spec_for(scale: str):
    """The :class:`daedalus_trainer.tiny.TinySpec` of the checkpoint: Qwen3-VL-8B geometry, or the tiny one."""
    from daedalus_trainer.tiny import TinySpec

    qwen_image = dict(image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5), min_pixels=256 * 256,
                      max_pixels=1024 * 1024)
    if scale == "tiny":
        return TinySpec(**qwen_image)
    return TinySpec(
        text_hidden=4096, text_layers=36, text_heads=32, text_kv_heads=8, head_dim=128, text_intermediate=12288,
        mrope_section=(24, 20, 20), rope_theta=5_000_000.0, max_position_embeddings=262144,
        vision_depth=27, vision_hidden=1152, vision_heads=16, vision_intermediate=4304, deepstack_indexes=(8, 16, 24),
        num_position_embeddings=2304, **qwen_image,
    )


def build_checkpoint(out: Path, scale: str, device: str) -> dict:
    """Write a random-weight checkpoint to ``out``; returns figures (parameters, bytes, seconds)."""
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    from daedalus_trainer import tiny

    t0 = time.perf_counter()
    spec = spec_for(scale)
    tokenizer = extend_vocab(tiny.train_tokenizer(spec), QWEN3_VL_VOCAB)
    image_processor = tiny.build_image_processor(spec)
    try:  # the real processor class (vLLM loads it) needs a video processor, which needs torchvision (GPU image)
        import torchvision  # noqa: F401
        from transformers import Qwen3VLProcessor
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

        processor = Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                     video_processor=Qwen3VLVideoProcessor(), chat_template=tiny.CHAT_TEMPLATE)
    except Exception as e:  # CPU machine without torchvision: the image-only processor
        log(f"processor: image-only TinyQwen3VLProcessor ({type(e).__name__}: {e})")
        processor = tiny.TinyQwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                              chat_template=tiny.CHAT_TEMPLATE)
    config = tiny.build_config(spec, tokenizer)
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    config.text_config.dtype = config.dtype = str(dtype).removeprefix("torch.")
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            model = Qwen3VLForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(old)
    model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids(tiny.IM_END)]
    model.generation_config.pad_token_id = tokenizer.convert_tokens_to_ids(tiny.ENDOFTEXT)
    model.generation_config.bos_token_id = None
    if device != "cpu":
        torch.cuda.synchronize()
    built = time.perf_counter() - t0
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out)
    processor.save_pretrained(out)
    saved = time.perf_counter() - t0 - built
    del model
    if device != "cpu":
        torch.cuda.empty_cache()
    nbytes = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    return {"parameters": n_params, "weight_bytes": nbytes, "build_s": built, "save_s": saved,
            "tokenizer_size": len(tokenizer), "vocab_size": config.text_config.vocab_size}


def extend_vocab(tokenizer, size: int):
    """The tokenizer with its BPE vocabulary filled up to ``size`` ids with unused byte-level strings.

    The random model samples from its whole 151,936-id vocabulary (the real Qwen3-VL size, which sets the lm_head cost),
    while the locally trained tokenizer knows a few hundred tokens; vLLM's detokenizer fails or logs an error per token
    for an id the tokenizer cannot map. Filler entries (3-character strings of the byte-level alphabet, no merges lead
    to them) make every id decodable without changing how any text is encoded.
    """
    import itertools
    import json

    from tokenizers import Tokenizer, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from daedalus_trainer import tiny

    doc = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = doc["model"]["vocab"]
    taken = set(vocab) | {a["content"] for a in doc["added_tokens"]}
    next_id = max([*vocab.values(), *(a["id"] for a in doc["added_tokens"])]) + 1
    for combo in itertools.product(sorted(pre_tokenizers.ByteLevel.alphabet()), repeat=3):
        if next_id >= size:
            break
        piece = "".join(combo)
        if piece not in taken:
            vocab[piece] = next_id
            next_id += 1
    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(doc)), eos_token=tiny.IM_END, pad_token=tiny.ENDOFTEXT,
        padding_side="left", additional_special_tokens=list(tiny.SPECIAL_TOKENS[1:]), chat_template=tiny.CHAT_TEMPLATE,
    )
    if len(fast) != size or fast.convert_tokens_to_ids(list(tiny.SPECIAL_TOKENS)) != list(range(len(tiny.SPECIAL_TOKENS))):
        raise RuntimeError(f"vocabulary extension failed: {len(fast)} tokens")
    return fast


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", choices=["8b", "tiny"], default="8b")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--engine", choices=["auto", "vllm", "transformers"], default="auto")
    p.add_argument("--mazes", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=8, help="learner sequences per forward/backward")
    p.add_argument("--steps", type=int, default=2, help="measured steps (skipped when the time budget runs short)")
    p.add_argument("--budget-s", type=float, default=540.0, help="stop starting new steps after this many seconds")
    p.add_argument("--gpu-mem", type=float, default=0.40, help="vLLM gpu_memory_utilization")
    p.add_argument("--vllm-eager", action="store_true", help="vLLM enforce_eager (no compile / CUDA graphs: faster "
                   "start, slower decode)")
    p.add_argument("--work", default=None, help="where the checkpoint is written (default: a temp dir)")
    p.add_argument("--json", default=None, help="figures as JSON (default: $OUT/gpu_bench.json when OUT is set)")
    args = p.parse_args(argv)
    started = time.perf_counter()

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu" and args.scale == "8b":
        p.error("no GPU: the 8B-shaped checkpoint needs one (~18 GB in bf16); use --scale tiny --device cpu for a "
                "dry run of the same code path")
    if device == "cpu":
        torch.set_num_threads(1)
    figures: dict = {"scale": args.scale, "device": device, "torch": torch.__version__}
    if device != "cpu":
        props = torch.cuda.get_device_properties(0)
        figures["gpu"] = f"{props.name}, {props.total_memory / 2**30:.0f} GiB"
    import transformers

    figures["transformers"] = transformers.__version__
    log(f"device {figures.get('gpu', device)}, torch {torch.__version__}, transformers {transformers.__version__}")

    from daedalus_trainer.actors import Learner
    from daedalus_trainer.config import RLTrainingJob
    from daedalus_trainer.grpo import step_seed
    from daedalus_trainer.layouts import TrainingSampler
    from daedalus_trainer.rollout.engine import SamplingParams, TransformersEngine
    from daedalus_trainer.rollout.episode import run_episodes

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="daedalus-gpu-bench-"))
    if not args.work:
        import atexit
        import shutil

        atexit.register(shutil.rmtree, work, ignore_errors=True)  # the checkpoint is ~18 GB at 8B scale
    ckpt = work / f"qwen3-vl-{args.scale}-random"
    ckpt.mkdir(parents=True, exist_ok=True)
    out = args.json or (str(Path(os.environ["OUT"]) / "gpu_bench.json") if os.environ.get("OUT") else None)

    def dump() -> None:
        """Write the figures so far (after each stage: a run stopped by a timeout still leaves what it measured)."""
        if out:
            Path(out).write_text(json.dumps(figures, indent=2, default=str) + "\n")

    figures["checkpoint"] = build_checkpoint(ckpt, args.scale, device)
    dump()
    c = figures["checkpoint"]
    log(f"checkpoint: {c['parameters'] / 1e9:.2f} B parameters, {c['weight_bytes'] / 1e9:.1f} GB, built in "
        f"{c['build_s']:.1f} s, saved in {c['save_s']:.1f} s -> {ckpt}")

    job = RLTrainingJob.model_validate({
        "apiVersion": "daedalus.dev/v1alpha1", "kind": "RLTrainingJob", "metadata": {"name": "gpu-bench"},
        "spec": {
            "model": {"name": "random/qwen3-vl-8b-shaped", "path": str(ckpt),
                      "dtype": "bfloat16" if device != "cpu" else "float32"},
            "lora": {"rank": args.rank, "alpha": 2 * args.rank, "targetModules": TARGETS},
            "algorithm": {"groupSize": args.group, "mazesPerStep": args.mazes, "learningRate": 1e-5,
                          "temperature": 1.0, "maxTokensPerTurn": args.max_tokens, "steps": 10, "seed": 0},
            "environment": {"size": 9, "maxTurns": args.max_turns, "cellPixels": 25, "evalMazes": 16},
        },
    })
    algo, env_spec = job.spec.algorithm, job.spec.environment
    n_episodes = algo.mazes_per_step * algo.group_size

    engine = None
    figures["engine"] = "transformers"
    if args.engine in ("auto", "vllm") and device != "cpu":
        t = time.perf_counter()
        try:
            import vllm

            from daedalus_trainer.rollout.vllm_engine import VLLMEngine

            engine = VLLMEngine(ckpt, history_turns=env_spec.history_turns, max_lora_rank=args.rank,
                                gpu_memory_utilization=args.gpu_mem, max_model_len=8192, seed=0,
                                adapter_dir=work / "adapters", max_num_seqs=n_episodes,
                                enforce_eager=args.vllm_eager)
            figures["engine"] = f"vllm {vllm.__version__}"
            figures["engine_start_s"] = time.perf_counter() - t
            log(f"engine: vLLM {vllm.__version__} started in {figures['engine_start_s']:.1f} s")
        except Exception as e:
            if args.engine == "vllm":
                raise
            log(f"engine: vLLM unavailable ({type(e).__name__}: {e}); using the transformers engine")
            figures["vllm_error"] = f"{type(e).__name__}: {e}"

    t = time.perf_counter()
    learner = Learner(job, None, str(work), micro_batch=args.micro_batch)
    figures["learner_load_s"] = time.perf_counter() - t
    dump()
    log(f"learner: loaded in {figures['learner_load_s']:.1f} s, "
        f"{sum(p.numel() for p in learner.params) / 1e6:.1f} M trainable LoRA parameters")
    if engine is None:
        engine = TransformersEngine(learner.policy, max_batch=n_episodes)  # shares the learner's weights

    def sync(version: int) -> float:
        """Publish the learner's adapter to the engine as in the trainer: PEFT directory first, then state dicts."""
        t0 = time.perf_counter()
        if isinstance(engine, TransformersEngine):
            engine.adapter_version = version  # same policy object: nothing to copy
        elif version == 0:
            engine.load_adapter(learner.save_adapter(str(work / "adapter-v0")), 0)
        else:
            engine.load_adapter(learner.adapter_state(), version)
        return time.perf_counter() - t0

    def cuda_sync():
        if device != "cpu":
            torch.cuda.synchronize()

    sampler = TrainingSampler.for_env(env_spec, seed=algo.seed)
    sampling = SamplingParams(algo.temperature, algo.top_p, algo.max_tokens_per_turn)
    sync(0)
    t = time.perf_counter()
    with torch.no_grad():
        run_episodes(engine, sampler.mazes(10_000, algo.mazes_per_step), env_spec, sampling, seed=1)  # warm-up
    cuda_sync()
    figures["warmup_s"] = time.perf_counter() - t
    log(f"warm-up rollout ({algo.mazes_per_step} episodes): {figures['warmup_s']:.1f} s")

    steps = []
    for step in range(args.steps):
        if step > 0 and time.perf_counter() - started > args.budget_s:
            log(f"time budget reached: {step} step(s) measured")
            break
        sync_s = sync(step) if step > 0 else 0.0
        mazes = sampler.mazes(step, algo.mazes_per_step)
        episodes = [m for m in mazes for _ in range(algo.group_size)]
        t = time.perf_counter()
        with torch.no_grad():
            trajectories = run_episodes(engine, episodes, env_spec, sampling, seed=step_seed(algo.seed, step))
        cuda_sync()
        rollout_s = time.perf_counter() - t
        tokens = sum(len(turn.completion_ids) for tr in trajectories for turn in tr.turns)
        prompt_tokens = sum(len(turn.prompt_ids) for tr in trajectories for turn in tr.turns)
        env_steps = sum(tr.num_turns for tr in trajectories)
        for i, tr in enumerate(trajectories):  # random weights never succeed: a fixed 0/1 pattern per group
            tr.reward = float(i % 2)
        t = time.perf_counter()
        update = learner.update(trajectories, algo.group_size)
        cuda_sync()
        learner_s = time.perf_counter() - t
        rec = {"step": step, "rollout_s": rollout_s, "learner_s": learner_s, "sync_s": sync_s,
               "step_s": rollout_s + learner_s + sync_s, "generated_tokens": tokens, "prompt_tokens": prompt_tokens,
               "env_steps": env_steps, "tokens_per_s": tokens / rollout_s, "env_steps_per_s": env_steps / rollout_s,
               "learner_sequences": update.sequences, "learner_tokens": update.tokens, "skipped": update.skipped,
               "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if device != "cpu" else None}
        steps.append(rec)
        figures["steps"] = steps
        dump()
        log(f"step {step}: rollout {rollout_s:.2f} s ({env_steps} env steps, {tokens} generated / {prompt_tokens} "
            f"prompt tokens, {rec['tokens_per_s']:.0f} tokens/s), learner {learner_s:.2f} s ({update.sequences} "
            f"sequences), sync {sync_s:.2f} s")
    figures["wall_s"] = time.perf_counter() - started

    last = steps[-1]
    tok_s = statistics.median(s["tokens_per_s"] for s in steps)
    step_s = statistics.median(s["step_s"] for s in steps)
    # Decode is bound by streaming the weights once per step for the whole batch: batch * bandwidth / weight bytes.
    bound = n_episodes * H200_COPY_BYTES_PER_S / c["weight_bytes"] if device != "cpu" else float("nan")
    figures["tokens_per_s_median"] = tok_s
    figures["step_s_median"] = step_s
    figures["weight_streaming_bound_tokens_per_s"] = bound
    dump()
    print()
    print(f"engine {figures['engine']}; {n_episodes} episodes/step ({algo.mazes_per_step} mazes x G={algo.group_size}),"
          f" up to {env_spec.max_turns} turns, {algo.max_tokens_per_turn} tokens/turn; LoRA r={args.rank}; "
          f"{len(steps)} step(s); wall {figures['wall_s']:.0f} s")
    print(f"last step: rollout {last['rollout_s']:.2f} s, learner {last['learner_s']:.2f} s, sync {last['sync_s']:.2f} s"
          f", {last['env_steps_per_s']:.1f} env steps/s" + (f", peak {last['peak_gpu_gib']:.1f} GiB" if
                                                             last["peak_gpu_gib"] else ""))
    print(f"gpu_step: {step_s:.2f} s (anchor: 30 s 8B-regime GRPO step (VLM-R1 #30), {30.0 / step_s:.2f}x)")
    print(f"gpu_rollout: {tok_s:.0f} tokens/s (weight-streaming bound at 4.3 TB/s x batch {n_episodes}: "
          f"{bound:.0f} tokens/s, {tok_s / bound:.2f}x)")
    return 0


if __name__ == "__main__":  # vLLM starts worker processes: keep the guard
    sys.exit(main())
