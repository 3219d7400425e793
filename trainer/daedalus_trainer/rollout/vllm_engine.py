"""vLLM rollout engine (GPU): offline ``vllm.LLM`` with LoRA adapters loaded per version.

Imports vLLM only when an engine is constructed, so this module imports on machines without it (CPU CI). It is
exercised only where vLLM and a GPU exist; the CPU path uses :class:`~daedalus_trainer.rollout.engine.
TransformersEngine` behind the same :class:`~daedalus_trainer.rollout.engine.RolloutEngine` interface.

Design (docs/engineering-notes.md, "vLLM rollout design"):

- New weights arrive as LoRA adapters: each :meth:`VLLMEngine.load_adapter` registers a new ``LoRARequest`` id
  (``enable_lora``), so no in-place weight reload and no encoder-cache reset is needed. vLLM applies LoRA to
  Qwen3-VL's language model only (by default; vision-tower LoRA is an experimental opt-in there), which is why
  :func:`daedalus_trainer.policy.check_lora_targets` refuses vision targets.
- The learner publishes adapter *tensors* (megabytes, never the base weights). vLLM loads adapters from directories,
  so the engine writes each version to ``<adapter_dir>/v<version>/`` with the ``adapter_config.json`` it was given
  (:func:`daedalus_trainer.policy.adapter_config_dict`) and deletes older version directories, keeping the current
  and the previous one: disk use stays two adapters however long the run.
- vLLM accepts only some ``max_lora_rank`` values (:data:`VLLM_MAX_LORA_RANKS`); the engine asks for the smallest
  that holds the adapter's rank (:func:`vllm_max_lora_rank`).
- Prompts are rendered with the checkpoint's chat template by :mod:`daedalus_trainer.prompts` (the same text the
  transformers engine tokenizes); vLLM's processor expands the image pads, and the exact prompt tokens it used are
  returned (``RequestOutput.prompt_token_ids``).
- Vision special tokens get a logit bias of :data:`SUPPRESS_BIAS` (their probability becomes negligible).
- Log-probs: ``logprobs_mode="processed_logprobs"``: the log-prob of each sampled token under the distribution it was
  sampled from (after temperature, logit bias and top-p). With ``top_p = 1`` this equals the learner's
  ``log softmax(z / T)`` except for the suppressed vision tokens' (negligible) mass. With ``top_p < 1`` it would be
  the truncated, renormalised distribution's, larger than the learner's by log(kept mass) on every token (a ratio of
  0.9 where on-policy it must be 1), so :func:`check_sampling` refuses sampled ``top_p < 1`` (the transformers
  engine records the untruncated log-probs and accepts it).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from daedalus_trainer import prompts
from daedalus_trainer.policy import ADAPTER_CONFIG, ADAPTER_WEIGHTS, to_pil
from daedalus_trainer.rollout.engine import Generation, SamplingParams

#: Logit bias that keeps vision special tokens from being sampled: -100, the lowest value of the OpenAI API's
#: ``logit_bias`` range [-100, 100] (vLLM's OpenAI-compatible server clamps to the same range). A finite bias makes
#: the token's probability negligible, not exactly zero.
SUPPRESS_BIAS = -100.0

#: The ``max_lora_rank`` values vLLM accepts: ``MaxLoRARanks`` in ``vllm/config/lora.py`` (the same list from vLLM
#: 0.26 on; earlier versions had (8, 16, 32, 64[, 128, 256])). Not checked against the 0.33.0 the trainer image pins.
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: Name of an adapter version directory under :attr:`VLLMEngine.adapter_dir`.
_VERSION_DIR = re.compile(r"v\d+")


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts (:data:`VLLM_MAX_LORA_RANKS`) that serves an adapter of ``rank``.
    vLLM sizes its LoRA buffers by it, so a larger value only wastes GPU memory.

    Raises:
        ValueError: ``rank`` < 1 or above the largest, 512 (``lora.rank``'s own limit).
    """
    rank = int(rank)
    for allowed in VLLM_MAX_LORA_RANKS:
        if rank >= 1 and allowed >= rank:
            return allowed
    raise ValueError(f"LoRA rank {rank} cannot be served by vLLM (max_lora_rank is one of {VLLM_MAX_LORA_RANKS})")


def adapter_max_rank(adapter_config: dict[str, Any]) -> int:
    """The largest LoRA rank in a PEFT ``adapter_config.json`` (a dict): ``r``, or a larger one some modules get
    through ``rank_pattern`` (PEFT ``LoraConfig.rank_pattern``: module-name pattern -> rank)."""
    pattern = adapter_config.get("rank_pattern") or {}
    return max([int(adapter_config["r"]), *(int(r) for r in pattern.values())])


