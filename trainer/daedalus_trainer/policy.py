"""The policy: a Qwen3-VL vision-language model (real or tiny) with an optional LoRA adapter.

:func:`load_policy` reads a Hugging Face checkpoint directory with ``AutoModelForImageTextToText`` and
``AutoProcessor`` (``local_files_only=True``: no hub access at run time), or first builds the tiny offline
architecture (:mod:`daedalus_trainer.tiny`) when ``model.tiny`` is set, so that both load the same way.

The learner's math lives in :meth:`Policy.response_logprobs`: per-token log-probabilities ``log pi(y_t | x, y_<t)``
of the assistant tokens of a batch of multi-turn, multi-image conversations. The reference policy of the KL term is
the GRPO start (:meth:`Policy.reference`): the same weights with the adapter disabled (peft ``disable_adapter()``)
when GRPO starts from a full model (the tiny SFT model), so it costs no second copy of the model; a frozen copy of the
start adapter when GRPO continues a PEFT ``model.sftAdapter`` (:meth:`Policy.add_reference_adapter`: megabytes).

LoRA (Hu et al. 2021, arXiv:2106.09685) through peft, on language-model modules only: vLLM ignores LoRA on Qwen3-VL's
vision tower, so a vision target would make the rollout policy differ from the trained one (DESIGN §2).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import shutil
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from daedalus_trainer import tiny as tiny_mod
from daedalus_trainer.checkpoint import CheckpointError, error_reason

log = logging.getLogger("daedalus.policy")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: Name of the tiny base checkpoint directory built under a work directory when ``model.path`` is not given.
TINY_BASE_DIRNAME = "tiny-base"
ADAPTER_CONFIG = "adapter_config.json"
#: PEFT adapter name of the frozen reference copy of an SFT adapter (:meth:`Policy.add_reference_adapter`).
REFERENCE_ADAPTER = "reference"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: Shortest common prefix worth encoding once per batch (see :meth:`Policy.shared_prefix_length`).
MIN_SHARED_PREFIX = 16
#: Processed images kept by :meth:`Policy.process_images` (a 128x128 px image is ~0.4 MB of float32 patches).
IMAGE_CACHE_SIZE = 512
#: Weight files of a PEFT adapter directory, either of which PEFT loads locally (without one it asks the Hub).
ADAPTER_WEIGHT_FILES = (ADAPTER_WEIGHTS, "adapter_model.bin")


class ModelLoadError(CheckpointError):
    """A model or adapter directory that exists and has its config file, but whose files cannot be loaded
    (truncated or missing weights, a config that does not parse, Git LFS pointers in place of the weights). The
    message names the directory, what failed, and what to do; the `daedalus` command prints it as one line."""


def _unloadable(what: str, path: Path, exc: BaseException | str) -> ModelLoadError:
    """The :class:`ModelLoadError` for ``what`` (``"model"``, ``"adapter"``) at ``path`` that failed with ``exc``
    (an exception, or the reason as text)."""
    reason = exc if isinstance(exc, str) else error_reason(exc)
    return ModelLoadError(
        f"cannot load the {what} in {path}: {reason}. Its files are incomplete or damaged (a copy, download or save "
        "cut short, or Git LFS pointers in place of the weights): copy or save it again")


def _check_adapter_weights(path: Path) -> None:
    """Raise :class:`ModelLoadError` when the adapter directory ``path`` holds none of
    :data:`ADAPTER_WEIGHT_FILES`: PEFT would then look ``path`` up on the Hugging Face Hub as a repository name
    (a network call at run time, and a traceback without a network)."""
    if not any((path / name).is_file() for name in ADAPTER_WEIGHT_FILES):
        raise ModelLoadError(
            f"cannot load the adapter in {path}: it has {ADAPTER_CONFIG} but no weights "
            f"({' or '.join(ADAPTER_WEIGHT_FILES)}): copy or save the adapter again")


# --------------------------------------------------------------------------------------------------------- sequences
@dataclass
class TokenSequence:
    """One model input: prompt tokens (image pads already expanded) followed by completion (assistant) tokens.

    This is the unit the learner recomputes log-probs on: the exact tokens a rollout engine was given
    (``prompt_ids``) and sampled (``completion_ids``), with the images of that context.

    Attributes:
        prompt_ids: token ids of the rendered conversation up to and including ``<|im_start|>assistant\\n``; each
            image appears as ``<|vision_start|>`` + N x ``<|image_pad|>`` + ``<|vision_end|>``.
        completion_ids: the assistant reply's token ids (ending with ``<|im_end|>`` when the reply finished).
        images: the images of the context in order of appearance, uint8 ``[H, W, 3]`` (or PIL images).
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    images: list[Any] = field(default_factory=list)

    @property
    def input_ids(self) -> list[int]:
        """``prompt_ids + completion_ids``."""
        return list(self.prompt_ids) + list(self.completion_ids)

    @property
    def assistant_mask(self) -> list[int]:
        """1 on completion tokens, 0 on prompt tokens; same length as :attr:`input_ids`."""
        return [0] * len(self.prompt_ids) + [1] * len(self.completion_ids)


