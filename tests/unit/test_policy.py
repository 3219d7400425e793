"""Policy tests on the real tiny Qwen3-VL: checkpoint, tokenizer/processor, LoRA, log-probs, generation."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from support.tiny_model import make_tiny_job, tiny_checkpoint, tiny_job, tiny_policy  # noqa: F401

from daedalus_trainer import prompts, tiny
from daedalus_trainer.envs import maze_from_seed, render_rgb
from daedalus_trainer.policy import (
    TokenSequence,
    adapter_config_dict,
    check_lora_targets,
    load_policy,
    load_pretrained,
    lora_config,
    resolve_base_dir,
    resolve_start,
)
from daedalus_trainer.rollout.engine import SamplingParams, TransformersEngine

LORA = SimpleNamespace(rank=8, alpha=16.0, dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])


def _maze_image(seed: int, agent=None, cell_px: int = 16) -> np.ndarray:
    maze = maze_from_seed(7, seed)
    return render_rgb(maze, agent or maze.start, cell_px)


def _conversation(history: int, seed: int = 0):
    """A multi-turn conversation with ``history`` images (user/assistant alternating)."""
    settings = prompts.PromptSettings(history_turns=history)
    maze = maze_from_seed(7, seed)
    obs = [{"image": render_rgb(maze, maze.start, 16), "ascii": "", "feedback": ""}]
    replies = []
    for k in range(history - 1):
        replies.append('move("up")' if k % 2 else "not an action")
        obs.append({"image": render_rgb(maze, maze.start, 16), "ascii": "", "feedback": "Hit a wall moving left; you did not move."})
    return prompts.build_conversation(obs, replies, settings)


def _perturb_lora(policy, scale: float = 0.5, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


# --------------------------------------------------------------------------------------------------- checkpoint
def test_tiny_checkpoint_is_saved_like_a_real_one(tiny_checkpoint):
    files = {p.name for p in tiny_checkpoint.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "processor_config.json", "generation_config.json"} <= files
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    assert config["model_type"] == "qwen3_vl"
    assert config["architectures"] == ["Qwen3VLForConditionalGeneration"]
    text, vision = config["text_config"], config["vision_config"]
    assert text["hidden_size"] == 128 and text["num_hidden_layers"] == 2
    assert vision["depth"] == 2 and vision["hidden_size"] == 64 and vision["out_hidden_size"] == 128
    assert sum(text["rope_parameters"]["mrope_section"]) == text["head_dim"] // 2
    assert max(vision["deepstack_visual_indexes"]) < vision["depth"]
    proc = json.loads((tiny_checkpoint / "processor_config.json").read_text())
    assert proc["processor_class"] == "TinyQwen3VLProcessor"
    assert proc["image_processor"]["image_mean"] == [0.8] * 3 and proc["image_processor"]["image_std"] == [0.2] * 3
    assert proc["image_processor"]["patch_size"] == 16


def test_tiny_policy_loads_through_auto_classes(tiny_policy):
    from transformers import Qwen3VLForConditionalGeneration

    assert isinstance(tiny_policy.model, Qwen3VLForConditionalGeneration)
    assert type(tiny_policy.processor).__name__ == "TinyQwen3VLProcessor"
    n = tiny.count_parameters(tiny_policy.model)
    assert 500_000 < n < 1_200_000, n
    cfg = tiny_policy.model.config
    tok = tiny_policy.tokenizer
    assert cfg.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert cfg.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
    assert tok.padding_side == "left" and tok.pad_token == "<|endoftext|>"


def test_save_load_round_trip_is_exact(tiny_policy, tmp_path):
    out = tiny_policy.save_pretrained(tmp_path / "copy")
    again = load_pretrained(out, "float32", "cpu")
    a, b = tiny_policy.model.state_dict(), again.model.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    messages, images = _conversation(2)
    seq = TokenSequence(prompts.encode_prompt(tiny_policy.processor, messages, images), [5, 9, 2], images)
    with torch.no_grad():
        lp1 = tiny_policy.response_logprobs(tiny_policy.collate([seq]))
        lp2 = again.response_logprobs(again.collate([seq]))
    assert torch.equal(lp1, lp2)
    assert (out / "daedalus_tiny.json").is_file()


def test_tokenizer_round_trips_task_text(tiny_policy):
    tok = tiny_policy.tokenizer
    for text in ['move("up")', "('move', 2)", "<action>stop</action>", "Hit a wall moving left; you did not move.",
                 "naïve ünïcode ✓ \t\n"]:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    # the task's own strings are compact (merges learned from them)
    assert len(tok.encode('move("left")', add_special_tokens=False)) <= 5


def test_processor_expands_images_and_marks_them(tiny_policy):
    messages, images = _conversation(3)
    text = prompts.render(tiny_policy.processor, messages)
    assert text.count("<|vision_start|><|image_pad|><|vision_end|>") == 3
    assert text.endswith("<|im_start|>assistant\n")
    enc = prompts.encode_prompts(tiny_policy.processor, [messages], [images])
    ids = enc["input_ids"][0]
    # 112 px images become 128 px -> 8x8 patches -> 16 merged visual tokens each
    assert enc["image_grid_thw"].tolist() == [[1, 8, 8]] * 3
    assert int((ids == tiny_policy.image_token_id).sum()) == 48
    assert torch.equal(enc["mm_token_type_ids"][0], (ids == tiny_policy.image_token_id).long())
    with pytest.raises(ValueError, match="images only"):
        tiny_policy.processor(text=["x"], videos=[np.zeros((2, 32, 32, 3), np.uint8)])


def test_cached_image_encoding_equals_the_processor(tiny_policy):
    # conversations of different lengths (left padding differs), 1-3 images each, pictures repeated within and
    # across conversations and different pictures in between (cache order matters)
    convs = [_conversation(1, seed=0), _conversation(3, seed=1), _conversation(2, seed=0), _conversation(1, seed=2)]
    moved = _maze_image(3, agent=(1, 3))
    convs.append((convs[0][0], [moved]))
    wide = np.concatenate([_maze_image(4), _maze_image(5)], axis=1)  # 112 x 224 px: another grid, mid-batch
    convs.insert(2, (convs[0][0], [wide]))
    messages = [m for m, _ in convs]
    images = [list(i) for _, i in convs]
    want = prompts.encode_prompts(tiny_policy.processor, messages, images)
    for attempt in ("cold cache", "warm cache"):
        got = tiny_policy.encode_prompts(messages, images)
        assert sorted(got.keys()) == sorted(want.keys()), attempt
        for key in want:
            assert torch.equal(got[key], want[key]), (attempt, key)
    # no images: the processor path as it is
    text_only = [[{"role": "system", "content": "x"}, {"role": "user", "content": "hello"}]]
    assert torch.equal(tiny_policy.encode_prompts(text_only, [[]])["input_ids"],
                       prompts.encode_prompts(tiny_policy.processor, text_only, [[]])["input_ids"])
    assert len({tuple(g) for g in want["image_grid_thw"].tolist()}) == 2  # really two grid sizes
    with pytest.raises(ValueError, match="2 conversations but 1 image lists"):
        tiny_policy.encode_prompts(messages[:2], images[:1])
    with pytest.raises(ValueError, match="conversation 1: 3 image placeholder"):
        tiny_policy.encode_prompts(messages[:2], [images[0], images[1][:2]])


# -------------------------------------------------------------------------------------------------------- LoRA
def test_lora_targets_only_the_language_model(tiny_policy):
    tiny_policy.add_lora(LORA)
    lora_modules = [n for n, m in tiny_policy.model.named_modules() if hasattr(m, "lora_A")]
    assert len(lora_modules) == 2 * 4  # 2 decoder layers x q/k/v/o
    assert all(".language_model." in n and ".visual." not in n for n in lora_modules)
    trainable = [n for n, p in tiny_policy.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


@pytest.mark.parametrize("target", ["qkv", "attn.proj", "linear_fc1", "proj", "patch_embed.proj"])
def test_vision_lora_targets_are_rejected(tiny_policy, target):
    with pytest.raises(ValueError, match="vision-tower"):
        tiny_policy.add_lora(SimpleNamespace(rank=4, alpha=8, dropout=0.0, target_modules=["q_proj", target]))
    assert not tiny_policy.has_adapter


def test_unknown_lora_target_is_rejected(tiny_policy):
    with pytest.raises(ValueError, match="matches no linear"):
        check_lora_targets(tiny_policy.model, ["q_proj", "nope_proj"])


def test_reference_is_the_base_model_with_adapter_disabled(tiny_policy):
    messages, images = _conversation(2)
    seq = TokenSequence(prompts.encode_prompt(tiny_policy.processor, messages, images), [11, 12, 13, 2], images)
    batch = tiny_policy.collate([seq, seq])
    with torch.no_grad():
        base = tiny_policy.response_logprobs(batch)
    with pytest.raises(ValueError, match="needs a LoRA adapter"):
        tiny_policy.reference_logprobs(batch)
    tiny_policy.add_lora(LORA)
    _perturb_lora(tiny_policy)
    with torch.no_grad():
        adapted = tiny_policy.response_logprobs(batch)
    ref = tiny_policy.reference_logprobs(batch)
    assert torch.allclose(ref, base, atol=1e-6)
    assert (adapted - base).abs().max() > 1e-2
    # the adapter is enabled again after the reference forward
    with torch.no_grad():
        assert torch.allclose(tiny_policy.response_logprobs(batch), adapted, atol=1e-6)


def test_adapter_save_and_state_reload_are_exact(tiny_checkpoint, tmp_path):
    a = load_pretrained(tiny_checkpoint, "float32", "cpu")
    a.add_lora(LORA)
    _perturb_lora(a, seed=3)
    path = a.save_adapter(tmp_path / "adapter")
    assert (path / "adapter_config.json").is_file() and (path / "adapter_model.safetensors").is_file()
    b = load_pretrained(tiny_checkpoint, "float32", "cpu")
    b.load_adapter(path)
    c = load_pretrained(tiny_checkpoint, "float32", "cpu")
    c.add_lora(LORA)
    c.load_adapter(a.adapter_state())
    messages, images = _conversation(1)
    seq = TokenSequence(prompts.encode_prompt(a.processor, messages, images), [20, 21, 2], images)
    with torch.no_grad():
        lps = [p.response_logprobs(p.collate([seq])) for p in (a, b, c)]
    assert torch.equal(lps[0], lps[1]) and torch.equal(lps[0], lps[2])
    with pytest.raises(ValueError, match="no adapter attached"):
        load_pretrained(tiny_checkpoint, "float32", "cpu").load_adapter(a.adapter_state())


def test_adapter_config_dict_of_lora_config_is_the_attached_adapters_and_what_peft_writes(tiny_checkpoint, tmp_path):
    """``lora_config(spec.lora)`` is the config ``add_lora`` attaches (a vLLM engine, which never loads the model in
    torch, writes it next to the adapter tensors it receives), and ``adapter_config_dict`` is the file peft writes,
    but for what peft's ``save_pretrained`` sets itself (inference mode, the model class's auto mapping) or orders by
    set iteration (targets)."""
    policy = load_pretrained(tiny_checkpoint, "float32", "cpu")
    policy.add_lora(LORA)
    attached = adapter_config_dict(policy.model.peft_config["default"])
    assert adapter_config_dict(lora_config(LORA, base_model_name_or_path=str(tiny_checkpoint))) == attached
    assert attached["r"] == 8 and attached["lora_alpha"] == 16.0 and attached["bias"] == "none"
    assert attached["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert attached["base_model_name_or_path"] == str(tiny_checkpoint) and attached["peft_type"] == "LORA"
    written = json.loads((policy.save_adapter(tmp_path / "adapter") / "adapter_config.json").read_text())
    assert written.pop("inference_mode") is True and attached.pop("inference_mode") is False
    assert written.pop("auto_mapping")["base_model_class"] == "Qwen3VLForConditionalGeneration"
    assert attached.pop("auto_mapping") is None
    written["target_modules"] = sorted(written["target_modules"])
    assert json.loads(json.dumps(attached)) == written


def test_resolve_start_locates_base_and_adapter_as_load_policy_loads_them(tiny_checkpoint, tmp_path):
    job = make_tiny_job()
    fresh = resolve_start(job.spec.model, tmp_path)  # no start: the tiny base, built here, and a fresh adapter
    assert fresh.base_dir == tmp_path / "tiny-base" and fresh.adapter_dir is None
    assert (fresh.base_dir / "config.json").is_file()
    full = job.spec.model.model_copy(update={"sft_adapter": str(tiny_checkpoint)})
    assert resolve_start(full, tmp_path / "unused") == type(fresh)(tiny_checkpoint, None)  # a full model replaces it
    assert not (tmp_path / "unused").exists()
    a = load_pretrained(tiny_checkpoint, "float32", "cpu")
    a.add_lora(LORA)
    adapter = a.save_adapter(tmp_path / "sft-adapter")
    on_base = job.spec.model.model_copy(update={"sft_adapter": str(adapter), "path": str(tiny_checkpoint)})
    start = resolve_start(on_base)
    assert start.base_dir == tiny_checkpoint and start.adapter_dir == adapter
    policy = load_policy(on_base, job.spec.lora, device="cpu")
    assert policy.path == start.base_dir and policy.has_adapter
    assert policy.model.peft_config["default"].r == 8  # the adapter's own rank, loaded on that base
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_start(job.spec.model.model_copy(update={"sft_adapter": str(tmp_path / "gone")}))


def test_a_mismatched_adapter_state_is_refused_before_any_weight_changes(tiny_checkpoint):
    """Another rank, or other targets: a ValueError naming the mismatch, and the attached adapter keeps every weight
    (torch's load_state_dict would have copied the matching tensors before raising on the first other shape)."""
    target = load_pretrained(tiny_checkpoint, "float32", "cpu")
    target.add_lora(LORA)
    _perturb_lora(target, seed=5)
    before = target.adapter_state()
    other_rank = load_pretrained(tiny_checkpoint, "float32", "cpu")
    other_rank.add_lora(SimpleNamespace(**{**vars(LORA), "rank": 4}))
    state = other_rank.adapter_state()
    state.update({k: v + 1 for k, v in before.items() if "lora_A" in k})  # same shapes as the target's: would load
    with pytest.raises(ValueError, match=r"tensor\(s\) of other shapes .*another rank"):
        target.load_adapter(state)
    fewer = {k: v for k, v in before.items() if "q_proj" not in k}
    with pytest.raises(ValueError, match="adapter mismatch: missing"):
        target.load_adapter({k: v + 1 for k, v in fewer.items()})
    after = target.adapter_state()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_load_policy_builds_tiny_and_refuses_missing_real_model(tmp_path):
    job = make_tiny_job()
    policy = load_policy(job.spec.model, job.spec.lora, work_dir=tmp_path)
    assert policy.has_adapter and policy.path == tmp_path / "tiny-base"
    assert resolve_base_dir(job.spec.model, tmp_path) == tmp_path / "tiny-base"  # built once, reused
    real = SimpleNamespace(path=str(tmp_path / "missing"), tiny=False, dtype="bfloat16", sft_adapter=None)
    with pytest.raises(FileNotFoundError, match="never downloads"):
        load_policy(real)


def test_a_tiny_base_whose_build_was_killed_is_built_again(tmp_path):
    """A build killed part-way leaves ``config.json`` (``save_pretrained`` writes it first) without the
    ``daedalus_tiny.json`` marker: such a ``tiny-base`` is built again, to the bytes of an uninterrupted build, instead
    of being loaded (the old rule, ``config.json`` present, took it as finished and loading then failed)."""
    from daedalus_trainer.tiny import TINY_META, build_tiny_checkpoint, is_built_tiny_checkpoint

    job = make_tiny_job()
    reference = build_tiny_checkpoint(tmp_path / "reference")
    assert is_built_tiny_checkpoint(reference)
    assert not [p.name for p in reference.iterdir() if p.name.startswith(".tmp-")]  # the staging directory is gone
    want = {f.name: f.read_bytes() for f in reference.iterdir()}
    # the state a kill during the old in-place build left: the config and half of the weights, no marker
    work = tmp_path / "run"
    half = work / "tiny-base"
    half.mkdir(parents=True)
    (half / "config.json").write_bytes(want["config.json"])
    (half / "model.safetensors").write_bytes(want["model.safetensors"][: len(want["model.safetensors"]) // 2])
    (half / "notes.txt").write_text("kept")
    (half / ".tmp-build-0badf00d").mkdir()  # the staging directory of a build killed with the new code
    (half / ".tmp-build-0badf00d" / "model.safetensors").write_bytes(b"partial")
    assert not is_built_tiny_checkpoint(half)
    assert resolve_base_dir(job.spec.model, work) == half
    assert is_built_tiny_checkpoint(half)
    got = {f.name: f.read_bytes() for f in half.iterdir() if f.name != "notes.txt"}
    assert got == want and (half / "notes.txt").read_text() == "kept"
    assert sorted(p.name for p in work.iterdir()) == ["tiny-base"]
    load_pretrained(half, "float32", "cpu")  # loads
    # a finished build is reused, not rebuilt: its files keep their inode
    inode = (half / TINY_META).stat().st_ino
    assert resolve_base_dir(job.spec.model, work) == half and (half / TINY_META).stat().st_ino == inode


# ------------------------------------------------------------------------------------------------- log-probs
def test_shared_prefix_forward_equals_plain_forward(tiny_policy):
    tiny_policy.add_lora(LORA)
    _perturb_lora(tiny_policy, 0.1)
    seqs = []
    for k in range(4):
        messages, images = _conversation(1 + k % 3, seed=k)
        seqs.append(TokenSequence(prompts.encode_prompt(tiny_policy.processor, messages, images),
                                  [30 + k, 31, 32, 2][: 2 + k % 3], images))
    batch = tiny_policy.collate(seqs)
    assert tiny_policy.shared_prefix_length(batch) > 50  # the system prompt
    grads = []
    for share in (False, True):
        tiny_policy.model.zero_grad()
        lp = tiny_policy.response_logprobs(batch, 0.7, share_prefix=share)
        lp.sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in tiny_policy.trainable_parameters()]))
        if share:
            assert torch.allclose(lp, plain, atol=1e-5)
        plain = lp.detach()
    assert torch.allclose(grads[0], grads[1], atol=1e-5)
    assert (plain != 0).sum() == batch.num_assistant_tokens


