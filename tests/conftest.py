"""Shared test set-up: one process for the whole suite (torch + transformers import once), single-threaded math,
and the session fixtures several tiers share (a short real SFT run, a local Ray)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# tests/support holds helpers every tier imports by module name (fake_kuberay, kmock_api, kuberay, ...).
_SUPPORT = str(Path(__file__).resolve().parent / "support")
if _SUPPORT not in sys.path:
    sys.path.insert(0, _SUPPORT)

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture(scope="session")
def sft_start(tmp_path_factory) -> Path:
    """A tiny Qwen3-VL after a short real SFT (format learned, moves partly right): with success on arrival its
    episodes get mixed rewards, so GRPO updates are real. About a minute on 2 cores."""
    from support.jobs import tiny_job_dict

    from daedalus_trainer import sft
    from daedalus_trainer.config import parse_job

    job = parse_job(tiny_job_dict())
    out = tmp_path_factory.mktemp("sft")
    return Path(sft.run_sft(job, out, resume=False, progress=False, final_eval=False))


@pytest.fixture(scope="session")
def local_ray():
    """One local Ray for the session (starting one costs ~5 s and ~0.7 GB)."""
    import ray

    from daedalus_trainer.grpo import init_ray

    init_ray(local=True)
    yield
    ray.shutdown()
