"""Smoke tests of the benchmark and experiment scripts (``bench/``): they are not run by any other test, and the code
they call (``daedalus_trainer``, ``daedalus_operator``, ``tests/support``) keeps changing under them.

- Every script compiles, and every name it takes from the project (``from daedalus_trainer.x import y``,
  ``module.attribute``, including the attributes it patches) exists, and every call of a project function or class
  binds to its current signature (keyword names, number of positional arguments): the drift a refactor leaves
  behind, found without running anything.
- Every script with a command line answers ``--help`` in a subprocess.
- The cheapest real invocation of three scripts (``checkpoint.py``'s is ``slow``, ~20 s), covering the operator
  (``operator_scale.py``: kopf, kmock, the fake KubeRay and Ray Jobs API), the checkpoint path with a local Ray
  (``checkpoint.py``) and the in-process trainer (``experiments/grpo_restart_states.py``: ``Learner``,
  ``RolloutWorker``, evaluation, paired gain), with the figures they print checked. The other scripts take
  longer even at their smallest settings (bench/README.md, "Smoke tests").

Scripts run as the README runs them (``python bench/x.py`` from the repository root), with this checkout's packages
first on ``PYTHONPATH``.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
#: Where the scripts' own helper modules live (each script puts its folder on sys.path itself).
HELPER_DIRS = (BENCH / "lib", BENCH / "experiments", ROOT / "tests" / "support")
SCRIPTS = sorted(p for p in BENCH.rglob("*.py"))
CLI_SCRIPTS = [p for p in SCRIPTS if "parse_args(" in p.read_text()]
PROJECT = ("daedalus_trainer", "daedalus_operator")


def script_env() -> dict[str, str]:
    """The environment of a script run: this checkout's packages and test helpers first, one thread, no Ray address
    inherited (a script's ``init_ray(local=True)`` starts its own)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    paths = [str(ROOT / "operator"), str(ROOT / "trainer"), str(ROOT / "tests" / "support")]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", RAY_USAGE_STATS_ENABLED="0")
    return env


def run_script(rel: str, *args: str, timeout: float) -> str:
    """Run ``python bench/<rel> args...`` from the repository root; return stdout + stderr (fails on a non-zero
    exit)."""
    t = time.perf_counter()
    res = subprocess.run([sys.executable, str(BENCH / rel), *args], cwd=ROOT, env=script_env(), capture_output=True,
                         text=True, timeout=timeout)
    out = res.stdout + res.stderr
    assert res.returncode == 0, f"bench/{rel} {' '.join(args)} exited {res.returncode} after " \
                                f"{time.perf_counter() - t:.1f} s:\n{out[-6000:]}"
    return out


def number(pattern: str, text: str) -> float:
    """The first group of ``pattern`` in ``text`` as a float (commas removed)."""
    m = re.search(pattern, text)
    assert m is not None, f"no match for {pattern!r} in:\n{text[-4000:]}"
    return float(m.group(1).replace(",", ""))


# -- static check: names and signatures of what the scripts use from the project ----------------------------------

def _resolve_module(name: str) -> types.ModuleType | None:
    """The module a script imports, if it is the project's or one of the bench / test helpers; else None."""
    top = name.split(".")[0]
    if top in PROJECT:
        return importlib.import_module(name)
    if "." not in name and any((d / f"{name}.py").is_file() for d in HELPER_DIRS):
        for d in HELPER_DIRS:
            if str(d) not in sys.path:
                sys.path.append(str(d))
        return importlib.import_module(name)
    return None


def project_api_problems(source: str, filename: str = "<script>") -> list[str]:
    """What in ``source`` no longer matches the project: imported names that do not exist, attributes read or
    assigned on an imported module or class that do not exist, and calls of an imported function or class whose
    arguments do not bind to its signature. Calls with ``*args``/``**kwargs`` and calls on instances are not checked.
    """
    tree = ast.parse(source, filename)
    problems: list[str] = []
    bound: dict[str, object] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            module = _resolve_module(node.module)
            if module is None:
                continue
            for alias in node.names:
                if hasattr(module, alias.name):
                    bound[alias.asname or alias.name] = getattr(module, alias.name)
                elif hasattr(module, "__path__") and node.module.split(".")[0] in PROJECT and \
                        importlib.util.find_spec(f"{node.module}.{alias.name}") is not None:  # a submodule
                    bound[alias.asname or alias.name] = importlib.import_module(f"{node.module}.{alias.name}")
                else:
                    problems.append(f"line {node.lineno}: {node.module} has no {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PROJECT:
                    module = importlib.import_module(alias.name)
                    bound[alias.asname or alias.name.split(".")[0]] = module if alias.asname else \
                        importlib.import_module(alias.name.split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            owner = bound[node.value.id]
            if isinstance(owner, (types.ModuleType, type)) and not hasattr(owner, node.attr):
                problems.append(f"line {node.lineno}: {node.value.id}.{node.attr} does not exist")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in bound:
                target, label = bound[func.id], func.id
            elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in bound \
                    and isinstance(bound[func.value.id], (types.ModuleType, type)) \
                    and hasattr(bound[func.value.id], func.attr):
                target, label = getattr(bound[func.value.id], func.attr), f"{func.value.id}.{func.attr}"
            else:
                continue
            if not callable(target) or any(isinstance(a, ast.Starred) for a in node.args) \
                    or any(k.arg is None for k in node.keywords):
                continue
            try:
                signature = inspect.signature(target)
            except (TypeError, ValueError):
                continue
            try:
                signature.bind(*[None] * len(node.args), **{k.arg: None for k in node.keywords})
            except TypeError as e:
                problems.append(f"line {node.lineno}: {label}(...) does not match {label}{signature}: {e}")
    return problems


def test_the_static_check_finds_drift():
    """The check is not vacuous: a missing name, a missing attribute (also one being patched), a call with a
    keyword the function no longer takes and one without an argument it now requires are each reported; the current
    use of the same functions is not."""
    good = ("from daedalus_trainer import sft\nfrom daedalus_trainer.tiny import build_tiny_checkpoint\n"
            "build_tiny_checkpoint('x', spec=None)\nsft.run_sft(None, 'out', resume=False, final_eval=False)\n")
    assert project_api_problems(good) == []
    bad = ("from daedalus_trainer import sft\nfrom daedalus_trainer.tiny import build_tiny_checkpoint, no_such_name\n"
           "import daedalus_trainer.policy as pm\npm.no_such_function = None\n"
           "build_tiny_checkpoint('x', tiny_spec=None)\nsft.run_sft(None, 'out', resume=False, finalEval=False)\n"
           "sft.check_same_run(job=None)\n")
    problems = "\n".join(project_api_problems(bad))
    assert "daedalus_trainer.tiny has no no_such_name" in problems
    assert "pm.no_such_function does not exist" in problems
    assert "build_tiny_checkpoint(...)" in problems and "tiny_spec" in problems
    assert "sft.run_sft(...)" in problems and "finalEval" in problems
    assert "sft.check_same_run(...)" in problems and "missing a required argument: 'ckpt'" in problems


@pytest.mark.parametrize("script", SCRIPTS, ids=[str(p.relative_to(BENCH)) for p in SCRIPTS])
def test_script_compiles_and_matches_the_project_api(script: Path):
    source = script.read_text()
    compile(source, str(script), "exec")
    assert project_api_problems(source, str(script)) == []


@pytest.mark.parametrize("script", CLI_SCRIPTS, ids=[str(p.relative_to(BENCH)) for p in CLI_SCRIPTS])
def test_script_help(script: Path):
    out = run_script(str(script.relative_to(BENCH)), "--help", timeout=60)
    assert "usage:" in out and "--help" in out


def test_every_benchmark_and_experiment_is_covered():
    """The lists above are the folders' contents: a new script is checked without editing this file."""
    names = {str(p.relative_to(BENCH)) for p in CLI_SCRIPTS}
    assert {"checkpoint.py", "grpo_vs_sft.py", "operator_scale.py", "recovery.py", "trainer_vs_trl.py",
            "experiments/paired_gain.py", "gpu/rollout_step.py"} <= names
    assert len(names) >= 19


# -- the cheapest real runs -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A random-weight tiny Qwen3-VL checkpoint (~1 s), the start model of the experiment runs."""
    from daedalus_trainer.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("bench-tiny"))


def test_operator_scale_with_three_jobs():
    """3 jobs through the real operator process, kmock, the fake KubeRay and the fake Ray Jobs API: every job gets
    its RayCluster and runs, each child is created exactly once per job, and the operator's own histogram and RSS
    are read."""
    out = run_script("operator_scale.py", "--jobs", "3", "--steady-seconds", "1", "--timeout", "120", timeout=180)
    clusters = number(r"all 3 RayClusters after ([0-9.]+) s", out)
    running = number(r"all Running after ([0-9.]+) s", out)
    assert 0 < clusters <= running < 120
    assert number(r"operator_scale: ([0-9.]+) s to 3 jobs Running", out) == running
    p99 = number(r"operator_scale_p99: ([0-9.]+) s reconcile p99", out)
    assert 0 < p99 < 10
    assert number(r"over (\d+) reconciles", out) >= 3
    assert 50 < number(r"operator RSS\s+peak (\d+) MiB", out) < 1000
    for child in ("rayclusters", "configmaps", "secrets", "networkpolicies"):
        assert number(rf"POST {child} ([0-9.]+)", out) == 1.0, child
    assert number(r"fake KubeRay passes \d+, errors (\d+)", out) == 0


@pytest.mark.slow  # ~20 s, half of it starting Ray
def test_checkpoint_at_rank_1(tmp_path):
    """A rank-1 LoRA of the 8B shapes (2,727,936 parameters, 504 tensors; 33 MB with the AdamW moments): save and
    restore through CheckpointManager against dd, then the async stall through grpo.CheckpointWriter on a local
    Ray."""
    out = run_script("checkpoint.py", "--rank", "1", "--keep-caches", "--dir", str(tmp_path), timeout=240)
    params = 87_293_952 // 32  # the script's docstring: 87,293,952 LoRA parameters at rank 32
    assert number(r"state: ([0-9,]+) LoRA parameters \(rank 1, 504 tensors\)", out) == params
    assert number(r"learner actor holds ([0-9,]+) LoRA parameters", out) == params
    mb = number(r"checkpoint: ([0-9.]+) MB", out)
    assert 3 * 4 * params / 1e6 < mb < 3 * 4 * params / 1e6 + 1  # adapter + 2 moments in fp32, + small JSON files
    assert "drop_caches: skipped (--keep-caches)" in out
    m = re.search(r"checkpoint_save: ([0-9.]+) MB/s \(dd conv=fsync: ([0-9.]+) MB/s, ([0-9.]+)x\)", out)
    assert m is not None, out[-3000:]
    ours, dd, ratio = map(float, m.groups())
    assert ours > 0 and dd > 0 and ratio == pytest.approx(ours / dd, abs=0.06)
    assert number(r"checkpoint_restore: ([0-9.]+) MB/s", out) > 0
    stall = number(r"checkpoint_stall_async: ([0-9.]+) % of a step", out)
    assert 0 <= stall < 100
    assert len(re.findall(r"async repeat \d: loop stall", out)) == 5
    assert list(tmp_path.iterdir()) == []  # the script removes its work directory


def test_grpo_restart_states_one_step(tiny_model, tmp_path):
    """One in-process GRPO step with restarts at greedy failures (2 mazes x G=2, one turn), held-out greedy success
    on 8 layouts x 4 corner pairs before and after, and the paired gain."""
    out = run_script("experiments/grpo_restart_states.py", str(tiny_model), "1", "environment.evalMazes=8",
                     "environment.maxTurns=1", "algorithm.mazesPerStep=2", "algorithm.groupSize=2",
                     "--work-dir", str(tmp_path), timeout=180)
    evals = re.findall(r"EVAL step (\d+) ([0-9.]+) \((\d+)/(\d+)\)", out)
    assert [(int(s), int(n)) for s, _, _, n in evals] == [(0, 32), (1, 32)]
    for _, rate, wins, n in evals:
        assert float(rate) == pytest.approx(int(wins) / int(n))
    step = re.search(r"^0 success ([0-9.]+) restarted (\d+) zero-variance groups (\d+) grad norm ([0-9.]+)", out,
                     re.MULTILINE)
    assert step is not None, out[-3000:]
    assert 0 <= float(step.group(1)) <= 1 and int(step.group(2)) <= 2 and int(step.group(3)) <= 2
    gain = re.search(r"gain ([-+][0-9.]+) points \[([-+][0-9.]+), ([-+][0-9.]+)\]; fixed (\d+), broken (\d+)", out)
    assert gain is not None, out[-3000:]
    points, low, high = map(float, gain.groups()[:3])
    fixed, broken = int(gain.group(4)), int(gain.group(5))
    assert low <= points <= high and fixed + broken <= 32
    (_, _, before, _), (_, _, after, _) = evals
    assert points == pytest.approx(100 * (int(after) - int(before)) / 32, abs=0.05)
    assert int(after) - int(before) == fixed - broken