def test_collate_rejects_image_count_mismatch(tiny_policy):
    messages, images = _conversation(2)
    ids = prompts.encode_prompt(tiny_policy.processor, messages, images)
    with pytest.raises(ValueError, match="image tokens"):
        tiny_policy.collate([TokenSequence(ids, [3, 2], images[:1])])


@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_generate_logprobs_match_training_forward(tiny_policy, temperature, dtype):
    """Log-probs reported by generation equal the learner's recomputation on the same tokens (left-padded batch,
    multi-turn, multi-image, M-RoPE) to 1e-4 in float32. In bfloat16, the GPU image's dtype (base weights bf16, the
    LoRA adapter float32 as PEFT casts it), the engine's decode loop runs and agrees to 1e-2 (measured up to 4e-3:
    bf16 rounding of a prefix-cached batch vs a whole one), a ratio within 1% of 1 where the clip range is 20%."""
    if dtype == "bfloat16":
        tiny_policy.model.to(torch.bfloat16)
    tiny_policy.add_lora(LORA)
    if dtype == "bfloat16":
        assert {p.dtype for n, p in tiny_policy.model.named_parameters() if "lora_" in n} == {torch.float32}
        assert tiny_policy.model.get_input_embeddings().weight.dtype == torch.bfloat16
    _perturb_lora(tiny_policy, 0.05)
    convs, imgs = zip(*[_conversation(h, seed=h) for h in (1, 2, 3, 1)])
    engine = TransformersEngine(tiny_policy)
    gens = engine.generate(list(convs), list(imgs), SamplingParams(temperature, 1.0, 16, seed=7))
    assert len({len(g.prompt_ids) for g in gens}) > 1  # really left-padded
    seqs = [TokenSequence(g.prompt_ids, g.token_ids, g.images) for g in gens]
    batch = tiny_policy.collate(seqs)
    with torch.no_grad():
        lp = tiny_policy.response_logprobs(batch, SamplingParams(temperature).logprob_temperature)
    for i, g in enumerate(gens):
        n = len(g.prompt_ids)
        got = lp[i, n : n + len(g.token_ids)]
        assert torch.allclose(got, torch.tensor(g.logprobs), atol=1e-4 if dtype == "float32" else 1e-2), (got,
                                                                                                       g.logprobs)
        assert g.finish_reason in ("stop", "length")
        assert g.text == tiny_policy.tokenizer.decode(g.token_ids, skip_special_tokens=True)
        assert [img.shape for img in g.images] == [im.shape for im in imgs[i]]
    # the same seed gives the same samples
    again = engine.generate(list(convs), list(imgs), SamplingParams(temperature, 1.0, 16, seed=7))
    assert [g.token_ids for g in again] == [g.token_ids for g in gens]


