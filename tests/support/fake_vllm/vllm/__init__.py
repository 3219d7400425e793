"""A stand-in for the parts of vLLM's offline API that :class:`daedalus_trainer.rollout.vllm_engine.VLLMEngine` uses,
running the real checkpoint with transformers and the real adapters with peft on the CPU. Test support only: it is
importable as ``vllm`` only where a test puts ``tests/support/fake_vllm`` on ``sys.path`` (tests/unit/
test_vllm_rollout.py), never on the suite's path.

What it keeps of vLLM (0.33 offline API, as the engine calls it; not checked against a real install here):

- ``LLM(model=..., enable_lora=True, max_lora_rank=..., max_loras=..., gpu_memory_utilization=..., ...)``: the
  constructor's arguments are kept in :attr:`LLM.kwargs`; ``max_lora_rank`` must be one of vLLM's
  ``MaxLoRARanks`` and ``gpu_memory_utilization`` in (0, 1], as vLLM checks.
- ``LLM.generate(requests, params, lora_request=..., use_tqdm=False)``: requests are ``{"prompt": text,
  "multi_modal_data": {"image": [PIL images]}}``; a new ``LoRARequest`` id reads the adapter directory from disk with
  peft at that moment (as vLLM loads an adapter when the first request that uses it arrives), refusing a rank above
  ``max_lora_rank``; at most ``max_loras`` adapters stay loaded (the least recently used is dropped).
- Sampling: ``temperature`` (0: greedy), ``top_p``, ``max_tokens``, ``stop_token_ids``, ``logit_bias``, ``seed``
  per request; ``logprobs=0`` returns the sampled token's log-prob under the processed distribution (after
  temperature, bias and top-p: vLLM's ``processed_logprobs``); a stop token stays in ``token_ids``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__version__ = "0.0.0+daedalus.stand-in"

#: vLLM's ``MaxLoRARanks`` (vllm/config/lora.py).
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class SamplingParams:
    """vLLM's ``SamplingParams``, the fields the engine sets."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    logprobs: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    skip_special_tokens: bool = True
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None


@dataclass
class Logprob:
    """vLLM's ``Logprob``: the log-probability of one token."""

    logprob: float


@dataclass
class CompletionOutput:
    """vLLM's ``CompletionOutput``: one reply."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str


@dataclass
class RequestOutput:
    """vLLM's ``RequestOutput``: the prompt tokens it read and its replies."""

    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]


class LLM:
    """vLLM's offline ``LLM`` on transformers + peft (see the module docstring).

    Attributes:
        kwargs: every constructor argument, by name.
        loaded_adapters: ``(lora_int_id, lora_path)`` of every adapter read from disk, in order.

    Raises:
        ValueError: a ``max_lora_rank`` vLLM refuses, or ``gpu_memory_utilization`` outside (0, 1].
    """

    def __init__(self, model: str, dtype: str = "auto", enable_lora: bool = False, max_lora_rank: int = 16,
                 max_loras: int = 1, gpu_memory_utilization: float = 0.9, seed: int = 0, **kwargs: Any):
        from transformers import AutoModelForImageTextToText, AutoProcessor

        if max_lora_rank not in MAX_LORA_RANKS:
            raise ValueError(f"max_lora_rank ({max_lora_rank}) must be one of {MAX_LORA_RANKS}")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        self.kwargs = dict(model=model, dtype=dtype, enable_lora=enable_lora, max_lora_rank=max_lora_rank,
                           max_loras=max_loras, gpu_memory_utilization=gpu_memory_utilization, seed=seed, **kwargs)
        self.processor = AutoProcessor.from_pretrained(model, local_files_only=True)
        self.model = AutoModelForImageTextToText.from_pretrained(
            model, dtype=_DTYPES.get(dtype, torch.float32), local_files_only=True).eval()
        self.loaded_adapters: list[tuple[int, str]] = []
        self._adapters: OrderedDict[int, str] = OrderedDict()  # lora_int_id -> peft adapter name, oldest first

    # -- LoRA ------------------------------------------------------------------------------------------------------
    def _use_adapter(self, request: Any) -> None:
        from peft import PeftConfig, PeftModel

        if request is None:
            return
        if not self.kwargs["enable_lora"]:
            raise ValueError("LoRA is not enabled (enable_lora=False)")
        lid = int(request.lora_int_id)
        if lid not in self._adapters:
            path = str(request.lora_path)
            rank = PeftConfig.from_pretrained(path).r
            if rank > self.kwargs["max_lora_rank"]:
                raise ValueError(f"LoRA rank {rank} is greater than max_lora_rank {self.kwargs['max_lora_rank']}")
            name = f"lora{lid}"
            if isinstance(self.model, PeftModel):
                self.model.load_adapter(path, adapter_name=name, is_trainable=False)
            else:
                self.model = PeftModel.from_pretrained(self.model, path, adapter_name=name, is_trainable=False)
            self.loaded_adapters.append((lid, path))
            self._adapters[lid] = name
            while len(self._adapters) > int(self.kwargs["max_loras"]):
                _, old = self._adapters.popitem(last=False)
                self.model.set_adapter(name)
                self.model.delete_adapter(old)
        self._adapters.move_to_end(lid)
        self.model.set_adapter(self._adapters[lid])

    # -- generation ------------------------------------------------------------------------------------------------
    def generate(self, requests: list[dict[str, Any]], params: list[SamplingParams], lora_request: Any = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """One :class:`RequestOutput` per request, each decoded on its own with its own seed."""
        from peft import PeftModel

        if isinstance(params, SamplingParams):
            params = [params] * len(requests)
        self._use_adapter(lora_request)
        outputs = []
        with torch.no_grad():
            if lora_request is None and isinstance(self.model, PeftModel):
                with self.model.disable_adapter():
                    outputs = [self._one(r, p) for r, p in zip(requests, params)]
            else:
                outputs = [self._one(r, p) for r, p in zip(requests, params)]
        return outputs

    def _one(self, request: dict[str, Any], p: SamplingParams) -> RequestOutput:
        from transformers import GenerationConfig

        images = (request.get("multi_modal_data") or {}).get("image") or None
        enc = self.processor(text=[request["prompt"]], images=images, return_tensors="pt")
        prompt = enc["input_ids"][0].tolist()
        tok = self.processor.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else p.stop_token_ids[0]
        common = dict(max_new_tokens=p.max_tokens, eos_token_id=list(p.stop_token_ids), pad_token_id=pad,
                      repetition_penalty=p.repetition_penalty, return_dict_in_generate=True, output_scores=True,
                      sequence_bias={(int(t),): float(b) for t, b in (p.logit_bias or {}).items()} or None)
        config = (GenerationConfig(do_sample=False, **common) if p.temperature == 0 else
                  GenerationConfig(do_sample=True, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                                   **common))
        with torch.random.fork_rng(devices=[]):
            if p.seed is not None:
                torch.manual_seed(p.seed)
            res = self.model.generate(**enc, generation_config=config)
        new = res.sequences[0, len(prompt):].tolist()
        stops = set(p.stop_token_ids)
        end = next((j + 1 for j, t in enumerate(new) if t in stops), None)
        ids = new[:end] if end is not None else new
        logprobs = None
        if p.logprobs is not None:
            logprobs = [{t: Logprob(float(torch.log_softmax(res.scores[k][0].float(), dim=-1)[t]))}
                        for k, t in enumerate(ids)]
        text = tok.decode(ids, skip_special_tokens=p.skip_special_tokens)
        return RequestOutput(prompt, [CompletionOutput(text, ids, logprobs, "stop" if end is not None else "length")])
