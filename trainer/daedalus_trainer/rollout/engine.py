"""Rollout engines: one interface, a transformers implementation (CPU, tests) and a vLLM one (GPU, ``vllm_engine``).

An engine turns a batch of chat conversations with images into assistant replies, and reports for each reply the
exact prompt tokens it read, the tokens it sampled and their log-probabilities, so the learner can recompute the
same log-probs (:meth:`daedalus_trainer.policy.Policy.response_logprobs`) on exactly the same tokens.

Log-probs are those of the sampling distribution before top-p truncation and vision-token suppression:
``log softmax(z / temperature)[token]`` from the model's raw logits ``z`` (temperature 1 for greedy decoding), which
is what the learner's forward computes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from daedalus_trainer.policy import Policy


@dataclass(frozen=True)
class SamplingParams:
    """How replies are decoded.

    Attributes:
        temperature: 0 for greedy decoding; otherwise sampling from ``softmax(logits / temperature)``.
        top_p: nucleus threshold (1 disables it). No top-k: the model's own generation defaults are not used.
        max_tokens: maximum new tokens per reply; a reply cut there has ``finish_reason == "length"``.
        seed: seeds the sampler for this call (reproducible rollouts); None uses the global RNG.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 24
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def greedy(self) -> bool:
        """True for temperature 0."""
        return self.temperature == 0

    @property
    def logprob_temperature(self) -> float:
        """Temperature at which log-probs are reported (1 for greedy)."""
        return 1.0 if self.greedy else self.temperature


@dataclass
class Generation:
    """One reply.

    Attributes:
        text: the decoded reply without special tokens.
        prompt_ids: the exact prompt tokens the engine read (unpadded, image pads expanded).
        token_ids: the generated tokens, ending with a stop token (``<|im_end|>``) when ``finish_reason == "stop"``.
        logprobs: log-prob of each generated token (same length as ``token_ids``), see the module docstring.
        finish_reason: ``"stop"`` or ``"length"``.
    """

    text: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    images: list[Any] = field(default_factory=list)


@runtime_checkable
class RolloutEngine(Protocol):
    """What the episode loop and the GRPO learner need from an inference engine."""

    adapter_version: int

    def generate(
        self, conversations: Sequence[list[dict[str, Any]]], images: Sequence[Sequence[Any]], sampling: SamplingParams
    ) -> list[Generation]:
        """One reply per conversation (``images[i]`` are the images of ``conversations[i]`` in order)."""
        ...

    def load_adapter(self, path_or_state: str | Path | dict[str, torch.Tensor], version: int) -> None:
        """Use this LoRA adapter (PEFT directory or state dict) from now on; ``version`` is recorded in rollouts."""
        ...


class TransformersEngine:
    """:class:`RolloutEngine` on transformers ``generate``: batched, left-padded, vision special tokens suppressed.

    Args:
        policy: the model to sample from. The engine may share it with a learner in the same process (then new
            weights are used without :meth:`load_adapter`).
        max_batch: conversations per ``generate`` call (larger inputs are split).

    Every forward with images passes ``mm_token_type_ids`` (Qwen3-VL's M-RoPE needs it; ``generate`` extends it for
    new tokens). ``<|image_pad|>`` and the other vision tokens are never sampled (a sampled image pad breaks the next
    forward: "Image features and image tokens do not match").
    """

    def __init__(self, policy: Policy, max_batch: int = 64):
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.policy = policy
        self.max_batch = max_batch
        self.adapter_version = 0

    def load_adapter(self, path_or_state: str | Path | dict[str, torch.Tensor], version: int) -> None:
        """Load adapter weights into the policy (see :meth:`Policy.load_adapter`) and record ``version``."""
        self.policy.load_adapter(path_or_state)
        self.adapter_version = int(version)

    def generate(
        self, conversations: Sequence[list[dict[str, Any]]], images: Sequence[Sequence[Any]], sampling: SamplingParams
    ) -> list[Generation]:
        """See :class:`RolloutEngine`. Deterministic for a given ``sampling.seed``.

        Raises:
            ValueError: ``len(images) != len(conversations)``.
        """
        if len(images) != len(conversations):
            raise ValueError(f"{len(conversations)} conversations but {len(images)} image lists")
        out: list[Generation] = []
        with torch.random.fork_rng(devices=[] if self.policy.device.type == "cpu" else [self.policy.device]):
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
            for lo in range(0, len(conversations), self.max_batch):
                hi = lo + self.max_batch
                out.extend(self._generate(conversations[lo:hi], images[lo:hi], sampling))
        return out

    def generation_config(self, sampling: SamplingParams) -> Any:
        """A complete ``GenerationConfig`` for ``sampling`` (the checkpoint's own sampling defaults are not used)."""
        from transformers import GenerationConfig

        p = self.policy
        common = dict(
            max_new_tokens=sampling.max_tokens, eos_token_id=p.stop_token_ids, pad_token_id=p.pad_id,
            suppress_tokens=p.suppressed_token_ids or None, return_dict_in_generate=True, output_logits=True,
            use_cache=True, repetition_penalty=1.0,
        )
        if sampling.greedy:
            return GenerationConfig(do_sample=False, **common)
        return GenerationConfig(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=0,
                                **common)

    @torch.no_grad()
    def _generate(self, conversations, images, sampling: SamplingParams) -> list[Generation]:
        p = self.policy
        enc = p.encode_prompts(conversations, images).to(p.device)
        if "pixel_values" in enc:
            enc["pixel_values"] = enc["pixel_values"].to(p.base_model.dtype)
        was_training = p.model.training
        p.model.eval()
        try:
            res = p.model.generate(**enc, generation_config=self.generation_config(sampling))
        finally:
            p.model.train(was_training)
        width = enc["input_ids"].shape[1]
        new = res.sequences[:, width:]  # [B, L]
        if new.shape[1]:
            logits = torch.stack(res.logits, dim=1).float() / sampling.logprob_temperature  # [B, L, V]
            lps = torch.log_softmax(logits, dim=-1).gather(-1, new[..., None]).squeeze(-1)  # [B, L]
        else:
            lps = new.float()
        stops = set(p.stop_token_ids)
        gens: list[Generation] = []
        for i in range(new.shape[0]):
            row = new[i].tolist()
            end = next((j + 1 for j, t in enumerate(row) if t in stops), None)
            finish = "stop" if end is not None else "length"
            ids = row[:end] if end is not None else row
            mask = enc["attention_mask"][i].bool()
            gens.append(Generation(
                text=p.tokenizer.decode(ids, skip_special_tokens=True),
                prompt_ids=enc["input_ids"][i][mask].tolist(),
                token_ids=ids,
                logprobs=lps[i, : len(ids)].tolist(),
                finish_reason=finish,
                images=list(images[i]),
            ))
        return gens