def _text_only(feedback: str):
    return [{"role": "system", "content": prompts.PromptSettings().system_prompt()},
            {"role": "user", "content": feedback}], []


DECODING_CASES = {
    # name: (temperature, top_p, max_tokens, batch)
    "greedy": (0.0, 1.0, 12, [_conversation(h, seed=h) for h in (1, 2, 3, 1)]),
    "sampled": (0.7, 1.0, 12, [_conversation(h, seed=h) for h in (1, 2, 3, 1)]),
    "top-p": (1.0, 0.8, 12, [_conversation(h, seed=h) for h in (1, 2, 3, 1)]),
    "batch-of-one": (0.7, 1.0, 12, [_conversation(2, seed=5)]),
    "no-images": (0.7, 1.0, 12, [_text_only("Moved up."), _text_only("Hit a wall moving left; you did not move.")]),
    "one-token": (1.0, 0.8, 1, [_conversation(1, seed=1), _conversation(2, seed=2)]),
}


@pytest.mark.parametrize("case", sorted(DECODING_CASES))
def test_decoding_matches_transformers_generate(tiny_policy, case):
    """The engine's own decode loop (the prompts' common prefix encoded once, ``[prefix][pads][suffix]`` layout)
    draws the tokens transformers' ``generate`` draws on the plain left-padded batch with the same seed, and reports
    the log-probs of its raw logits (the reference decoding is the library's, not ours)."""
    temperature, top_p, max_tokens, batch = DECODING_CASES[case]
    tiny_policy.add_lora(LORA)
    _perturb_lora(tiny_policy, 0.05)
    convs, imgs = [m for m, _ in batch], [list(i) for _, i in batch]
    sampling = SamplingParams(temperature, top_p, max_tokens, seed=3)

    def stop_even_rows_early(module, inputs, output):  # rows that finish while others decode get pads after
        output = output.clone()
        output[0::2, ..., tiny_policy.im_end_id] += 6.0
        return output

    handle = tiny_policy.model.lm_head.register_forward_hook(stop_even_rows_early)
    try:
        gens = _check_decoding_matches_generate(tiny_policy, convs, imgs, sampling)
    finally:
        handle.remove()
    lengths = [len(g.token_ids) for g in gens]
    if len(gens) > 1 and max_tokens > 1:
        assert max(lengths) == max_tokens and min(lengths) < max_tokens, lengths  # stopped early / cut at the limit
    else:
        assert max(lengths) <= max_tokens


