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

    Raises:
        ValueError: ``temperature`` < 0, ``top_p`` outside (0, 1], or ``max_tokens`` < 1.
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
        """One reply per conversation (``images[i]`` are the images of ``conversations[i]`` in order: RGB uint8
        ``[H, W, 3]`` numpy arrays, in pixels, or PIL images)."""
        ...

    def load_adapter(self, path_or_state: str | Path | dict[str, torch.Tensor], version: int) -> None:
        """Use this LoRA adapter (PEFT directory, or a state dict as
        :meth:`~daedalus_trainer.policy.Policy.adapter_state` returns: PEFT key names, ``lora_A`` ``[r, in_features]``,
        ``lora_B`` ``[out_features, r]``) from now on; ``version`` is recorded in rollouts."""
        ...


class TransformersEngine:
    """:class:`RolloutEngine` on the transformers model (CPU, tests): batched, the prompts' common prefix encoded
    once, vision special tokens suppressed.

    Args:
        policy: the model to sample from. The engine may share it with a learner in the same process (then new
            weights are used without :meth:`load_adapter`).
        max_batch: conversations per forward batch (larger inputs are split).

    Decoding is a loop of its own rather than ``generate`` so that the system prompt, shared by every prompt of a
    batch, is encoded once (:meth:`_decode`); with the same seed it draws the tokens ``generate`` draws, up to float
    rounding (the prefix runs at batch 1; in bf16 a near-tie may then flip a token; tests/unit/test_policy.py checks
    float32 against ``generate``). ``<|image_pad|>`` and the other vision tokens are
    never sampled (a sampled image pad breaks the next forward: "Image features and image tokens do not match").

    Raises:
        ValueError: ``max_batch`` < 1.
    """

    def __init__(self, policy: Policy, max_batch: int = 64):
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.policy = policy
        self.max_batch = max_batch
        self.adapter_version = 0

    def load_adapter(self, path_or_state: str | Path | dict[str, torch.Tensor], version: int) -> None:
        """Load adapter weights into the policy (see :meth:`Policy.load_adapter`: a PEFT directory, or a state dict
        with ``lora_A`` ``[r, in_features]`` and ``lora_B`` ``[out_features, r]``) and record ``version``.

        Raises:
            FileNotFoundError, ValueError, ModelLoadError: as :meth:`Policy.load_adapter`.
        """
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

    @torch.no_grad()
    def _generate(self, conversations, images, sampling: SamplingParams) -> list[Generation]:
        p = self.policy
        enc = p.encode_prompts(conversations, images)
        rows = [ids[mask.bool()].tolist() for ids, mask in zip(enc["input_ids"], enc["attention_mask"])]
        was_training = p.model.training
        p.model.eval()
        try:
            new, lps = self._decode(rows, enc.get("pixel_values"), enc.get("image_grid_thw"), sampling)  # [B, L]
        finally:
            p.model.train(was_training)
        stops = set(p.stop_token_ids)
        gens: list[Generation] = []
        for i in range(new.shape[0]):
            row = new[i].tolist()
            end = next((j + 1 for j, t in enumerate(row) if t in stops), None)
            finish = "stop" if end is not None else "length"
            ids = row[:end] if end is not None else row
            gens.append(Generation(
                text=p.tokenizer.decode(ids, skip_special_tokens=True),
                prompt_ids=rows[i],
                token_ids=ids,
                logprobs=lps[i, : len(ids)].tolist(),
                finish_reason=finish,
                images=list(images[i]),
            ))
        return gens

    def _decode(self, rows: list[list[int]], pixel_values: torch.Tensor | None, image_grid_thw: torch.Tensor | None,
                sampling: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode up to ``sampling.max_tokens`` tokens after each prompt of ``rows`` (unpadded token ids, image pads
        expanded): the new tokens ``[B, L]`` (a row's tokens after its stop token are the pad id) and the log-prob
        of each ``[B, L]`` under ``softmax(z / sampling.logprob_temperature)`` of the raw logits ``z``.

        The prompts' common prefix (the system prompt: 140 of ~171 tokens of a maze turn) is encoded once and its
        key/value cache repeated over the batch, as the learner does (:meth:`Policy._hidden_states`); the rest of
        each prompt is left-padded after it (``[prefix][pads][suffix]``). M-RoPE positions come from
        ``get_rope_index`` over the whole masked layout, so every token gets the position it has unpadded; a new
        token's position is one past its row's largest (``generate`` extends ``position_ids`` by the last one + 1:
        the same, the last prompt token being text).
        Sampling follows transformers' order (vision special tokens suppressed, then temperature, then top-p
        nucleus truncation, Holtzman et al. 2020, arXiv:1904.09751; then one ``torch.multinomial`` draw over the
        batch), so given a seed the draws are those ``generate`` would make on the same probabilities (which
        equal ours up to float rounding). Measured in
        ``bench/experiments/rollout_profile.py``: a forward over 64 maze prompts 0.48-0.64 s whole, 0.23-0.28 s
        with the prefix shared.
        """
        from daedalus_trainer.policy import MIN_SHARED_PREFIX

        p = self.policy
        base = p.base_model
        vl = base.model
        device = p.device
        n = len(rows)
        shared = _common_prefix(rows, p.image_token_id)
        if shared < MIN_SHARED_PREFIX or n < 2:
            shared = 0
        width = max(len(r) for r in rows) - shared
        ids = torch.full((n, shared + width), p.pad_id, dtype=torch.long)
        attn = torch.zeros((n, shared + width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : shared] = torch.tensor(r[:shared], dtype=torch.long)
            ids[i, shared + width - (len(r) - shared):] = torch.tensor(r[shared:], dtype=torch.long)
            attn[i, : shared] = 1
            attn[i, shared + width - (len(r) - shared):] = 1
        ids, attn = ids.to(device), attn.to(device)
        mm = (ids == p.image_token_id).long() * attn
        kwargs: dict[str, Any] = {}
        if pixel_values is not None:
            image_grid_thw = image_grid_thw.to(device)
            kwargs = {"pixel_values": pixel_values.to(device, base.dtype), "image_grid_thw": image_grid_thw}
        positions, _ = vl.get_rope_index(ids, mm, image_grid_thw, attention_mask=attn)  # [3, B, T]
        out, cache = p.forward_shared_prefix(ids, attn, mm, positions, shared, **kwargs)
        hidden = out.last_hidden_state[:, -1]  # [B, H]
        next_position = positions.amax(dim=(0, 2)) + 1  # [B]
        stops = torch.tensor(p.stop_token_ids, device=device)
        finished = torch.zeros(n, dtype=torch.bool, device=device)
        no_image = torch.zeros((n, 1), dtype=torch.long, device=device)
        tokens, logprobs = [], []
        for k in range(sampling.max_tokens):
            z = base.lm_head(hidden).float()  # [B, V]
            scores = z.clone()
            if p.suppressed_token_ids:
                scores[:, p.suppressed_token_ids] = float("-inf")
            if sampling.greedy:
                token = scores.argmax(-1)
            else:
                scores = scores / sampling.temperature
                if sampling.top_p < 1:
                    scores = _top_p(scores, sampling.top_p)
                token = torch.multinomial(torch.softmax(scores, dim=-1), 1).squeeze(1)
            token = torch.where(finished, torch.full_like(token, p.pad_id), token)
            tokens.append(token)
            logprobs.append(torch.log_softmax(z / sampling.logprob_temperature, dim=-1).gather(-1, token[:, None])[:, 0])
            finished |= torch.isin(token, stops)
            if bool(finished.all()) or k == sampling.max_tokens - 1:
                break
            attn = torch.cat([attn, torch.ones((n, 1), dtype=attn.dtype, device=device)], dim=1)
            out = vl(input_ids=token[:, None], attention_mask=attn,
                     position_ids=(next_position + k).view(1, n, 1).expand(3, n, 1), past_key_values=cache,
                     use_cache=True, mm_token_type_ids=no_image)
            hidden = out.last_hidden_state[:, -1]
        return torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1)


def _common_prefix(rows: Sequence[Sequence[int]], image_token_id: int) -> int:
    """Length of the token prefix all ``rows`` share, ending before any image token and leaving every row at least
    one token of its own (the last prompt token's hidden state gives the first new token)."""
    limit = min(len(r) for r in rows) - 1
    first = rows[0]
    k = 0
    while k < limit and first[k] != image_token_id and all(r[k] == first[k] for r in rows):
        k += 1
    return k


def _top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus truncation of ``scores`` ``[B, V]`` (Holtzman et al. 2020): keep the most probable tokens whose
    probabilities sum to at least ``top_p`` (always the top one), the rest -inf; as transformers' TopPLogitsWarper."""
    sorted_scores, order = torch.sort(scores, descending=False)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1 - top_p
    drop[..., -1:] = False
    return scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
