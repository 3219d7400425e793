"""Stand-in for ``vllm.lora.request`` (see ``vllm/__init__.py``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LoRARequest:
    """vLLM's ``LoRARequest(lora_name, lora_int_id, lora_path)``: an adapter directory served under a positive id."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be > 0, got {self.lora_int_id}")