def _check_decoding_matches_generate(tiny_policy, convs, imgs, sampling):
    from transformers import GenerationConfig

    from daedalus_trainer.policy import MIN_SHARED_PREFIX
    from daedalus_trainer.rollout import engine as engine_mod

    gens = TransformersEngine(tiny_policy).generate(convs, imgs, sampling)
    if len(gens) > 1:  # the prefix is really shared
        assert engine_mod._common_prefix([g.prompt_ids for g in gens], tiny_policy.image_token_id) >= MIN_SHARED_PREFIX

    enc = tiny_policy.encode_prompts(convs, imgs)
    # every field given: generate fills the others from the checkpoint's generation_config
    common = dict(max_new_tokens=sampling.max_tokens, eos_token_id=tiny_policy.stop_token_ids,
                  pad_token_id=tiny_policy.pad_id, suppress_tokens=tiny_policy.suppressed_token_ids,
                  repetition_penalty=1.0, return_dict_in_generate=True, output_logits=True)
    config = (GenerationConfig(do_sample=False, **common) if sampling.greedy else
              GenerationConfig(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=0, **common))
    tiny_policy.model.eval()
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(sampling.seed)
        res = tiny_policy.model.generate(**enc, generation_config=config)
    width = enc["input_ids"].shape[1]
    logits = torch.stack(res.logits, dim=1).float() / sampling.logprob_temperature  # [B, L, V]
    for i, g in enumerate(gens):
        row = res.sequences[i, width:].tolist()
        end = next((j + 1 for j, t in enumerate(row) if t in tiny_policy.stop_token_ids), len(row))
        assert g.token_ids == row[:end], i
        assert g.prompt_ids == enc["input_ids"][i][enc["attention_mask"][i].bool()].tolist()
        want = torch.log_softmax(logits[i, :end], dim=-1).gather(-1, torch.tensor(row[:end])[:, None])[:, 0]
        assert torch.allclose(torch.tensor(g.logprobs), want, atol=1e-5), i
    return gens


