"""Fixtures for end-to-end trainer tests: a short real SFT run (the GRPO starting point) and a local Ray."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.jobs import tiny_job_dict


@pytest.fixture(scope="session")
def sft_start(tmp_path_factory) -> Path:
    """A tiny Qwen3-VL after a short real SFT (format learned, moves partly right): episodes get mixed rewards, so
    GRPO updates are real. ~1 minute on 2 cores."""
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
