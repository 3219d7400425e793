"""Shared test set-up: single-threaded math, the session fixtures several tiers share (a short real SFT run, a local
Ray), and how ``make test`` spreads the suite over pytest-xdist workers (each imports torch + transformers once).

``make test`` runs ``pytest -n 2 --dist loadfile --no-loadscope-reorder``: the suite is about half waiting (stand-in
trainers stepping every 0.3 s, a kube-apiserver converging, polls), so two workers on 2 cores finish it sooner than
one process (docs/engineering-notes.md, "Two pytest workers on 2 cores"). A plain ``pytest`` runs everything in one
process, as before.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest
from filelock import FileLock

# tests/support holds helpers every tier imports by module name (fake_kuberay, kmock_api, kuberay, ...).
_SUPPORT = str(Path(__file__).resolve().parent / "support")
if _SUPPORT not in sys.path:
    sys.path.insert(0, _SUPPORT)

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

_TESTS = Path(__file__).resolve().parent

# Test files roughly slowest first: under xdist they start first, so that no long file is left for one worker at the
# end (longest-processing-time-first). Seconds per file, set-up included, in session 31's `make test` (2 cores,
# 2274 s of test time in all, pytest 19 min 36 s): 561, 191, 188, 200, 200 for the cluster tier, 71, 94, 40, 95, 45,
# 131, 56, 67. The second is out of turn: the first two files go one to each worker, and the longer ones wait for the
# session's SFT start (`sft_start`, a minute or two of one core, trained by the first worker that asks), so the second
# worker starts on a file that does not need it. Files not named keep collection order after these.
_LONGEST_FIRST = (
    "e2e/test_grpo_run.py", "operator/test_operator_e2e.py", "e2e/test_daedalus_run.py",
    "operator/test_operator_real_trainer.py", "cluster", "observability/test_dashboards.py",
    "bench/test_bench_smoke.py", "operator/test_submit.py", "e2e/test_grpo_learns.py", "unit/test_vllm_rollout.py",
    "e2e/test_train_endpoint.py", "unit/test_cli.py", "operator/test_operator_kmock.py",
)


def _file_rank(item: pytest.Item) -> int:
    """``item``'s place in ``_LONGEST_FIRST`` (its file's, or ``cluster`` for the API-server tier); unnamed files last."""
    try:
        rel = Path(str(item.path)).resolve().relative_to(_TESTS)
    except ValueError:  # a test outside tests/ (given on the command line)
        return len(_LONGEST_FIRST)
    name = "cluster" if rel.parts[0] == "cluster" else rel.as_posix()
    return _LONGEST_FIRST.index(name) if name in _LONGEST_FIRST else len(_LONGEST_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On a pytest-xdist worker, put the files of ``_LONGEST_FIRST`` first (``--dist loadfile`` hands out whole files
    in this order with ``--no-loadscope-reorder``; xdist's default orders files by their number of tests). A worker
    gets its next file once 2 or fewer of its tests are left, so the order is a rough longest-first, not an exact one.
    A plain ``pytest`` keeps its own order.

    ``loadfile``, not ``loadgroup``: pytest-xdist 3.8 puts a test's group into ``item._nodeid``, which pytest 9.2 no
    longer reads (``Node.nodeid`` is ``str(item._id)``), so groups are silently ignored. Each worker that runs a
    cluster file starts its own control plane (11.8-15.6 s measured)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=_file_rank)  # stable: every file keeps its own order and stays together


_worker_summary: list[str] = []


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """On the xdist controller: keep the summary lines a finished worker sent back (its ``workeroutput``
    ``daedalus_summary``, filled by a tier's ``pytest_sessionfinish``, such as the control plane's start-up)."""
    _worker_summary.extend(getattr(node, "workeroutput", {}).get("daedalus_summary", []))


def pytest_terminal_summary(terminalreporter) -> None:
    """Print the workers' summary lines (nothing without xdist: each tier prints its own)."""
    for line in _worker_summary:
        terminalreporter.write_line(line)


def _shared_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory every xdist worker of this run shares (the parent of the workers' base temps), or this process's
    base temp without xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def sft_start(tmp_path_factory) -> Path:
    """A tiny Qwen3-VL after a short real SFT (format learned, moves partly right): with success on arrival its
    episodes get mixed rewards, so GRPO updates are real. About a minute on 2 cores; under xdist the first worker
    that needs it trains it (the others wait on a file lock) and every worker reads the same directory."""
    from support.jobs import tiny_job_dict

    from daedalus_trainer import sft
    from daedalus_trainer.config import parse_job

    shared = _shared_tmp(tmp_path_factory)
    done = shared / "sft-start.path"  # written last: the path of a finished SFT start
    with FileLock(str(shared / "sft-start.lock")):
        if not done.is_file():
            job = parse_job(tiny_job_dict())
            out = Path(tempfile.mkdtemp(prefix="sft-", dir=shared))
            done.write_text(str(sft.run_sft(job, out, resume=False, progress=False, final_eval=False)))
    return Path(done.read_text())


@pytest.fixture(scope="session")
def local_ray():
    """One local Ray for the session (starting one costs ~5 s and ~0.7 GB)."""
    import ray

    from daedalus_trainer.grpo import init_ray

    init_ray(local=True)
    yield
    ray.shutdown()