def test_common_prefix_stops_before_images_and_leaves_each_row_a_token():
    from daedalus_trainer.rollout.engine import _common_prefix

    assert _common_prefix([[1, 2, 3, 4], [1, 2, 3, 5]], image_token_id=9) == 3
    assert _common_prefix([[1, 2, 9, 4], [1, 2, 9, 4]], image_token_id=9) == 2  # no image token in the prefix
    assert _common_prefix([[1, 2, 3], [1, 2, 3, 4]], image_token_id=9) == 2  # the shorter row keeps its last token
    assert _common_prefix([[5, 2], [1, 2]], image_token_id=9) == 0


def test_vision_tokens_are_never_generated(tiny_policy):
    """Even when the model strongly prefers <|image_pad|> & co, generation never emits them (a sampled image pad
    would break the next forward)."""
    banned = tiny_policy.suppressed_token_ids
    assert set(banned) == {tiny_policy.tokenizer.convert_tokens_to_ids(t) for t in tiny.VISION_SPECIAL_TOKENS}

    def push_vision_tokens(module, inputs, output):
        output = output.clone()
        output[..., banned] += 100.0
        return output

    handle = tiny_policy.model.lm_head.register_forward_hook(push_vision_tokens)
    try:
        convs, imgs = zip(*[_conversation(1, seed=s) for s in range(3)])
        for temperature in (0.0, 1.0):
            gens = TransformersEngine(tiny_policy).generate(list(convs), list(imgs),
                                                            SamplingParams(temperature, 1.0, 8, seed=1))
            assert all(not set(g.token_ids) & set(banned) for g in gens)
            assert all(len(g.token_ids) > 0 for g in gens)
    finally:
        handle.remove()