class VLLMEngine:
    """:class:`~daedalus_trainer.rollout.engine.RolloutEngine` on vLLM's offline ``LLM``.

    Args:
        model_path: local checkpoint directory of the base model (no downloads).
        history_turns: images per prompt at most (``limit_mm_per_prompt``).
        adapter_config: the ``adapter_config.json`` content (a dict, :func:`daedalus_trainer.policy.
            adapter_config_dict`) written next to adapters given as tensors. None: that of the last adapter loaded
            from a directory (one must be loaded first).
        max_lora_rank: largest adapter rank to serve, rounded up to a value vLLM accepts (:func:`vllm_max_lora_rank`);
            None: the config's largest rank (:func:`adapter_max_rank`), or 64 without a config.
        dtype: ``bfloat16`` (default), ``float16`` or ``float32``.
        gpu_memory_utilization: fraction (0-1] of each GPU's memory vLLM may take (weights, activations, KV cache).
        max_model_len: context length in tokens (prompt, image tokens included, plus the reply).
        tensor_parallel_size / seed: passed to ``vllm.LLM``.
        adapter_dir: where adapters given as state dicts are written (default: a temporary directory).
        llm_kwargs: further ``vllm.LLM`` arguments.

    ``vllm.LLM`` gets ``max_loras=2`` (at most two adapters in one batch); each :meth:`generate` call uses one, that
    of the last :meth:`load_adapter`.

    Raises:
        ImportError: vLLM is not installed (install the ``gpu`` extra).
        ValueError: a rank vLLM cannot serve (:func:`vllm_max_lora_rank`).
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        history_turns: int = 1,
        adapter_config: dict[str, Any] | None = None,
        max_lora_rank: int | None = None,
        dtype: str = "bfloat16",
        gpu_memory_utilization: float = 0.5,
        max_model_len: int = 8192,
        tensor_parallel_size: int = 1,
        seed: int = 0,
        adapter_dir: str | Path | None = None,
        **llm_kwargs: Any,
    ):
        try:
            import vllm
        except ImportError as exc:  # pragma: no cover - depends on the machine
            raise ImportError(
                "VLLMEngine needs vLLM (pip install 'daedalus[gpu]', GPU image); use TransformersEngine on CPU"
            ) from exc
        from transformers import AutoProcessor

        self._vllm = vllm
        self.model_path = str(model_path)
        self.processor = AutoProcessor.from_pretrained(self.model_path, local_files_only=True)
        tok = self.processor.tokenizer
        vocab = tok.get_vocab()
        from daedalus_trainer.tiny import ENDOFTEXT, IM_END, VISION_SPECIAL_TOKENS

        self.suppressed_token_ids = sorted(vocab[t] for t in VISION_SPECIAL_TOKENS if t in vocab)
        self.stop_token_ids = sorted({vocab[t] for t in (IM_END, ENDOFTEXT) if t in vocab})
        if max_lora_rank is None:
            max_lora_rank = adapter_max_rank(adapter_config) if adapter_config else 64
        #: The ``max_lora_rank`` given to vLLM.
        self.max_lora_rank = vllm_max_lora_rank(max_lora_rank)
        self.llm = vllm.LLM(
            model=self.model_path, dtype=dtype, enable_lora=True, max_lora_rank=self.max_lora_rank, max_loras=2,
            limit_mm_per_prompt={"image": max(1, int(history_turns))}, gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len, tensor_parallel_size=tensor_parallel_size, seed=seed,
            logprobs_mode="processed_logprobs", **llm_kwargs,
        )
        self.adapter_version = 0
        self._lora_request: Any = None
        #: The directory of the adapter served now (None before the first :meth:`load_adapter`).
        self.adapter_path: Path | None = None
        self._adapter_config: dict[str, Any] | None = dict(adapter_config) if adapter_config else None
        self._tmp = None if adapter_dir else tempfile.TemporaryDirectory(prefix="daedalus-adapters-")
        self.adapter_dir = Path(adapter_dir) if adapter_dir else Path(self._tmp.name)

    def load_adapter(self, path_or_state: str | Path | dict[str, Any], version: int) -> None:
        """Serve this adapter from now on as LoRA id ``version + 1``.

        A state dict (PEFT key names, as :meth:`daedalus_trainer.policy.Policy.adapter_state`: ``lora_A``
        ``[r, in_features]``, ``lora_B`` ``[out_features, r]``) is written to ``<adapter_dir>/v<version>`` with the
        engine's ``adapter_config`` (or the ``adapter_config.json`` of the last adapter loaded from a directory); then
        every other ``v<N>`` directory under ``adapter_dir`` but the previously served one is deleted. A directory is
        served where it is (never deleted: it is not the engine's) and its config becomes the one written from then
        on.

        Raises:
            FileNotFoundError: a directory without ``adapter_config.json``.
            ValueError: a state dict while no config is known (no ``adapter_config`` given, no directory loaded).
        """
        from vllm.lora.request import LoRARequest

        written = False
        if isinstance(path_or_state, (str, Path)):
            path = Path(path_or_state)
            if not (path / ADAPTER_CONFIG).is_file():
                raise FileNotFoundError(f"{path} is not a PEFT adapter directory (no {ADAPTER_CONFIG})")
            self._adapter_config = json.loads((path / ADAPTER_CONFIG).read_text())
        else:
            if self._adapter_config is None:
                raise ValueError("no adapter_config: give the engine one, or load an adapter directory first (a state "
                                 "dict carries no adapter_config.json)")
            from safetensors.torch import save_file

            path = self.adapter_dir / f"v{int(version)}"
            path.mkdir(parents=True, exist_ok=True)
            save_file({k: v.detach().cpu().contiguous() for k, v in path_or_state.items()}, str(path / ADAPTER_WEIGHTS))
            (path / ADAPTER_CONFIG).write_text(json.dumps(self._adapter_config, indent=2, sort_keys=True))
            written = True
        previous, self.adapter_path = self.adapter_path, path
        self._lora_request = LoRARequest(lora_name=f"daedalus-v{int(version)}", lora_int_id=int(version) + 1,
                                         lora_path=str(path))
        self.adapter_version = int(version)
        if written:
            self._prune(keep={path, previous})

    def _prune(self, keep: set[Path | None]) -> None:
        """Delete the adapter version directories (``v<N>``) under :attr:`adapter_dir` but those in ``keep``."""
        for entry in self.adapter_dir.iterdir():
            if entry.is_dir() and _VERSION_DIR.fullmatch(entry.name) and entry not in keep:
                shutil.rmtree(entry, ignore_errors=True)

    def version_dirs(self) -> list[Path]:
        """The adapter version directories (``v<N>``) now under :attr:`adapter_dir`, by version."""
        found = [e for e in self.adapter_dir.iterdir() if e.is_dir() and _VERSION_DIR.fullmatch(e.name)]
        return sorted(found, key=lambda e: int(e.name[1:]))

    def generate(
        self, conversations: Sequence[list[dict[str, Any]]], images: Sequence[Sequence[Any]], sampling: SamplingParams
    ) -> list[Generation]:
        """See :class:`~daedalus_trainer.rollout.engine.RolloutEngine`. Request ``i`` is seeded ``seed + i``.

        Raises:
            ValueError: ``len(images) != len(conversations)``, or sampling with ``top_p < 1``
                (:func:`check_sampling`).
            RuntimeError: vLLM returned no log-prob for some sampled token.
        """
        if len(images) != len(conversations):
            raise ValueError(f"{len(conversations)} conversations but {len(images)} image lists")
        check_sampling(sampling)
        requests, params = [], []
        for i, (messages, imgs) in enumerate(zip(conversations, images)):
            req: dict[str, Any] = {"prompt": prompts.render(self.processor, messages)}
            if imgs:
                req["multi_modal_data"] = {"image": [to_pil(x) for x in imgs]}
            requests.append(req)
            params.append(self._vllm.SamplingParams(
                temperature=sampling.temperature, top_p=1.0 if sampling.greedy else sampling.top_p, top_k=0,
                max_tokens=sampling.max_tokens, logprobs=0, stop_token_ids=self.stop_token_ids,
                skip_special_tokens=True, repetition_penalty=1.0,
                logit_bias={t: SUPPRESS_BIAS for t in self.suppressed_token_ids} or None,
                seed=None if sampling.seed is None else sampling.seed + i,
            ))
        outputs = self.llm.generate(requests, params, lora_request=self._lora_request, use_tqdm=False)
        gens = []
        for out, imgs in zip(outputs, images):
            o = out.outputs[0]
            ids = list(o.token_ids)  # vLLM keeps a stop *token* in token_ids (only stop strings are cut)
            if o.logprobs is None or len(o.logprobs) != len(ids):  # GRPO's ratio needs one per sampled token
                raise RuntimeError(f"vLLM returned {0 if o.logprobs is None else len(o.logprobs)} log-probs for "
                                   f"{len(ids)} sampled tokens (SamplingParams(logprobs=0) asks for one each)")
            lps = [float(step[t].logprob) for step, t in zip(o.logprobs, ids)]
            finish = "stop" if o.finish_reason == "stop" else "length"
            gens.append(Generation(o.text, list(out.prompt_token_ids), ids, lps, finish, list(imgs)))
        return gens


def check_sampling(sampling: SamplingParams) -> None:
    """Refuse what this engine cannot sample with the log-probs GRPO needs: sampled (``temperature > 0``) with
    ``top_p < 1``, where vLLM's processed log-probs are those of the truncated distribution, not the learner's
    ``log softmax(z / T)`` (see the module docstring).

    Raises:
        ValueError: ``top_p < 1`` with ``temperature > 0``.
    """
    if not sampling.greedy and sampling.top_p < 1:
        raise ValueError(f"algorithm.topP {sampling.top_p:g} with the vLLM engine: its log-probs would be those of the "
                         "top-p truncated distribution, not the policy's the learner computes (every ratio off by "
                         "the kept mass); use topP 1")