@dataclass
class PolicyBatch:
    """A right-padded batch of :class:`TokenSequence` as tensors for :meth:`Policy.response_logprobs`.

    Attributes:
        input_ids: ``[B, T]`` long, padded with the pad token.
        attention_mask: ``[B, T]`` long, 1 on real tokens.
        assistant_mask: ``[B, T]`` long, 1 on completion (assistant) tokens.
        mm_token_type_ids: ``[B, T]`` long, 1 on ``<|image_pad|>`` tokens (Qwen3-VL's M-RoPE needs it).
        pixel_values: ``[num_patches, C * temporal_patch * patch * patch]`` float, or None without images.
        image_grid_thw: ``[num_images, 3]`` long (temporal, height, width in patches), or None.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    assistant_mask: torch.Tensor
    mm_token_type_ids: torch.Tensor
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> PolicyBatch:
        """A copy with every tensor on ``device`` (same shapes and dtypes)."""
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return PolicyBatch(*(move(getattr(self, f)) for f in self.__dataclass_fields__))

    @property
    def num_assistant_tokens(self) -> int:
        """Number of assistant tokens in the batch."""
        return int(self.assistant_mask.sum())


def to_pil(image: Any) -> Image.Image:
    """A PIL RGB image from a uint8 ``[H, W, 3]`` array or a PIL image.

    Raises:
        ValueError: an array that is not uint8 ``[H, W, 3]``.
    """
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    arr = np.asarray(image)
    if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] != 3:
        raise ValueError(f"images must be uint8 [H, W, 3] arrays, got {arr.dtype} {arr.shape}")
    return Image.fromarray(arr, mode="RGB")


# ------------------------------------------------------------------------------------------------------------ policy
class Policy:
    """A loaded Qwen3-VL model, its processor and (optionally) a LoRA adapter.

    Attributes:
        model: the transformers model, or a ``peft.PeftModel`` wrapping it once an adapter is attached.
        processor: the checkpoint's processor (``Qwen3VLProcessor`` or the tiny image-only subclass).
        path: the checkpoint directory the base model was read from.
        device: where the model lives.
    """

    def __init__(self, model: torch.nn.Module, processor: Any, path: Path, device: torch.device):
        self.model = model
        self.processor = processor
        self.path = Path(path)
        self.device = device
        self._image_cache: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._image_cache_lock = threading.Lock()  # SFT prepares the next batch in a thread
        tok = processor.tokenizer
        tok.padding_side = "left"  # batched generation needs left padding; training batches pad right themselves
        self.image_token_id = int(processor.image_token_id)
        self.im_end_id = int(tok.convert_tokens_to_ids(tiny_mod.IM_END))
        self.pad_id = int(tok.pad_token_id if tok.pad_token_id is not None else tok.convert_tokens_to_ids(tiny_mod.ENDOFTEXT))
        vocab = tok.get_vocab()
        #: Token ids that are never generated (see :data:`daedalus_trainer.tiny.VISION_SPECIAL_TOKENS`).
        self.suppressed_token_ids = sorted(vocab[t] for t in tiny_mod.VISION_SPECIAL_TOKENS if t in vocab)
        #: Token ids that end an assistant reply: ``<|im_end|>`` and ``<|endoftext|>`` (as Qwen's generation config).
        self.stop_token_ids = sorted({self.im_end_id, int(vocab.get(tiny_mod.ENDOFTEXT, self.im_end_id))})

    # -- introspection ---------------------------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        """The processor's tokenizer."""
        return self.processor.tokenizer

    @property
    def has_adapter(self) -> bool:
        """True once a LoRA adapter is attached (:meth:`add_lora`, :meth:`load_adapter`)."""
        from peft import PeftModel

        return isinstance(self.model, PeftModel)

    @property
    def base_model(self) -> torch.nn.Module:
        """The underlying ``Qwen3VLForConditionalGeneration`` (LoRA layers, if any, are inside its modules)."""
        return self.model.get_base_model() if self.has_adapter else self.model

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """Parameters with ``requires_grad`` (the LoRA matrices once an adapter is attached; all weights otherwise)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    # -- LoRA ------------------------------------------------------------------------------------------------------
    def add_lora(self, lora: Any) -> None:
        """Attach a fresh, trainable LoRA adapter and freeze the base weights.

        Args:
            lora: ``LoraSpec``-like object with ``rank``, ``alpha``, ``dropout``, ``target_modules``.

        Raises:
            ValueError: a target that matches a vision-tower module or no module at all (see
                :func:`check_lora_targets`), or an adapter is already attached.
        """
        from peft import get_peft_model

        if self.has_adapter:
            raise ValueError("a LoRA adapter is already attached")
        check_lora_targets(self.model, list(lora.target_modules))
        self.model = get_peft_model(self.model, lora_config(lora))

    def load_adapter(self, path_or_state: str | Path | dict[str, torch.Tensor], trainable: bool = True) -> None:
        """Load adapter weights: a PEFT adapter directory, or a state dict from :meth:`adapter_state`.

        A directory attaches the adapter when none is attached yet (its own ``adapter_config.json`` decides rank and
        targets, which are checked like :meth:`add_lora`'s); otherwise it replaces the attached adapter's weights.
        A state dict (PEFT key names; for a ``Linear`` target ``...lora_A.weight`` ``[r, in_features]`` and
        ``...lora_B.weight`` ``[out_features, r]``, any device) requires an attached adapter of the same shapes.

        Raises:
            FileNotFoundError: a directory without ``adapter_config.json``.
            ValueError: a state dict without an attached adapter, missing or unexpected keys (other targets),
                weights of other shapes than the attached adapter's (another rank), or vision targets. Nothing is
                loaded then: the attached adapter keeps its weights.
            ModelLoadError: the directory's config does not parse, or its weights are missing or cannot be read.
        """
        from peft import PeftConfig, PeftModel, set_peft_model_state_dict
        from safetensors import SafetensorError

        if isinstance(path_or_state, (str, Path)):
            path = Path(path_or_state)
            if not (path / ADAPTER_CONFIG).is_file():
                raise FileNotFoundError(f"{path} is not a PEFT adapter directory (no {ADAPTER_CONFIG})")
            _check_adapter_weights(path)
            if not self.has_adapter:
                try:
                    cfg = PeftConfig.from_pretrained(str(path))
                except (OSError, ValueError) as exc:  # ValueError: adapter_config.json does not parse
                    raise _unloadable("adapter", path, f"{ADAPTER_CONFIG}: {error_reason(exc)}") from exc
                targets = cfg.target_modules
                check_lora_targets(self.model, sorted(targets) if isinstance(targets, (set, list)) else targets)
                try:
                    self.model = PeftModel.from_pretrained(self.model, str(path), is_trainable=trainable)
                except (OSError, SafetensorError) as exc:
                    raise _unloadable("adapter", path, exc) from exc
                return
            from safetensors.torch import load_file

            try:
                state = load_file(str(path / ADAPTER_WEIGHTS))
            except (OSError, SafetensorError) as exc:
                raise _unloadable("adapter", path, exc) from exc
        else:
            state = path_or_state
            if not self.has_adapter:
                raise ValueError("cannot load an adapter state dict: no adapter attached (call add_lora first)")
        # Checked before anything is copied: torch's load_state_dict copies the tensors that match before it raises
        # on one that does not, which would leave the attached adapter half replaced.
        from peft import get_peft_model_state_dict

        current = get_peft_model_state_dict(self.model)
        missing, unexpected = sorted(set(current) - set(state)), sorted(set(state) - set(current))
        if missing or unexpected:
            raise ValueError(f"adapter mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
        shapes = [f"{k}: {tuple(state[k].shape)} for {tuple(current[k].shape)}" for k in sorted(state)
                  if tuple(state[k].shape) != tuple(current[k].shape)]
        if shapes:
            raise ValueError(f"adapter mismatch: {len(shapes)} tensor(s) of other shapes than the attached adapter's "
                             f"(another rank?): {shapes[:3]}")
        state = {k: v.to(self.device) for k, v in state.items()}
        set_peft_model_state_dict(self.model, state)

    def adapter_state(self, copy: bool = True) -> dict[str, torch.Tensor]:
        """The adapter weights as a CPU state dict (PEFT key names; what travels to rollout engines). For a ``Linear``
        target, ``...lora_A.weight`` is ``[r, in_features]`` and ``...lora_B.weight`` ``[out_features, r]``.

        ``copy=False`` returns the live parameters themselves where they already are on the CPU (detached, sharing
        memory): only for a caller that serialises them before the next optimizer step (a Ray actor method's return
        value is serialised as the method returns, into the object store or, when small, inline into the reply).

        Raises:
            ValueError: no adapter attached.
        """
        from peft import get_peft_model_state_dict

        if not self.has_adapter:
            raise ValueError("no adapter attached")
        return {k: v.detach().to("cpu", copy=copy) for k, v in get_peft_model_state_dict(self.model).items()}

    def save_adapter(self, out_dir: str | Path) -> Path:
        """Write the adapter in PEFT format (``adapter_config.json`` + ``adapter_model.safetensors``), servable by vLLM.

        Raises:
            ValueError: no adapter attached.
        """
        if not self.has_adapter:
            raise ValueError("no adapter attached")
        from daedalus_trainer.usage import restore_umask_modes

        out = Path(out_dir)
        self.model.save_pretrained(str(out))
        restore_umask_modes(out)  # safetensors writes 0600
        return out

    def save_pretrained(self, out_dir: str | Path) -> Path:
        """Write the full model (adapter merged into a copy if attached) and processor like a real checkpoint.

        The tiny model's ``daedalus_tiny.json`` is copied along. Returns ``out_dir``.
        """
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        model = self.model
        if self.has_adapter:
            import copy

            model = copy.deepcopy(self.model).merge_and_unload()
        model.save_pretrained(str(out))
        self.processor.save_pretrained(str(out))
        from daedalus_trainer.usage import restore_umask_modes

        restore_umask_modes(out)  # safetensors writes 0600
        meta = self.path / "daedalus_tiny.json"
        if meta.is_file() and meta.resolve() != (out / meta.name).resolve():
            shutil.copyfile(meta, out / meta.name)
        return out

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """Context in which the model is the reference policy, the GRPO start: the frozen start adapter when one was
        added (:meth:`add_reference_adapter`), else the base weights with the adapter disabled.

        Raises:
            ValueError: no adapter attached (without one, the policy is its own reference and the KL term is 0 only
                until the base weights change, which full fine-tuning does).
        """
        if not self.has_adapter:
            raise ValueError("the reference policy needs a LoRA adapter (peft disable_adapter)")
        if REFERENCE_ADAPTER in self.model.peft_config:
            # the start was an SFT adapter: the reference is that adapter, frozen (see :meth:`add_reference_adapter`)
            self.model.set_adapter(REFERENCE_ADAPTER)
            try:
                yield
            finally:
                self.model.set_adapter("default")  # also makes only the trained adapter require grad again
            return
        with self.model.disable_adapter():
            yield

    def add_reference_adapter(self, path: str | Path) -> None:
        """Load the PEFT adapter at ``path`` a second time, frozen, as the reference policy of :meth:`reference`.

        GRPO's KL term is to the starting (SFT) policy. When that start is a full model, disabling the trained
        adapter gives it; when it is itself an adapter (which GRPO trains further, so the exported adapter serves on
        the base model alone), disabling would give the base model instead, so a frozen copy stands in.

        Raises:
            ValueError: no adapter attached yet (load the trained one first).
        """
        if not self.has_adapter:
            raise ValueError("load the trained adapter before its reference copy")
        self.model.load_adapter(str(path), adapter_name=REFERENCE_ADAPTER, is_trainable=False)
        self.model.set_adapter("default")

    # -- batches ---------------------------------------------------------------------------------------------------
    def encode_prompts(self, conversations: Sequence[list[dict[str, Any]]], images: Sequence[Sequence[Any]]) -> Any:
        """:func:`daedalus_trainer.prompts.encode_prompts` with this policy's processor; the processed images are
        remembered (see :meth:`process_images`), so collating the same turns later does not process them again.

        Raises:
            ValueError: ``len(images) != len(conversations)``, or a conversation whose ``<|image_pad|>`` placeholders
                do not match its number of images.
        """
        from daedalus_trainer import prompts

        if len(images) != len(conversations):
            raise ValueError(f"{len(conversations)} conversations but {len(images)} image lists")
        flat = [img for imgs in images for img in imgs]
        if not flat:
            return prompts.encode_prompts(self.processor, conversations, images)
        # The processor's own steps (transformers ProcessorMixin.__call__: image processor, image-pad expansion,
        # tokenizer) with the image processor's output taken from the cache: a rollout turn's pictures mostly
        # recur (a group's episodes start on one picture, and moves into walls leave it unchanged), and processing
        # them was ~11% of a rollout's time (1.4 s of 12.7 s for one 8 x 8 step here). The text-only processor call
        # below does not expand the already expanded pads; tests/unit/test_policy.py checks the result equals
        # prompts.encode_prompts tensor for tensor.
        pixel_values, grid = self.process_images(flat)
        counts = self.image_token_count(grid)
        pad = self.processor.image_token
        texts = []
        k = 0
        for i, (messages, imgs) in enumerate(zip(conversations, images)):
            parts = prompts.render(self.processor, messages).split(pad)
            if len(parts) - 1 != len(imgs):
                raise ValueError(f"conversation {i}: {len(parts) - 1} image placeholder(s) but {len(imgs)} image(s)")
            texts.append(parts[0] + "".join(pad * counts[k + j] + rest for j, rest in enumerate(parts[1:])))
            k += len(imgs)
        enc = self.processor(text=texts, padding=True, padding_side="left", return_tensors="pt")
        enc["pixel_values"] = pixel_values
        enc["image_grid_thw"] = grid
        return enc

    @staticmethod
    def _image_key(img: Any) -> tuple:
        arr = np.asarray(img)
        return (arr.shape, hashlib.blake2b(arr.tobytes(), digest_size=16).digest())

    def _remember(self, key: tuple, value: tuple[torch.Tensor, torch.Tensor]) -> None:
        with self._image_cache_lock:
            self._image_cache[key] = value
            self._image_cache.move_to_end(key)
            if len(self._image_cache) > IMAGE_CACHE_SIZE:
                self._image_cache.popitem(last=False)

    def process_images(self, images: Sequence[Any]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Run the checkpoint's image processor: ``(pixel_values [P, D], image_grid_thw [N, 3])``, or ``(None, None)``.

        Results are cached per image content (the last :data:`IMAGE_CACHE_SIZE` distinct images): the same maze
        picture recurs across turns, batches and the engine/learner of one process.
        """
        if not images:
            return None, None
        pv, grids = [], []
        for img in images:
            key = self._image_key(img)
            with self._image_cache_lock:
                hit = self._image_cache.get(key)
            if hit is None:
                out = self.processor.image_processor(images=[to_pil(img)], return_tensors="pt")
                hit = (out["pixel_values"], out["image_grid_thw"])
            self._remember(key, hit)
            pv.append(hit[0])
            grids.append(hit[1])
        return torch.cat(pv), torch.cat(grids)

    def image_token_count(self, grid_thw: torch.Tensor) -> list[int]:
        """Visual tokens per image: ``t * h * w / merge_size**2`` for each row of ``grid_thw`` ``[N, 3]``."""
        merge = int(self.processor.image_processor.merge_size) ** 2
        return [int(x) // merge for x in grid_thw.prod(-1).tolist()]

    def collate(self, sequences: Sequence[TokenSequence]) -> PolicyBatch:
        """Right-pad ``sequences`` into a :class:`PolicyBatch` on the policy's device: ``B = len(sequences)`` rows,
        ``T`` = the longest ``len(prompt_ids) + len(completion_ids)`` (see :class:`PolicyBatch` for each tensor's
        shape).

        Raises:
            ValueError: empty input, or a sequence whose ``<|image_pad|>`` count does not match its images (the
                tokens must come from the same processor; Qwen3-VL would fail later with a less clear error).
        """
        if not sequences:
            raise ValueError("cannot collate an empty list of sequences")
        all_images = [img for s in sequences for img in s.images]
        pixel_values, grid = self.process_images(all_images)
        counts = self.image_token_count(grid) if grid is not None else []
        k = 0
        for i, s in enumerate(sequences):
            expected = sum(counts[k : k + len(s.images)])
            k += len(s.images)
            got = sum(1 for t in s.prompt_ids if t == self.image_token_id)
            if got != expected:
                raise ValueError(
                    f"sequence {i}: {got} image tokens in the prompt but its {len(s.images)} image(s) need {expected}"
                )
            if any(t == self.image_token_id for t in s.completion_ids):
                raise ValueError(f"sequence {i}: the completion holds image tokens")
        width = max(len(s.prompt_ids) + len(s.completion_ids) for s in sequences)
        n = len(sequences)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((n, width), dtype=torch.long)
        amask = torch.zeros((n, width), dtype=torch.long)
        for i, s in enumerate(sequences):
            row = s.input_ids
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            attn[i, : len(row)] = 1
            amask[i, len(s.prompt_ids) : len(row)] = 1
        mm = (ids == self.image_token_id).long() * attn
        batch = PolicyBatch(ids, attn, amask, mm, pixel_values, grid)
        return batch.to(self.device)

    # -- log-probs -------------------------------------------------------------------------------------------------
    def shared_prefix_length(self, batch: PolicyBatch) -> int:
        """Length P (tokens, ``0 <= P < T``) of the prefix every row of ``batch.input_ids`` ``[B, T]`` shares and
        that may be encoded once.

        The prefix holds no image token and ends before the first assistant token's predecessor, so every assistant
        token is predicted from a suffix position. 0 (no sharing) for a single sequence or a prefix shorter than
        :data:`MIN_SHARED_PREFIX`.
        """
        ids = batch.input_ids
        if ids.shape[0] < 2:
            return 0
        ok = (ids == ids[:1]).all(0) & batch.attention_mask.bool().all(0) & ~batch.mm_token_type_ids.bool().any(0)
        asst = batch.assistant_mask.bool().any(0)
        limit = int(asst.nonzero()[0, 0]) - 1 if asst.any() else ids.shape[1] - 1
        bad = (~ok[:limit]).nonzero()
        p = int(bad[0, 0]) if len(bad) else limit
        return p if p >= MIN_SHARED_PREFIX else 0

    def _hidden_states(self, batch: PolicyBatch, share_prefix: bool) -> tuple[torch.Tensor, int]:
        """Final hidden states ``[B, T - P, H]`` of positions ``P..T-1`` and ``P``.

        With ``share_prefix``, the common prefix (typically the system prompt, :meth:`shared_prefix_length`) is run
        once with batch 1 and its key/value cache is repeated over the batch; gradients flow through the repeat, so
        the result (values and gradients) equals the plain forward up to float rounding, at a fraction of the cost
        when the prompt dominates the sequence. M-RoPE positions come from the whole sequence
        (``get_rope_index``), so they are those of the plain forward.
        """
        base = self.base_model
        vl = base.model
        kwargs: dict[str, Any] = {}
        if batch.pixel_values is not None:
            kwargs["pixel_values"] = batch.pixel_values.to(base.dtype)
            kwargs["image_grid_thw"] = batch.image_grid_thw
        p = self.shared_prefix_length(batch) if share_prefix else 0
        if p == 0:
            out = vl(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                     mm_token_type_ids=batch.mm_token_type_ids, use_cache=False, **kwargs)
            return out.last_hidden_state, 0
        positions, _ = vl.get_rope_index(batch.input_ids, batch.mm_token_type_ids, batch.image_grid_thw,
                                         attention_mask=batch.attention_mask)  # [3, B, T]
        out, _ = self.forward_shared_prefix(batch.input_ids, batch.attention_mask, batch.mm_token_type_ids,
                                            positions, p, **kwargs)
        return out.last_hidden_state, p

    def forward_shared_prefix(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                              mm_token_type_ids: torch.Tensor, positions: torch.Tensor, prefix: int,
                              **vision: Any) -> tuple[Any, Any]:
        """The Qwen3-VL model's forward over ``input_ids`` ``[B, T]`` whose first ``prefix`` tokens are the same in
        every row (no image token among them): the prefix runs once at batch 1 and its key/value cache is repeated
        over the batch, then positions ``prefix..T-1`` run on top of it. ``positions`` ``[3, B, T]`` are the M-RoPE
        positions of the whole layout (``get_rope_index``); ``vision`` is ``pixel_values`` / ``image_grid_thw``.
        ``prefix`` 0 runs everything at once. Returns the model output (``last_hidden_state`` ``[B, T - prefix, H]``)
        and the cache, which holds all ``T`` positions (the rollout engine decodes on from it)."""
        from transformers import DynamicCache

        vl = self.base_model.model
        cache = DynamicCache(config=vl.language_model.config)
        if prefix:
            vl.language_model(inputs_embeds=vl.get_input_embeddings()(input_ids[:1, :prefix]),
                              attention_mask=attention_mask[:1, :prefix], position_ids=positions[:, :1, :prefix],
                              past_key_values=cache, use_cache=True)
            cache.batch_repeat_interleave(input_ids.shape[0])
        out = vl(input_ids=input_ids[:, prefix:], attention_mask=attention_mask, position_ids=positions[:, :, prefix:],
                 past_key_values=cache, use_cache=True, mm_token_type_ids=mm_token_type_ids[:, prefix:], **vision)
        return out, cache

    def _assistant_logits(self, batch: PolicyBatch, temperature: float,
                          share_prefix: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Logits ``[N, V]`` (float32, divided by ``temperature``) predicting the N assistant tokens, the targets
        ``[N]`` and a bool mask ``[B, T]`` of the predicted positions (in ``input_ids`` coordinates).

        Only the assistant positions go through ``lm_head``, which keeps memory at ``N x V`` instead of
        ``B x T x V`` (V is 151k for the real model).
        """
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        hidden, p = self._hidden_states(batch, share_prefix)  # [B, T - p, H]
        target_mask = torch.zeros_like(batch.assistant_mask, dtype=torch.bool)
        target_mask[:, 1:] = batch.assistant_mask[:, 1:].bool()  # position t is predicted from hidden state t-1
        h = hidden[:, :-1][target_mask[:, p + 1 :]]  # [N, H]
        logits = self.base_model.lm_head(h).float() / temperature  # [N, V]
        return logits, batch.input_ids[target_mask], target_mask

    def response_logprobs(self, batch: PolicyBatch, temperature: float = 1.0, share_prefix: bool = True) -> torch.Tensor:
        """Per-token log-probs of the assistant tokens: ``out[b, t] = log softmax(z_{t-1} / temperature)[x_t]``.

        ``z_{t-1}`` are the model's logits after reading ``x_<t`` (multi-turn, multi-image context through the vision
        tower and M-RoPE). Sampling at temperature tau draws from ``softmax(z / tau)``, so pass the rollout
        temperature to get the behaviour policy's log-probs (as TRL's GRPO and verl do); top-p truncation is not
        modelled.

        Args:
            batch: from :meth:`collate`.
            temperature: > 0.
            share_prefix: encode the batch's common prompt prefix once (same values, less compute; see
                :meth:`_hidden_states`).

        Returns:
            float32 ``[B, T]`` aligned with ``batch.input_ids``; 0 where ``assistant_mask`` is 0. Differentiable with
            respect to the trainable parameters (wrap in ``torch.no_grad()`` for old/reference log-probs).

        Raises:
            ValueError: ``temperature`` <= 0.
        """
        logits, targets, mask = self._assistant_logits(batch, temperature, share_prefix)
        lp = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)  # [N]
        out = torch.zeros(mask.shape, dtype=torch.float32, device=lp.device)
        return out.masked_scatter(mask, lp)

    @torch.no_grad()
    def reference_logprobs(self, batch: PolicyBatch, temperature: float = 1.0, share_prefix: bool = True) -> torch.Tensor:
        """:meth:`response_logprobs` of the reference policy (:meth:`reference`), without gradients. ``[B, T]``.

        Raises:
            ValueError: no adapter attached, or ``temperature`` <= 0.
        """
        with self.reference():
            return self.response_logprobs(batch, temperature, share_prefix)

    @torch.no_grad()
    def greedy_match(self, batch: PolicyBatch) -> torch.Tensor:
        """Per-sequence bool ``[B]``: every assistant token is the argmax of the model's (vision-token-suppressed)
        distribution given the reference prefix, i.e. greedy decoding would reproduce the completion exactly.

        Used as SFT's step accuracy (one forward instead of a generation).
        """
        logits, targets, mask = self._assistant_logits(batch, 1.0)
        if self.suppressed_token_ids:
            logits[:, self.suppressed_token_ids] = float("-inf")
        hit = (logits.argmax(-1) == targets).float()
        per_pos = torch.ones(mask.shape, dtype=torch.float32, device=hit.device).masked_scatter(mask, hit)
        return per_pos.bool().all(dim=1)


# ----------------------------------------------------------------------------------------------------------- helpers
def check_lora_targets(model: torch.nn.Module, target_modules: Sequence[str] | str) -> list[str]:
    """Names of the modules ``target_modules`` select, matched the way peft matches them.

    Returns:
        Sorted module names (e.g. ``model.language_model.layers.0.self_attn.q_proj``).

    Raises:
        ValueError: a target selects a module of the vision tower (``*.visual.*``), or selects nothing.
    """
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    targets = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    adaptable = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
    names = [n for n, m in model.named_modules() if isinstance(m, adaptable) or hasattr(m, "base_layer")]
    selected: set[str] = set()
    for target in targets:
        cfg = LoraConfig(target_modules=target if isinstance(target_modules, str) else [target])
        hits = [n for n in names if check_target_module_exists(cfg, n)]
        vision = [n for n in hits if _is_vision_module(n)]
        if vision:
            raise ValueError(
                f"LoRA target {target!r} selects vision-tower modules ({vision[0]}, ... {len(vision)} in all); "
                "vLLM ignores LoRA on Qwen3-VL's vision tower, so only language-model modules may be adapted, "
                "e.g. q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"
            )
        if not hits:
            raise ValueError(f"LoRA target {target!r} matches no linear, embedding or convolution module of the model")
        selected.update(hits)
    return sorted(selected)


class PatchLinearConv3d(torch.nn.Conv3d):
    """A ``Conv3d`` computed as one matrix product when its input is exactly one kernel (stride = kernel, no padding).

    Qwen3-VL's patch embedding is such a convolution: each ``[3, 2, 16, 16]`` patch maps to one vector. On CPU,
    oneDNN's Conv3d is ~4x slower than the equivalent ``linear`` for this shape (measured here, one thread, 2048
    patches of the tiny model: forward + backward 56 ms vs 14 ms). Same
    parameters and state-dict keys as ``Conv3d``; any other input shape falls back to the convolution.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[N, in_channels, *kernel_size]`` (N patches; ``[N, 3, 2, 16, 16]`` for Qwen3-VL) to
        ``[N, out_channels, 1, 1, 1]``; other shapes go through ``Conv3d.forward``."""
        if (x.dim() == 5 and tuple(x.shape[2:]) == tuple(self.kernel_size) and tuple(self.stride) == tuple(
                self.kernel_size) and self.groups == 1 and all(p == 0 for p in self.padding)):
            out = torch.nn.functional.linear(x.reshape(x.shape[0], -1), self.weight.reshape(self.out_channels, -1),
                                             self.bias)
            return out.view(x.shape[0], self.out_channels, 1, 1, 1)
        return super().forward(x)


def _batched_vision_attention_class() -> type:
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionAttention, apply_rotary_pos_emb_vision

    class BatchedVisionAttention(Qwen3VLVisionAttention):
        """Qwen3-VL vision attention that attends within all images of a batch in one ``scaled_dot_product_attention``
        call when they have the same number of patches (always so for maze pictures of one size).

        The transformers implementation loops over images for every attention backend but flash-attention (one
        call per image and layer: 64 tiny calls per step for 32 images, ~15% of a tiny-model SFT step on CPU). The
        math is the same block-diagonal attention; images of different sizes fall back to the loop.
        """

        def forward(self, hidden_states, cu_seqlens, position_embeddings=None, max_seqlen=None, **kwargs):  # noqa: D102
            lengths = cu_seqlens[1:] - cu_seqlens[:-1]
            if (self.config._attn_implementation not in ("sdpa", "eager") or len(lengths) < 2
                    or bool((lengths != lengths[0]).any()) or self.training and self.attention_dropout):
                return super().forward(hidden_states, cu_seqlens, position_embeddings, max_seqlen, **kwargs)
            seq, n, per = hidden_states.shape[0], len(lengths), int(lengths[0])
            q, k, v = self.qkv(hidden_states).reshape(seq, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
            cos, sin = position_embeddings
            q, k = apply_rotary_pos_emb_vision(q, k, cos, sin)  # [seq, heads, d]
            q, k, v = (t.reshape(n, per, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))  # [n, heads, per, d]
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=self.scaling)
            return self.proj(out.transpose(1, 2).reshape(seq, -1))

    return BatchedVisionAttention


def use_fast_vision_paths(model: torch.nn.Module) -> int:
    """Switch, in place, the vision patch embedding to :class:`PatchLinearConv3d` and the vision attention to one
    batched call per layer (see ``BatchedVisionAttention``); same parameters, same values up to float rounding.
    Returns the number of modules switched (0 for models without a Qwen3-VL vision tower)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionAttention

    batched = None
    n = 0
    for name, module in model.named_modules():
        if name.endswith("patch_embed.proj") and type(module) is torch.nn.Conv3d:
            module.__class__ = PatchLinearConv3d
            n += 1
        elif type(module) is Qwen3VLVisionAttention:
            batched = batched or _batched_vision_attention_class()
            module.__class__ = batched
            n += 1
    return n


