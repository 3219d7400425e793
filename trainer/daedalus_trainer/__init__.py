"""Daedalus trainer: GRPO with LoRA on Qwen3-VL over visual mazes, checkpoints, metrics, and the `daedalus` CLI.

Importing this package is cheap (no torch); heavy modules are imported by the commands that need them.
"""

__version__ = "0.1.0"