def test_sampling_params_validation():
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)
    assert SamplingParams(0.0).greedy and SamplingParams(0.0).logprob_temperature == 1.0


def test_fast_vision_paths_match_the_stock_model(tiny_policy, tiny_checkpoint):
    """Patch embedding as one matmul and batched vision attention: same parameters, same features as transformers'
    own modules (to float rounding), for same-size and mixed-size images."""
    from transformers import AutoModelForImageTextToText

    from daedalus_trainer.policy import PatchLinearConv3d

    visual = tiny_policy.base_model.model.visual
    assert type(visual.patch_embed.proj) is PatchLinearConv3d
    assert all(type(b.attn).__name__ == "BatchedVisionAttention" for b in visual.blocks)
    stock = AutoModelForImageTextToText.from_pretrained(tiny_checkpoint, local_files_only=True)
    assert type(stock.model.visual.patch_embed.proj) is torch.nn.Conv3d
    assert set(stock.state_dict()) == set(tiny_policy.model.state_dict())
    big = np.kron(_maze_image(1), np.ones((2, 2, 1), np.uint8))  # 224 px: a different patch grid
    for images in ([_maze_image(s) for s in range(5)], [_maze_image(0), big, _maze_image(2)]):
        pv, grid = tiny_policy.process_images(images)
        with torch.no_grad():
            ours = tiny_policy.base_model.model.get_image_features(pv, grid)
            theirs = stock.model.get_image_features(pv, grid)
        assert torch.allclose(torch.cat(ours.pooler_output), torch.cat(theirs.pooler_output), atol=1e-5)
        for a, b in zip(ours.deepstack_features, theirs.deepstack_features):
            assert torch.allclose(torch.cat(a), torch.cat(b), atol=1e-5)