def _is_vision_module(name: str) -> bool:
    parts = name.split(".")
    return "visual" in parts or "vision_tower" in parts


def torch_dtype(name: str, device: torch.device) -> torch.dtype:
    """The torch dtype for ``model.dtype``; float32 on CPU whatever the spec says (bf16 matmuls are slow there).

    Raises:
        ValueError: unknown dtype name.
    """
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}")
    return torch.float32 if device.type == "cpu" else DTYPES[name]


def default_device() -> torch.device:
    """``cuda`` when a GPU is visible, else ``cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def is_checkpoint_dir(path: str | Path | None) -> bool:
    """True when ``path`` holds a Hugging Face model checkpoint (``config.json``)."""
    return path is not None and (Path(path) / "config.json").is_file()


def is_adapter_dir(path: str | Path | None) -> bool:
    """True when ``path`` holds a PEFT adapter (``adapter_config.json``)."""
    return path is not None and (Path(path) / ADAPTER_CONFIG).is_file()


def resolve_base_dir(model_spec: Any, work_dir: str | Path | None = None, tiny_spec: tiny_mod.TinySpec | None = None) -> Path:
    """The checkpoint directory of the base model, building the tiny checkpoint first when needed.

    Order: ``model.path`` if it holds a checkpoint; else, when ``model.tiny``, the tiny model is built into
    ``model.path`` (if given) or ``<work_dir>/tiny-base`` (kept, so every stage of a run loads the same weights).
    A ``tiny-base`` whose build was killed part-way (no ``daedalus_tiny.json``, written last) is built again: the
    build is deterministic, so the weights are the ones the finished build would have had.

    Raises:
        FileNotFoundError: not tiny and ``model.path`` is unset or holds no ``config.json`` (no downloads).
    """
    path = getattr(model_spec, "path", None)
    if is_checkpoint_dir(path):
        return Path(path)
    if getattr(model_spec, "tiny", False):
        target = Path(path) if path else (Path(work_dir) if work_dir else Path.cwd()) / TINY_BASE_DIRNAME
        if not (is_checkpoint_dir(target) if path else tiny_mod.is_built_tiny_checkpoint(target)):
            tiny_mod.build_tiny_checkpoint(target, tiny_spec)
        return target
    raise FileNotFoundError(
        f"model.path {path!r} holds no Hugging Face checkpoint (config.json); Daedalus never downloads models at run "
        "time: copy the checkpoint to a local or shared volume and set model.path, or set model.tiny for the CPU model"
    )


def load_pretrained(path: str | Path, dtype: str = "float32", device: torch.device | str | None = None) -> Policy:
    """Load a checkpoint directory as a :class:`Policy` without adapter (``local_files_only``).

    Raises:
        FileNotFoundError: ``path`` holds no ``config.json``.
        ValueError: unknown ``dtype``, or the checkpoint's processor is not a vision-language one (no
            ``image_processor``).
        ModelLoadError: ``config.json`` is there but the checkpoint cannot be loaded: a config that does not parse
            or is not a vision-language model's, weights missing, truncated or not weights at all (Git LFS pointers).
    """
    from safetensors import SafetensorError
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist (expected a model directory with config.json)")
    if not is_checkpoint_dir(path):
        raise FileNotFoundError(f"{path} holds no Hugging Face checkpoint (config.json)")
    dev = torch.device(device) if device is not None else default_device()
    dtype_ = torch_dtype(dtype, dev)
    try:  # transformers reports a config that does not parse, and missing weights, as OSError
        model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=dtype_, local_files_only=True)
        processor = AutoProcessor.from_pretrained(str(path), local_files_only=True)
    except (OSError, SafetensorError) as exc:
        raise _unloadable("model", path, exc) from exc
    except ValueError as exc:  # e.g. a text-only model: its config class has no image-text-to-text model
        raise ModelLoadError(
            f"cannot load the model in {path} as a vision-language model: {error_reason(exc)}") from exc
    model = model.to(dev)
    use_fast_vision_paths(model)
    if not hasattr(processor, "image_processor"):
        raise ValueError(f"{path}: AutoProcessor returned {type(processor).__name__}, not a vision-language processor")
    return Policy(model, processor, path, dev)


#: Index files of a sharded checkpoint (transformers' ``SAFE_WEIGHTS_INDEX_NAME`` / ``WEIGHTS_INDEX_NAME``): their
#: ``weight_map`` names every shard.
WEIGHT_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def check_weight_files(path: str | Path, what: str) -> None:
    """Check the weight files of the model or adapter directory ``path`` without loading them (milliseconds): there
    is at least one (``*.safetensors`` or ``*.bin``); every shard a sharded checkpoint's index
    (:data:`WEIGHT_INDEX_FILES`) names is there; each file can be read by this process; each ``*.safetensors``
    header reads (safetensors checks it against the file's length, so a file cut short by a copy or a save, an empty
    one or a Git LFS pointer fails); each ``*.bin`` starts as ``torch.save`` writes (a zip archive, or a pickle for
    torch < 1.6). A byte changed inside the tensor data is not seen (Daedalus's own checkpoints carry sha256
    manifests for that).

    Raises:
        ModelLoadError: one of these does not hold (``what``: ``"model"`` or ``"adapter"``, for the message).
    """
    import safetensors

    path = Path(path)
    files = sorted(f for f in path.iterdir() if f.suffix in (".safetensors", ".bin") and f.is_file()
                   and f.name != "training_args.bin")  # the Trainer's pickled arguments, not weights
    if not files:
        raise ModelLoadError(f"cannot load the {what} in {path}: it has no weight files (*.safetensors or *.bin): "
                             "copy or save it again")
    for index in WEIGHT_INDEX_FILES:
        if (path / index).is_file():
            try:
                shards = set(json.loads((path / index).read_text(encoding="utf-8"))["weight_map"].values())
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise _unloadable(what, path, f"{index}: {error_reason(exc)}") from exc
            missing = sorted(name for name in shards if not (path / str(name)).is_file())
            if missing:
                raise _unloadable(what, path, f"{index} names shards that are not there: {', '.join(missing[:3])}"
                                  + (f" and {len(missing) - 3} more" if len(missing) > 3 else ""))
    for f in files:
        try:
            with open(f, "rb") as handle:
                head = handle.read(4)
        except PermissionError:
            raise ModelLoadError(f"cannot read {f}: permission denied for uid {os.getuid()} (mode "
                                 f"{f.stat().st_mode & 0o777:o}): make it readable by the user the command runs "
                                 "as") from None
        except OSError as exc:
            raise _unloadable(what, path, f"{f.name}: {error_reason(exc)}") from exc
        if f.suffix == ".bin":
            if not (head.startswith(b"PK\x03\x04") or head.startswith(b"\x80")):
                raise _unloadable(what, path, f"{f.name} is not a torch.save file (it starts with {head!r})")
            continue
        try:
            with safetensors.safe_open(str(f), framework="pt") as reader:
                reader.keys()
        except Exception as exc:  # SafetensorError, OSError: the file cannot be what it claims to be
            raise _unloadable(what, path, f"{f.name}: {error_reason(exc)}") from exc


def check_model_paths(model_spec: Any, *, weights: bool = True) -> None:
    """Check, without loading any weights, that the directories :func:`load_policy` needs for ``model_spec`` are
    here: ``model.sftAdapter`` (when set) is a model directory or a PEFT adapter directory with weights, and the base
    model ``model.path`` holds a checkpoint unless the tiny model is built or the SFT start is a full model; with
    ``weights``, each one's weight files too (:func:`check_weight_files`). Commands call it before they create their
    output directories (``daedalus train`` before Ray starts); :func:`resolve_start`, on every model load, checks the
    paths only (the load itself reports damaged weights).

    Raises:
        FileNotFoundError: naming the field, the path and the way on (Daedalus never downloads models at run time).
        ModelLoadError: a directory is there but its weights are missing or cut short.
    """
    sft = getattr(model_spec, "sft_adapter", None)
    if sft:
        if not Path(sft).exists():
            raise FileNotFoundError(f"model.sftAdapter {sft!r} does not exist on this machine")
        if not (is_adapter_dir(sft) or is_checkpoint_dir(sft)):
            raise FileNotFoundError(f"model.sftAdapter {sft!r} is neither a PEFT adapter directory "
                                    "(adapter_config.json) nor a model directory (config.json) on this machine")
        if is_checkpoint_dir(sft):
            if weights:
                check_weight_files(sft, "model")
            return  # a full model: it replaces the base
        _check_adapter_weights(Path(sft))
        if weights:
            check_weight_files(sft, "adapter")
    path = getattr(model_spec, "path", None)
    if getattr(model_spec, "tiny", False):
        return  # built when missing or incomplete (resolve_base_dir)
    if is_checkpoint_dir(path):
        if weights:
            check_weight_files(path, "model")
        return
    needs = " and model.sftAdapter is an adapter that needs it as its base model" if sft else ""
    raise FileNotFoundError(
        f"model.path {path!r} holds no Hugging Face checkpoint (config.json) on this machine{needs}; Daedalus never "
        "downloads models at run time: copy the checkpoint to a local or shared volume and set model.path, or set "
        "model.tiny for the CPU model")


@dataclass(frozen=True)
class Start:
    """Where a job's starting policy comes from (:func:`resolve_start`).

    Attributes:
        base_dir: the checkpoint directory (``config.json``) the base weights are read from: ``model.sftAdapter``
            when it is a full model (the tiny SFT run is a full fine-tune), else the base model
            (:func:`resolve_base_dir`).
        adapter_dir: ``model.sftAdapter`` when it is a PEFT adapter directory (``adapter_config.json``), loaded on
            top of ``base_dir`` and trained further; None when training starts from a fresh adapter.
    """

    base_dir: Path
    adapter_dir: Path | None


def resolve_start(model_spec: Any, work_dir: str | Path | None = None) -> Start:
    """Locate the starting policy of ``model_spec`` (``ModelSpec``-like: ``path``, ``tiny``, ``sft_adapter``) without
    loading any weights, building the tiny base checkpoint first when it is the base and not built yet.

    A ``model.sftAdapter`` directory holding a full model replaces the base model; one holding a PEFT adapter is
    loaded on top of the base. This is the one place that decides it: :func:`load_policy` (learner, transformers
    rollouts) and the vLLM rollout engine (which reads the base from disk itself) both follow it.

    Raises:
        FileNotFoundError: as :func:`check_model_paths` (a missing start or base model; no downloads).
    """
    sft = getattr(model_spec, "sft_adapter", None)
    check_model_paths(model_spec, weights=False)  # the commands checked the weight files before starting
    base_dir = Path(sft) if is_checkpoint_dir(sft) else resolve_base_dir(model_spec, work_dir)
    return Start(base_dir, Path(sft) if sft and is_adapter_dir(sft) else None)


def lora_config(lora: Any, base_model_name_or_path: str | None = None) -> Any:
    """The ``peft.LoraConfig`` of a fresh adapter for ``lora`` (``LoraSpec``-like: ``rank``, ``alpha``, ``dropout``,
    ``target_modules``): what :meth:`Policy.add_lora` attaches (Hu et al. 2021, arXiv:2106.09685; no bias
    training).

    Args:
        lora: the job's ``spec.lora``.
        base_model_name_or_path: recorded in the config as peft's ``get_peft_model`` records the base model's
            ``name_or_path`` (the checkpoint directory it was loaded from); None leaves it unset.
    """
    from peft import LoraConfig

    return LoraConfig(
        r=int(lora.rank), lora_alpha=float(lora.alpha), lora_dropout=float(lora.dropout),
        target_modules=list(lora.target_modules), bias="none", base_model_name_or_path=base_model_name_or_path,
    )


def adapter_config_dict(config: Any) -> dict[str, Any]:
    """The ``adapter_config.json`` content of a peft config (``peft.LoraConfig``, e.g. ``lora_config(...)`` or
    ``peft_model.peft_config["default"]``): ``config.to_dict()`` with sets as sorted lists (peft writes them as
    lists in set order; sorted, the file is the same on every run). Enum values (``peft_type``) are ``str`` enums,
    which ``json.dumps`` writes as their strings, as peft does. ``PeftModel.save_pretrained`` also sets
    ``inference_mode: true`` and the model class's ``auto_mapping`` in the file it writes; PEFT and vLLM load the
    adapter either way (PEFT sets the mode from ``is_trainable``; the mapping only names the class)."""
    cfg = config.to_dict()
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in cfg.items()}


def load_policy(
    model_spec: Any,
    lora: Any | None = None,
    *,
    work_dir: str | Path | None = None,
    device: torch.device | str | None = None,
    trainable: bool = True,
) -> Policy:
    """Load the policy a job describes.

    Args:
        model_spec: ``ModelSpec``-like (``path``, ``tiny``, ``dtype``, ``sft_adapter``).
        lora: ``LoraSpec``-like; when given and the starting point is not already an adapter, a fresh LoRA adapter is
            attached (base weights frozen).
        work_dir: where the tiny base checkpoint is built when ``model.path`` is unset.
        device: default: cuda if available, else cpu.
        trainable: whether a loaded ``sft_adapter`` adapter stays trainable.

    ``model.sft_adapter`` may be a full model directory (then it replaces the base model: the tiny SFT run is a full
    fine-tune) or a PEFT adapter directory (then it is loaded on top of the base and trained further).

    Raises:
        FileNotFoundError: no checkpoint, or ``sft_adapter`` is neither a model nor an adapter directory
            (:func:`check_model_paths`).
        ValueError: vision-tower LoRA targets, or the processor is not a vision-language one (:func:`load_pretrained`).
    """
    dtype = getattr(model_spec, "dtype", "float32")
    start = resolve_start(model_spec, work_dir)
    policy = load_pretrained(start.base_dir, dtype, device)
    if start.adapter_dir is not None:
        sft = getattr(model_spec, "sft_adapter", None)  # as given (a str): what the adapter is loaded and logged as
        policy.load_adapter(sft, trainable=trainable)
        if lora is not None and trainable:
            _warn_ignored_lora(sft, lora)
    elif lora is not None:
        policy.add_lora(lora)
    return policy


def adapter_signature(cfg: Any) -> dict[str, Any]:
    """What makes two LoRA adapters interchangeable: ``{"r", "lora_alpha", "target_modules"}`` of a PEFT
    ``adapter_config.json`` dict (alpha as a float, targets sorted), or of a ``LoraSpec``-like object (``rank``,
    ``alpha``, ``target_modules``): the adapter a fresh ``add_lora`` attaches."""
    if not isinstance(cfg, Mapping):
        cfg = {"r": cfg.rank, "lora_alpha": cfg.alpha, "target_modules": cfg.target_modules}
    targets = cfg.get("target_modules")
    alpha = cfg.get("lora_alpha")
    return {"r": cfg.get("r"), "lora_alpha": None if alpha is None else float(alpha),
            "target_modules": sorted(targets) if isinstance(targets, (list, tuple, set)) else targets}


def read_adapter_config(adapter_dir: str | Path) -> dict[str, Any]:
    """The parsed ``adapter_config.json`` of a PEFT adapter directory."""
    return json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text(encoding="utf-8"))


def _warn_ignored_lora(adapter_dir: str | Path, lora: Any) -> None:
    """Log which ``lora`` fields do not apply: a PEFT SFT adapter is trained further with its own rank, alpha and
    targets (changing them would discard what SFT learned)."""
    own, spec = adapter_signature(read_adapter_config(adapter_dir)), adapter_signature(lora)
    names = {"r": "rank", "lora_alpha": "alpha", "target_modules": "targetModules"}
    differ = [f"lora.{names[k]} {spec[k]!r} -> {own[k]!r}" for k in spec if spec[k] != own[k]]
    if differ:
        log.warning("model.sftAdapter %s is a PEFT adapter: GRPO trains it further with its own settings, so the "
                    "job's %s do not apply", adapter_dir, ", ".join(differ))


def read_tiny_meta(path: str | Path) -> dict[str, Any] | None:
    """The ``daedalus_tiny.json`` of a tiny checkpoint, or None for other checkpoints."""
    f = Path(path) / "daedalus_tiny.json"
    return json.loads(f.read_text()) if f.is_file() else None
