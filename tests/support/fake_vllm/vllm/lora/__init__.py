"""Stand-in for ``vllm.lora`` (see ``vllm/__init__.py``)."""
