"""Conversation building shared by rollouts and SFT, so that a demonstration is rendered exactly like a rollout turn.

A turn's context is the system prompt (the task instructions of :func:`daedalus_trainer.envs.instructions`) followed
by the last ``history_turns`` observations, each a user message, with the model's replies to the earlier ones as
assistant messages in between::

    system:    <instructions>
    user:      [<feedback of the turn before the window's first>\\n] <image> [\\n<ascii map>]   (oldest in window)
    assistant: move("up")
    ...
    user:      Moved up.\\n <image>                                                       (current observation)
    assistant: <- generated here

``history_turns = 1`` keeps only the current observation (and its feedback), so the prompt holds exactly one image.
A reply put back into the context is first stripped of special-token literals (:func:`history_text`): the model may
spell ``<|image_pad|>`` or ``<|im_end|>`` with ordinary byte tokens, and the tokenizer would read the text back as the
special token (an image pad with no image behind it breaks the forward; an ``<|im_end|>`` forges a turn boundary).
With ``observation = "ascii"`` no image is shown; with ``"image+ascii"`` both.

The rendered text goes through the checkpoint's chat template and processor (:func:`encode_prompts`), which expands
each image into ``<|vision_start|>`` + one ``<|image_pad|>`` per merged visual patch + ``<|vision_end|>``. Rollout
engines and SFT both call these functions; SFT's target is :func:`completion_ids` (the canonical reply's tokens and
``<|im_end|>``), the tokens a rollout engine generates after the prompt.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from daedalus_trainer.envs import instructions

Message = dict[str, Any]

#: Qwen-style special-token literals (``<|im_end|>``, ``<|image_pad|>``, ``<|vision_start|>``, ...): Qwen2/2.5/3-VL
#: tokenizers map each such string in a text to its special token whatever bytes spelled it.
SPECIAL_TOKEN_LITERAL = re.compile(r"<\|[A-Za-z0-9_]+\|>")


def history_text(reply: str) -> str:
    """``reply`` as it may re-enter a prompt: every special-token literal (:data:`SPECIAL_TOKEN_LITERAL`) removed.

    The reply's own tokens (what the learner scores) are untouched; only the text shown in later turns changes.
    Removal repeats until nothing matches: one pass would rebuild ``<|im_end|>`` from ``<|im_<|x|>end|>``.
    """
    while True:
        cleaned = SPECIAL_TOKEN_LITERAL.sub("", reply)
        if cleaned == reply:
            return cleaned
        reply = cleaned


@dataclass(frozen=True)
class PromptSettings:
    """What the prompt shows, from the job's ``environment`` section.

    Attributes:
        action_format: ``function`` | ``tuple`` | ``tag``.
        success_on: ``stop-on-goal`` | ``arrival``.
        observation: ``image`` | ``ascii`` | ``image+ascii``.
        history_turns: observations kept in context, the current one included (>= 1).
        max_turns: the environment's fixed turn limit, stated in the instructions when > 0 (0 = automatic per maze,
            not stated).

    Raises:
        ValueError: ``history_turns`` < 1.
    """

    action_format: str = "function"
    success_on: str = "stop-on-goal"
    observation: str = "image"
    history_turns: int = 1
    max_turns: int = 0

    @classmethod
    def from_env(cls, env: Any) -> PromptSettings:
        """From an ``EnvironmentSpec``-like object."""
        return cls(
            action_format=env.action_format, success_on=env.success_on, observation=env.observation,
            history_turns=int(env.history_turns), max_turns=int(env.max_turns),
        )

    def __post_init__(self) -> None:
        if self.history_turns < 1:
            raise ValueError(f"history_turns must be >= 1, got {self.history_turns}")

    @property
    def shows_image(self) -> bool:
        """True when observations include the picture."""
        return "image" in self.observation

    @property
    def shows_ascii(self) -> bool:
        """True when observations include the text map."""
        return "ascii" in self.observation

    def system_prompt(self) -> str:
        """The task instructions (:func:`daedalus_trainer.envs.instructions`)."""
        return instructions(
            self.action_format, self.success_on, self.observation, self.max_turns if self.max_turns > 0 else None
        )


def user_content(observation: dict[str, Any], settings: PromptSettings) -> tuple[list[dict[str, Any]], list[Any]]:
    """The user message content of one observation and the images it shows.

    Args:
        observation: the environment's observation dict (``image`` uint8 ``[H, W, 3]``, ``ascii``, ``feedback``).

    Returns:
        ``(content, images)``: chat-template content parts (``{"type": "text", "text": ...}``,
        ``{"type": "image"}``) and the images in the order of their parts (0 or 1 image).
    """
    parts: list[dict[str, Any]] = []
    images: list[Any] = []
    feedback = observation.get("feedback") or ""
    if feedback:
        parts.append({"type": "text", "text": feedback + "\n"})
    if settings.shows_image:
        parts.append({"type": "image"})
        images.append(observation["image"])
    if settings.shows_ascii:
        parts.append({"type": "text", "text": ("\n" if settings.shows_image else "") + observation["ascii"]})
    return parts, images


def build_conversation(
    observations: Sequence[dict[str, Any]], replies: Sequence[str], settings: PromptSettings
) -> tuple[list[Message], list[Any]]:
    """Messages and images of the turn after ``observations[-1]``, within the history window.

    Args:
        observations: every observation of the episode so far, ``o_0 .. o_t`` (o_0 from ``reset``).
        replies: the model's replies ``r_0 .. r_{t-1}`` (one fewer than observations), as text; shown through
            :func:`history_text`.
        settings: prompt settings.

    Returns:
        ``(messages, images)``: the system message, then for each of the last ``history_turns`` observations a user
        message, with the reply to each but the last as an assistant message; images in order of appearance
        (``min(history_turns, t + 1)`` of them when images are shown).

    Raises:
        ValueError: ``len(replies) != len(observations) - 1`` or no observation.
    """
    if not observations:
        raise ValueError("need at least one observation")
    if len(replies) != len(observations) - 1:
        raise ValueError(f"expected {len(observations) - 1} replies for {len(observations)} observations, got {len(replies)}")
    t = len(observations) - 1
    first = max(0, t - settings.history_turns + 1)
    messages: list[Message] = [{"role": "system", "content": settings.system_prompt()}]
    images: list[Any] = []
    for k in range(first, t + 1):
        content, imgs = user_content(observations[k], settings)
        messages.append({"role": "user", "content": content})
        images.extend(imgs)
        if k < t:
            messages.append({"role": "assistant", "content": history_text(replies[k])})
    return messages, images


def render(processor: Any, messages: list[Message]) -> str:
    """The checkpoint's chat template applied to ``messages`` with the assistant generation prompt appended."""
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode_prompts(processor: Any, conversations: Sequence[list[Message]], images: Sequence[Sequence[Any]]) -> Any:
    """Render and tokenize a batch of conversations with their images (left-padded, PyTorch tensors).

    Returns the processor's ``BatchFeature``: ``input_ids`` / ``attention_mask`` / ``mm_token_type_ids`` ``[B, T]``
    and, when any image is present, ``pixel_values`` ``[P, D]`` and ``image_grid_thw`` ``[N, 3]``.

    Raises:
        ValueError: ``len(images) != len(conversations)``.
    """
    from daedalus_trainer.policy import to_pil

    if len(images) != len(conversations):
        raise ValueError(f"{len(conversations)} conversations but {len(images)} image lists")
    texts = [render(processor, m) for m in conversations]
    flat = [to_pil(i) for imgs in images for i in imgs]
    return processor(
        text=texts, images=flat or None, padding=True, padding_side="left", return_tensors="pt",
    )


def encode_prompt(processor: Any, messages: list[Message], images: Sequence[Any]) -> list[int]:
    """Token ids of one rendered prompt (image pads expanded), unpadded."""
    enc = encode_prompts(processor, [messages], [list(images)])
    return enc["input_ids"][0].tolist()


def completion_ids(tokenizer: Any, reply: str, im_end_id: int) -> list[int]:
    """The tokens a finished assistant reply consists of: ``tokenize(reply) + [<|im_end|>]`` (SFT targets)."""
    return list(tokenizer.encode(reply, add_special_tokens=False)) + [int(im_end_id)]