def test_saved_models_and_adapters_get_the_umask_s_mode_not_safetensors_0600(tiny_checkpoint, tmp_path):
    """safetensors 0.8 writes its files with mode 0600 whatever the umask: the SFT model, the tiny base and an SFT
    adapter on a shared volume could not be read by another uid (a vLLM serving pod) while the files beside them
    could. Every file written by save_pretrained / save_adapter / the tiny build now has the umask's mode."""
    import os

    from daedalus_trainer.tiny import TinySpec, build_tiny_checkpoint

    previous = os.umask(0o027)  # group-readable, others nothing: not the 022 that would pass by accident
    try:
        a = load_pretrained(tiny_checkpoint, "float32", "cpu")
        model_dir = a.save_pretrained(tmp_path / "model")
        a.add_lora(LORA)
        adapter_dir = a.save_adapter(tmp_path / "adapter")
        base_dir = build_tiny_checkpoint(tmp_path / "tiny-base", TinySpec())
    finally:
        os.umask(previous)
    for d in (model_dir, adapter_dir, base_dir):
        modes = {f.name: oct(f.stat().st_mode & 0o777) for f in d.iterdir() if f.is_file()}
        assert any(name.endswith(".safetensors") for name in modes), modes
        assert set(modes.values()) == {oct(0o640)}, (d.name, modes)
