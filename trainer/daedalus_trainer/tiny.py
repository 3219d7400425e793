"""The tiny offline Qwen3-VL: real architecture, random weights, locally built tokenizer and processor.

Every CPU test and the local demo run on this model; nothing is downloaded. :func:`build_tiny_checkpoint` writes a
directory that looks exactly like a real Hugging Face Qwen3-VL checkpoint (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``, ``processor_config.json``), so every later
stage loads it with the same ``AutoModelForImageTextToText`` / ``AutoProcessor`` calls as the real model
(:func:`daedalus_trainer.policy.load_policy`).

Measured traps this module encodes (docs/engineering-notes.md, "Tiny Qwen3-VL"):

- the special-token ids in :class:`~transformers.Qwen3VLConfig` default to the real vocabulary's ids, so they are set
  to the tiny tokenizer's ids;
- ``text_config.rope_parameters.mrope_section`` must sum to ``head_dim / 2`` (otherwise the real model's
  ``[24, 20, 20]`` is used silently and clipped);
- ``vision_config.out_hidden_size`` equals the text hidden size, ``deepstack_visual_indexes`` lie below the vision
  depth, and ``num_position_embeddings`` is a perfect square;
- :class:`~transformers.Qwen3VLProcessor` refuses to build without a video processor (which needs torchvision, which
  must not be installed on CPU), hence the image-only :class:`TinyQwen3VLProcessor`, registered with
  ``AutoProcessor`` (unregistered, ``AutoProcessor.from_pretrained`` silently returns only the tokenizer);
- pixel mean/std 0.8/0.2 instead of Qwen's 0.5/0.5: maze images are mostly white, and with 0.5/0.5 the tiny model's
  visual tokens were nearly identical and SFT stayed at chance (issue 3, measured facts).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoProcessor,
    PreTrainedTokenizerFast,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

# Qwen2/Qwen3 special tokens, in the order the tiny vocabulary gives them ids 0..N-1. Names as in the real
# Qwen3-VL tokenizer_config.json ("added_tokens_decoder").
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
VISION_PAD = "<|vision_pad|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, VISION_START, VISION_END, VISION_PAD, IMAGE_PAD, VIDEO_PAD)
#: Tokens that must never be generated: a sampled ``<|image_pad|>`` breaks the next forward ("Image features and
#: image tokens do not match"); the others would open a vision span with no image behind it.
VISION_SPECIAL_TOKENS = (VISION_START, VISION_END, VISION_PAD, IMAGE_PAD, VIDEO_PAD)

# A Qwen3-VL-Instruct style chat template (the real one, minus tools and video): system message first, images
# rendered as <|vision_start|><|image_pad|><|vision_end|> (the processor expands the single pad to one token per
# merged visual patch), every message closed by <|im_end|>\n, and "<|im_start|>assistant\n" as generation prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for content in message['content'] -%}"
    "{%- if content['type'] == 'image' or 'image' in content or 'image_url' in content -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in content -%}"
    "{{- content['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

# Text the tokenizer's merges are learned from: the kinds of strings the maze task exchanges (instructions, actions in
# every format, feedback, ASCII boards). Byte-level BPE encodes any text, so this only shapes how compact it is.
_BASE_CORPUS = (
    "You are in a maze. Walls are gray, paths are white, you are the blue circle and the goal is the red square.",
    "Reach the goal. Move one cell per turn: right, up, left, down, or stop when you are on the goal.",
    "Answer with exactly one action.",
    "move(\"right\") move(\"up\") move(\"left\") move(\"down\") move(\"stop\") stop()",
    "('move', 0) ('move', 1) ('move', 2) ('move', 3) ('stop',) ('move', 4)",
    "<action>right</action> <action>up</action> <action>left</action> <action>down</action> <action>stop</action>",
    "You moved right. You moved up. You moved left. You moved down. You hit a wall and did not move.",
    "Invalid action: could not parse the answer. The turn was used. You reached the goal. You stopped.",
    "#######\n#S..#.#\n#.#.#.#\n#.#...#\n#.###.#\n#....G#\n#######\n",
    "The agent A is at row 1, column 1. The goal G is at row 5, column 5. Turn 3 of 24.",
)


def task_corpus() -> list[str]:
    """Strings of the maze task the tokenizer should encode compactly: the instructions for every action format,
    success rule and observation, every action in every format, and the feedback lines."""
    from daedalus_trainer.envs import ACTION_FORMATS, ACTIONS, DIRECTIONS, OBSERVATIONS, SUCCESS_ON
    from daedalus_trainer.envs import format_action, instructions, syntax_hint

    out = [instructions(f, s, o) for f in ACTION_FORMATS for s in SUCCESS_ON for o in OBSERVATIONS]
    out += [format_action(a, f) for a in ACTIONS for f in ACTION_FORMATS] * 8
    out += [f"Invalid action: {why}. Use {syntax_hint(f)}." for f in ACTION_FORMATS
            for why in ("empty reply", "wrong letter case; actions are lowercase", "no action found")]
    out += [f"Moved {d}." for d in DIRECTIONS] * 8 + [f"Moved {d} and reached the goal." for d in DIRECTIONS]
    out += [f"Hit a wall moving {d}; you did not move." for d in DIRECTIONS] * 2
    out += ["Stopped on the goal.", "Stopped, but not on the goal."] * 4
    return out


@dataclass(frozen=True)
class TinySpec:
    """Sizes of the tiny Qwen3-VL (defaults: 813,888 parameters (~0.8 M), issue 3 measured facts).

    Attributes:
        text_hidden: text hidden size (also the vision merger's output size).
        text_layers: decoder layers.
        text_heads / text_kv_heads / head_dim: attention geometry; ``mrope_section`` must sum to ``head_dim // 2``.
        text_intermediate: MLP width of the decoder.
        mrope_section: M-RoPE split of the ``head_dim // 2`` rotary frequencies among the temporal, height and width
            positions (``rope_parameters.mrope_section``, interleaved).
        rope_theta: RoPE base (``rope_parameters.rope_theta``); 5e6 is the value bench/gpu/rollout_step.py gives
            for Qwen3-VL-8B-Instruct.
        max_position_embeddings: longest sequence in tokens (also the tokenizer's ``model_max_length``).
        vision_depth / vision_hidden / vision_heads / vision_intermediate: ViT geometry.
        deepstack_indexes: ViT layers whose features are injected into the first decoder layers (must be < depth).
        num_position_embeddings: learned ViT position table (a perfect square; interpolated to the patch grid).
        patch_size / merge_size / temporal_patch_size: as Qwen3-VL (16, 2, 2): one merged visual token per 32x32 px.
        vocab_size: byte-level BPE vocabulary including the special tokens.
        image_mean / image_std: per-channel normalisation (0.8/0.2: see module docstring).
        min_pixels / max_pixels: the processor's ``size.shortest_edge`` / ``size.longest_edge`` (an area in px, as
            ``smart_resize`` uses them). The real model's minimum, 256x256 px, would turn a 112 px maze into 64
            visual tokens; 64x64 px here keeps small images small (112 px -> 128 px -> 16 tokens).
        seed: torch seed for the random initialisation.
    """

    text_hidden: int = 128
    text_layers: int = 2
    text_heads: int = 4
    text_kv_heads: int = 2
    head_dim: int = 32
    text_intermediate: int = 256
    mrope_section: tuple[int, int, int] = (6, 5, 5)
    rope_theta: float = 5_000_000.0
    max_position_embeddings: int = 8192
    vision_depth: int = 2
    vision_hidden: int = 64
    vision_heads: int = 2
    vision_intermediate: int = 128
    deepstack_indexes: tuple[int, ...] = (1,)
    num_position_embeddings: int = 64
    patch_size: int = 16
    merge_size: int = 2
    temporal_patch_size: int = 2
    vocab_size: int = 1024
    image_mean: tuple[float, float, float] = (0.8, 0.8, 0.8)
    image_std: tuple[float, float, float] = (0.2, 0.2, 0.2)
    min_pixels: int = 64 * 64
    max_pixels: int = 1024 * 1024
    seed: int = 0
    extra_corpus: tuple[str, ...] = field(default=(), compare=False)

    def check(self) -> None:
        """Raise ``ValueError`` for geometry the model would accept silently but compute wrongly (see module doc)."""
        if sum(self.mrope_section) != self.head_dim // 2:
            raise ValueError(f"mrope_section {self.mrope_section} must sum to head_dim/2 = {self.head_dim // 2}")
        if any(i >= self.vision_depth or i < 0 for i in self.deepstack_indexes):
            raise ValueError(f"deepstack_indexes {self.deepstack_indexes} must lie in [0, {self.vision_depth})")
        root = int(round(self.num_position_embeddings**0.5))
        if root * root != self.num_position_embeddings:
            raise ValueError(f"num_position_embeddings {self.num_position_embeddings} must be a perfect square")
        if self.text_heads % self.text_kv_heads:
            raise ValueError("text_heads must be a multiple of text_kv_heads")
        if self.vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError(f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)} (bytes + special tokens)")


class TinyQwen3VLProcessor(Qwen3VLProcessor):
    """Image-only :class:`~transformers.Qwen3VLProcessor` (no video processor, hence no torchvision).

    Behaves like the real processor for text and images: it expands each ``<|image_pad|>`` to
    ``grid_t * grid_h * grid_w / merge_size**2`` tokens and returns ``input_ids``, ``attention_mask``,
    ``mm_token_type_ids`` (1 on image tokens), ``pixel_values`` ``[num_patches, 3 * 2 * 16 * 16]`` and
    ``image_grid_thw`` ``[num_images, 3]``. Passing ``videos`` raises ``ValueError``.
    """

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, video_processor=None, chat_template=chat_template, **kwargs)

    def __call__(self, images=None, text=None, videos=None, **kwargs):  # noqa: D102 - as the parent
        if videos is not None:
            raise ValueError("TinyQwen3VLProcessor handles images only (no video processor without torchvision)")
        return super().__call__(images=images, text=text, **kwargs)


AutoProcessor.register(Qwen3VLConfig, TinyQwen3VLProcessor, exist_ok=True)


def train_tokenizer(spec: TinySpec) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer (``tokenizers`` library) with Qwen's special tokens at ids 0..7.

    The pre-tokenizer, decoder and byte alphabet are GPT-2/Qwen2's byte-level ones, so every string round-trips.
    Padding is on the left (needed for batched generation) and the pad token is ``<|endoftext|>`` as in Qwen.
    Returns a :class:`~transformers.PreTrainedTokenizerFast` carrying :data:`CHAT_TEMPLATE`.

    Raises:
        RuntimeError: the special tokens did not get ids 0..7 (in :data:`SPECIAL_TOKENS` order).
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    corpus = list(_BASE_CORPUS) + task_corpus() + list(spec.extra_corpus)
    tok.train_from_iterator(corpus * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        padding_side="left",
        model_max_length=spec.max_position_embeddings,
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
        chat_template=CHAT_TEMPLATE,
    )
    ids = fast.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    if ids != list(range(len(SPECIAL_TOKENS))):
        raise RuntimeError(f"special tokens got ids {ids}, expected 0..{len(SPECIAL_TOKENS) - 1}")
    return fast


def build_image_processor(spec: TinySpec) -> Qwen2VLImageProcessorPil:
    """Qwen3-VL's PIL image processor with the tiny normalisation and a lowered minimum size (see :class:`TinySpec`)."""
    return Qwen2VLImageProcessorPil(
        patch_size=spec.patch_size,
        merge_size=spec.merge_size,
        temporal_patch_size=spec.temporal_patch_size,
        image_mean=list(spec.image_mean),
        image_std=list(spec.image_std),
        size={"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels},
    )


def build_config(spec: TinySpec, tokenizer: PreTrainedTokenizerFast) -> Qwen3VLConfig:
    """The :class:`~transformers.Qwen3VLConfig` of the tiny model, special-token ids taken from ``tokenizer``.

    Raises:
        ValueError: ``spec`` fails :meth:`TinySpec.check`.
    """
    spec.check()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": spec.text_hidden,
        "intermediate_size": spec.text_intermediate,
        "num_hidden_layers": spec.text_layers,
        "num_attention_heads": spec.text_heads,
        "num_key_value_heads": spec.text_kv_heads,
        "head_dim": spec.head_dim,
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": spec.rope_theta,
            "mrope_section": list(spec.mrope_section),
            "mrope_interleaved": True,
        },
        "pad_token_id": ids[ENDOFTEXT],
        "bos_token_id": None,
        "eos_token_id": ids[IM_END],
        "dtype": "float32",
    }
    vision = {
        "depth": spec.vision_depth,
        "hidden_size": spec.vision_hidden,
        "intermediate_size": spec.vision_intermediate,
        "num_heads": spec.vision_heads,
        "patch_size": spec.patch_size,
        "spatial_merge_size": spec.merge_size,
        "temporal_patch_size": spec.temporal_patch_size,
        "out_hidden_size": spec.text_hidden,
        "num_position_embeddings": spec.num_position_embeddings,
        "deepstack_visual_indexes": list(spec.deepstack_indexes),
    }
    config = Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=False,
    )
    config.eos_token_id = ids[IM_END]
    config.pad_token_id = ids[ENDOFTEXT]
    return config


#: The file :func:`build_tiny_checkpoint` writes last: a directory holding it is a finished tiny checkpoint.
TINY_META = "daedalus_tiny.json"


def build_tiny_checkpoint(out_dir: str | Path, spec: TinySpec | None = None) -> Path:
    """Build the tiny model with random weights and save it like a real checkpoint; return ``out_dir``.

    Deterministic for a given ``spec`` (torch seed ``spec.seed``; BPE training is deterministic). Writes the model
    (``config.json``, ``generation_config.json``, ``model.safetensors``), the processor (tokenizer files,
    ``chat_template.jinja``, ``processor_config.json`` naming :class:`TinyQwen3VLProcessor`) and
    ``daedalus_tiny.json`` (the :class:`TinySpec` used, :data:`TINY_META`). Takes ~1 s on one core.

    Crash-safe: everything is written into ``out_dir/.tmp-build-<id>`` first and fsynced, then each file is renamed
    into ``out_dir``, ``config.json`` and then :data:`TINY_META` last, so a build killed part-way leaves ``out_dir``
    without the marker (in place, ``save_pretrained`` writes ``config.json`` first, which then proved nothing):
    :func:`is_built_tiny_checkpoint` tells the two apart, and building again over such a directory replaces its files
    (other files in it are kept).

    Raises:
        ValueError: ``spec`` fails :meth:`TinySpec.check`.
        RuntimeError: see :func:`train_tokenizer`.
    """
    spec = spec or TinySpec()
    from daedalus_trainer.checkpoint import _fsync_path  # checkpoint imports nothing from here; torch is loaded

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(".tmp-build-*"):  # a build killed earlier
        shutil.rmtree(stale, ignore_errors=True)
    # staged inside out_dir (same filesystem, and writable wherever out_dir is: a mount point's parent may not be)
    tmp = out / f".tmp-build-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        _build_into(tmp, spec)
        for f in tmp.iterdir():  # save_pretrained does not fsync: a power loss must not keep names without data
            _fsync_path(f)
        (out / TINY_META).unlink(missing_ok=True)  # a rebuild: unfinished until the new marker is in place
        last = ("config.json", TINY_META)  # config.json (what model.path's check looks for) next to last
        for f in sorted(tmp.iterdir(), key=lambda f: (f.name in last, last.index(f.name) if f.name in last else 0)):
            os.replace(f, out / f.name)
        _fsync_path(out, directory=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def is_built_tiny_checkpoint(path: str | Path) -> bool:
    """True when ``path`` holds a tiny checkpoint whose build finished (:data:`TINY_META` present, written last)."""
    return (Path(path) / TINY_META).is_file() and (Path(path) / "config.json").is_file()


def _build_into(out: Path, spec: TinySpec) -> None:
    """Write the tiny checkpoint's files into the existing directory ``out`` (:func:`build_tiny_checkpoint`)."""
    tokenizer = train_tokenizer(spec)
    processor = TinyQwen3VLProcessor(
        image_processor=build_image_processor(spec), tokenizer=tokenizer, chat_template=CHAT_TEMPLATE
    )
    config = build_config(spec, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = Qwen3VLForConditionalGeneration(config)
    model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids(IM_END)]
    model.generation_config.pad_token_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    model.generation_config.bos_token_id = None
    model.save_pretrained(out)
    processor.save_pretrained(out)
    from daedalus_trainer.usage import restore_umask_modes

    restore_umask_modes(out)  # safetensors writes 0600
    meta = asdict(spec)
    meta.pop("extra_corpus")
    (out / TINY_META).write_text(json.dumps(meta, indent=2) + "\n")  # fsynced with the others before the renames


def count_parameters(model: torch.nn.Module) -> int:
    """Number of parameters of ``model`` (all, trainable or not)."""
    return sum(p.numel() for p in model.parameters())
