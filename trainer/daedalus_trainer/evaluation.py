"""Held-out evaluation: success rate with confidence intervals, turns, format and wall-bump rates, GIFs.

The evaluation set is fixed by ``environment.evalMazes`` and ``environment.evalSeed`` and held out by layout
(:mod:`daedalus_trainer.layouts`). Success is the environment's own (``successOn``): reward 1 only when the task is
solved, never inflated by format terms. ``split="training"`` evaluates the same way on as many mazes on training
layouts, to tell what training learned on the layouts it saw from what carries to unseen ones.

Figures per decoding mode (``greedy``: temperature 0; ``sampled``: the rollout temperature and top-p):

- ``success_rate`` with a 95% interval: with one episode per layout the Wilson score interval (Wilson 1927,
  "Probable inference, the law of succession, and statistical inference", JASA 22(158); recommended over the normal
  interval for small n and rates near 0 or 1 by Brown, Cai & DasGupta 2001, Statistical Science 16(2)); with several
  corner pairs per held-out layout (``environment.evalCorners``) the same interval on the design-effect sample size
  (:func:`clustered_wilson_interval`), since episodes on one layout are not independent;
- :func:`paired_gain`: the change between two evaluations of the same episodes (before/after training), with a
  paired bootstrap interval over layouts;
- ``mean_turns`` over all episodes, and ``optimal_ratio``: mean of turns / optimal actions over successful episodes
  (optimal actions = BFS path length, plus the final ``stop`` under ``stop-on-goal``; 1.0 is perfect);
- ``parse_failure_rate`` and ``wall_bump_rate``: fractions of all turns.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from daedalus_trainer.layouts import LayoutReport, check_layouts, eval_corners, eval_mazes, training_eval_mazes

from daedalus_trainer.rollout.engine import RolloutEngine, SamplingParams
from daedalus_trainer.rollout.episode import Trajectory, run_episodes

#: The maze sets :func:`run_eval` can evaluate on: the held-out layouts (the figure that counts) and as many mazes
#: on training layouts (:func:`~daedalus_trainer.layouts.training_eval_mazes`: what training learned where it trained).
SPLITS = ("held-out", "training")

#: Two-sided 95% standard-normal quantile.
Z95 = 1.959963984540054


def wilson_interval(successes: float, n: float, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion: ``(low, high)`` in [0, 1]; ``(0, 1)`` when ``n == 0``.

    ``center = (p + z^2/2n) / (1 + z^2/n)``, ``half = z sqrt(p(1-p)/n + z^2/4n^2) / (1 + z^2/n)`` (Wilson 1927).
    ``n`` may be an effective (non-integer) sample size, ``successes = p * n``.

    Raises:
        ValueError: ``successes`` outside ``[0, n]``.
    """
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, n], got {successes} of {n}")
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, center - half), min(1.0, center + half)


#: Bootstrap resamples of :func:`layout_bootstrap_interval` and :func:`paired_gain` (Monte Carlo error of a 95%
#: percentile bound ~0.3 points at 64 layouts).
BOOTSTRAP_RESAMPLES = 10_000


def _by_layout(outcomes: Sequence[float], corners: int) -> np.ndarray:
    """``outcomes`` as a ``[layouts, corners]`` float array.

    Raises:
        ValueError: no outcomes, or their count is not a multiple of ``corners``.
    """
    values = np.asarray(outcomes, dtype=np.float64)
    if values.size == 0 or corners < 1 or values.size % corners:
        raise ValueError(f"{values.size} outcomes do not split into layouts of {corners} episodes")
    return values.reshape(-1, corners)


def clustered_wilson_interval(outcomes: Sequence[float], corners: int, z: float = Z95) -> tuple[float, float]:
    """95% Wilson interval of a success rate over episodes grouped by layout, on the effective sample size
    ``n_eff = p(1-p) / Var(p)`` with ``Var(p)`` estimated from the per-layout rates (Kish's design effect: Kish
    1965, "Survey Sampling", section 8.2), kept within ``[layouts, episodes]``: between one independent episode per
    layout and fully independent episodes. At ``p`` = 0 or 1 the between-layout variance cannot be estimated and
    ``n_eff = layouts`` (the widest case). ``corners == 1`` is the plain Wilson interval.

    Args:
        outcomes: per-episode successes (1/0), ``corners`` consecutive episodes per layout.
        corners: episodes per layout.

    Raises:
        ValueError: no outcomes, or their count is not a multiple of ``corners``.
    """
    values = _by_layout(outcomes, corners)
    n, layouts = values.size, values.shape[0]
    p = float(values.mean())
    if corners == 1:
        return wilson_interval(int(values.sum()), n, z)
    per_layout = values.mean(axis=1)
    var_p = float(per_layout.var(ddof=1)) / layouts if layouts > 1 else 0.0
    if 0.0 < p < 1.0:
        n_eff = min(float(n), max(float(layouts), p * (1 - p) / var_p)) if var_p > 0 else float(n)
    else:
        n_eff = float(layouts)
    return wilson_interval(p * n_eff, n_eff, z)


def layout_bootstrap_interval(outcomes: Sequence[float], corners: int, resamples: int = BOOTSTRAP_RESAMPLES,
                              seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap interval of a mean over episodes grouped by layout (cluster bootstrap: Davison &
    Hinkley 1997, "Bootstrap Methods and their Application", section 3.8).

    Args:
        outcomes: per-episode values (1/0 successes, or before/after differences), ``corners`` consecutive episodes
            per layout; length ``layouts * corners``.
        corners: episodes per layout.
        resamples / seed: bootstrap draws (layouts with replacement) and their generator seed; deterministic.

    Returns:
        ``(low, high)``, the 2.5th and 97.5th percentiles of the resampled means.

    Raises:
        ValueError: no outcomes, or their count is not a multiple of ``corners``.
    """
    per_layout = _by_layout(outcomes, corners).mean(axis=1)
    draws = np.random.default_rng(seed).integers(0, per_layout.size, size=(resamples, per_layout.size))
    low, high = np.percentile(per_layout[draws].mean(axis=1), [2.5, 97.5])
    return float(low), float(high)


def paired_gain(before: Sequence[int], after: Sequence[int], corners: int = 1) -> dict[str, float | int]:
    """How two evaluations of the **same episodes** differ (greedy decoding is deterministic, so a before/after pair
    differs only by what training changed): ``gain`` = mean(after) - mean(before), a 95% interval that resamples the
    per-layout differences (:func:`layout_bootstrap_interval`; pairing removes the between-layout variance both
    share), and the number of episodes ``fixed`` (0 -> 1) and ``broken`` (1 -> 0).

    Raises:
        ValueError: different lengths, or not whole layouts of ``corners`` episodes.
    """
    b, a = np.asarray(before, dtype=np.float64), np.asarray(after, dtype=np.float64)
    if b.shape != a.shape:
        raise ValueError(f"paired outcomes differ in length: {b.size} before, {a.size} after")
    diff = a - b
    low, high = layout_bootstrap_interval(diff, corners)
    return {"gain": float(diff.mean()), "ci_low": low, "ci_high": high, "fixed": int((diff > 0).sum()),
            "broken": int((diff < 0).sum()), "episodes": int(diff.size), "corners": int(corners)}


@dataclass
class ModeResult:
    """Evaluation figures of one decoding mode (see the module docstring)."""

    mode: str
    temperature: float
    episodes: int
    successes: int
    success_rate: float
    ci_low: float
    ci_high: float
    mean_turns: float
    optimal_ratio: float | None
    parse_failure_rate: float
    wall_bump_rate: float
    turns: int
    """Turns of all episodes together (the denominator of ``parse_failure_rate`` and ``wall_bump_rate``)."""
    seconds: float
    """Wall-clock seconds spent playing the episodes (:func:`evaluate`), rounded to 0.01."""
    corners: int = 1
    """Episodes per layout (start/goal corner pairs); above 1 the interval uses the design-effect sample size."""
    outcomes: list[int] = field(default_factory=list)
    """Per-episode success (1/0) in maze order: what :func:`paired_gain` compares."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict."""
        return asdict(self)


def summarize(trajectories: Sequence[Trajectory], mode: str, temperature: float, success_on: str,
              seconds: float = 0.0, corners: int = 1) -> ModeResult:
    """:class:`ModeResult` of finished episodes (``corners`` consecutive episodes per layout); ``seconds``: the wall
    time the episodes took, in seconds (reported as :attr:`ModeResult.seconds`, rounded to 0.01).

    Raises:
        ValueError: no trajectories, or not whole layouts of ``corners`` episodes.
    """
    if not trajectories:
        raise ValueError("no episodes to summarize")
    n = len(trajectories)
    outcomes = [int(bool(t.success)) for t in trajectories]
    k = sum(outcomes)
    lo, hi = clustered_wilson_interval(outcomes, corners)
    turns = [t.num_turns for t in trajectories]
    all_turns = [u for t in trajectories for u in t.turns]
    extra = 1 if success_on == "stop-on-goal" else 0
    ratios = [t.num_turns / max(1, t.optimal_path_length + extra) for t in trajectories if t.success]
    return ModeResult(
        mode=mode, temperature=temperature, episodes=n, successes=k, success_rate=k / n, ci_low=lo, ci_high=hi,
        mean_turns=float(np.mean(turns)), optimal_ratio=float(np.mean(ratios)) if ratios else None,
        parse_failure_rate=sum(u.parse_error for u in all_turns) / max(1, len(all_turns)),
        wall_bump_rate=sum(u.wall_bump for u in all_turns) / max(1, len(all_turns)),
        turns=len(all_turns), seconds=round(seconds, 2), corners=int(corners), outcomes=outcomes,
    )


def evaluate(engine: RolloutEngine, mazes: Sequence[Any], env_spec: Any, sampling: SamplingParams, *,
             mode: str = "greedy", seed: int | None = None, corners: int = 1,
             on_turn: Callable[[int, int, int, int], None] | None = None) -> tuple[ModeResult, list[Trajectory]]:
    """Play every maze once with ``engine`` and summarise (``corners`` consecutive mazes per layout, as
    :func:`~daedalus_trainer.layouts.eval_mazes` lays them out); returns ``(result, trajectories)``. ``on_turn``:
    progress after every turn (:func:`~daedalus_trainer.rollout.episode.run_episodes`).

    Raises:
        ValueError: ``mazes`` is empty, or not whole layouts of ``corners`` mazes (:func:`summarize`).
    """
    t0 = time.perf_counter()
    trajectories = run_episodes(engine, mazes, env_spec, sampling, seed=seed, on_turn=on_turn)
    result = summarize(trajectories, mode, sampling.temperature, env_spec.success_on, time.perf_counter() - t0,
                       corners=corners)
    return result, trajectories


class EvalProgress:
    """Progress of evaluation passes, one rich progress line per pass (``held-out greedy``, ...): turns played of
    the turn limit and episodes ended (every playing episode takes its turn in one batch, so most end near the
    optimal path length and the last turns go fast). Use as a context manager and pass it to
    :func:`evaluate_split`. Without a terminal (output redirected to a log) each pass prints one line when it ends.
    """

    def __init__(self, console: Any = None) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = console or Console()
        self.progress = Progress(
            TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[turns]}"),
            TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=self.console, transient=False,
            disable=not self.console.is_terminal,
        )

    def __enter__(self) -> EvalProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.stop()

    def on_turn(self, label: str) -> Callable[[int, int, int, int], None]:
        """The ``on_turn`` callback of one pass named ``label`` (:func:`run_episodes`' arguments)."""
        task = self.progress.add_task(label, total=None, turns="", info="")
        started = time.perf_counter()

        def update(turn: int, limit: int, ended: int, episodes: int) -> None:
            info = f"{ended}/{episodes} episodes ended"
            self.progress.update(task, completed=turn, total=max(limit, turn), turns=f"turn {turn}/{limit}",
                                 info=info)
            if ended == episodes and not self.console.is_terminal:
                self.console.print(f"{label}: {episodes} episodes (the longest {turn} turns) in "
                                   f"{time.perf_counter() - started:.0f} s")

        return update


@dataclass
class EvalReport:
    """Everything ``daedalus eval`` reports."""

    job: str
    model_path: str
    adapter_path: str | None
    size: int
    """Maze side in cells (``environment.size``)."""
    mazes: int
    """Episodes played per decoding mode (layouts x ``corners``)."""
    layouts: LayoutReport
    results: list[ModeResult] = field(default_factory=list)
    gifs: list[str] = field(default_factory=list)
    split: str = "held-out"
    """Which mazes: ``held-out`` (layouts excluded from training) or ``training`` (see :data:`SPLITS`)."""
    corners: int = 1
    """Episodes per layout (``environment.evalCorners`` on the held-out split, else 1); ``mazes`` counts episodes."""

    def result(self, mode: str) -> ModeResult:
        """The result of ``mode`` (``greedy`` or ``sampled``).

        Raises:
            KeyError: that mode was not run.
        """
        for r in self.results:
            if r.mode == mode:
                return r
        raise KeyError(mode)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict."""
        return {
            "job": self.job, "model_path": self.model_path, "adapter_path": self.adapter_path, "size": self.size,
            "mazes": self.mazes, "layouts": self.layouts.to_dict(), "results": [r.to_dict() for r in self.results],
            "gifs": self.gifs, "split": self.split, "corners": self.corners,
        }

    def to_json(self) -> str:
        """JSON text (indent 2)."""
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def table(self) -> Any:
        """A ``rich.table.Table`` with one row per decoding mode."""
        from rich.table import Table

        episodes = (f"{self.mazes} mazes" if self.corners == 1 else
                    f"{self.mazes // self.corners} layouts x {self.corners} corner pairs = {self.mazes} episodes")
        t = Table(title=f"{self.job}: {self.split} evaluation, {episodes} of size {self.size} "
                        f"({self.layouts.summary()})",
                  caption=("T=x: sampled at temperature x; " if any(r.mode != "greedy" for r in self.results)
                           else "") + "x opt.: turns / optimal actions (successes); unparsed, bumps: shares of all turns")
        # Short headers and unwrapped figures: the whole row fits an 80-column terminal, the CI's bounds included.
        for col in ("mode", "success", "95% CI", "turns", "x opt.", "unparsed", "bumps"):
            t.add_column(col, justify="left" if col == "mode" else "right", no_wrap=True)
        for r in self.results:
            mode = r.mode if r.mode == "greedy" else f"T={r.temperature:g}"  # sampled at that temperature
            t.add_row(mode, f"{r.success_rate:.1%} ({r.successes}/{r.episodes})", f"{r.ci_low:.1%}–{r.ci_high:.1%}",
                      f"{r.mean_turns:.1f}", "-" if r.optimal_ratio is None else f"{r.optimal_ratio:.2f}",
                      f"{r.parse_failure_rate:.1%}", f"{r.wall_bump_rate:.1%}")
        return t


def write_gif(trajectory: Trajectory, path: str | Path, frame_ms: int = 400, scale: int = 2) -> Path:
    """Write an animated GIF of an episode (Pillow): one frame per observation, the reply and feedback below it.

    Frames come from the trajectory's images (the current observation of each turn, then the final one), so no
    re-rendering is needed. Returns ``path``.

    Raises:
        ValueError: the trajectory holds no images (ascii observations).
    """
    from PIL import Image, ImageDraw

    frames_rgb = [t.images[-1] for t in trajectory.turns if t.images]
    if trajectory.final_image is not None:
        frames_rgb.append(trajectory.final_image)
    if not frames_rgb:
        raise ValueError("the trajectory holds no images (ascii observations): nothing to draw")
    captions = [f"{i + 1}: {t.text[:40]!s} -> {t.feedback[:40]}" for i, t in enumerate(trajectory.turns)]
    captions.append("success" if trajectory.success else ("turn limit" if trajectory.truncated else "failed"))
    frames = []
    for img, cap in zip(frames_rgb, captions):
        im = Image.fromarray(np.asarray(img, dtype=np.uint8)).resize(
            (img.shape[1] * scale, img.shape[0] * scale), Image.NEAREST)
        canvas = Image.new("RGB", (max(im.width, 320), im.height + 18), "white")
        canvas.paste(im, (0, 0))
        ImageDraw.Draw(canvas).text((2, im.height + 3), cap, fill="black")
        frames.append(canvas)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=frame_ms, loop=0)
    return path


def _check_request(greedy: bool, sampled: bool, split: str) -> None:
    """Raises ValueError for an evaluation that asks for no mode or an unknown split."""
    if not (greedy or sampled):
        raise ValueError("nothing to evaluate: enable greedy and/or sampled")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")


def load_engine(job: Any, model_path: str | Path, adapter_path: str | Path | None = None) -> RolloutEngine:
    """The policy to evaluate, loaded once: the checkpoint at ``model_path`` in ``model.dtype`` with the PEFT adapter
    at ``adapter_path`` on top (frozen), in eval mode, behind a :class:`TransformersEngine`. Pass it to
    :func:`evaluate_split` for each set to evaluate. An ``adapter_path`` that an export killed mid-replacement left
    missing is put back first (:func:`daedalus_trainer.checkpoint.restore_interrupted_export`).

    Raises:
        FileNotFoundError: no checkpoint at ``model_path`` / no adapter at ``adapter_path`` (the adapter is checked
            first: before the model, which may take minutes to load).
        daedalus_trainer.policy.ModelLoadError: the model's or the adapter's files cannot be loaded.
    """
    from daedalus_trainer.checkpoint import restore_interrupted_export
    from daedalus_trainer.policy import ADAPTER_CONFIG, is_adapter_dir, load_pretrained
    from daedalus_trainer.rollout.engine import TransformersEngine

    if adapter_path:
        restore_interrupted_export(adapter_path)
        if not Path(adapter_path).exists():
            raise FileNotFoundError(f"{adapter_path} does not exist (expected a PEFT adapter directory with "
                                    f"{ADAPTER_CONFIG})")
        if not is_adapter_dir(adapter_path):
            raise FileNotFoundError(f"{adapter_path} is not a PEFT adapter directory (no {ADAPTER_CONFIG})")
    policy = load_pretrained(model_path, job.spec.model.dtype)
    if adapter_path:
        policy.load_adapter(adapter_path, trainable=False)
    policy.model.eval()
    return TransformersEngine(policy)


def evaluate_split(
    engine: RolloutEngine,
    job: Any,
    split: str = "held-out",
    greedy: bool = True,
    sampled: bool = True,
    gif_dir: str | Path | None = None,
    n: int | None = None,
    *,
    gifs: int = 4,
    model_path: str | Path = "",
    adapter_path: str | Path | None = None,
    progress: EvalProgress | None = None,
) -> EvalReport:
    """Evaluate a loaded policy (:func:`load_engine`, or any rollout engine) on one set of the job's mazes.

    Args:
        engine: the policy's rollout engine.
        job: ``RLTrainingJob``.
        split: ``held-out`` (:func:`~daedalus_trainer.layouts.eval_mazes`) or ``training``
            (:func:`~daedalus_trainer.layouts.training_eval_mazes`).
        greedy / sampled: which decoding modes to run (sampled uses ``algorithm.temperature`` / ``top_p``, seeded
            from ``environment.evalSeed``).
        gif_dir: write GIFs of up to ``gifs`` greedy episodes there (half successes, half failures when both exist).
        n: evaluate only the first ``n`` mazes of the set (held-out: layouts, each from ``evalCorners`` pairs).
        model_path / adapter_path: what the engine holds, recorded in the report.
        progress: shows each pass's progress (``None``: silent).

    Raises:
        daedalus_trainer.layouts.LayoutError: invalid held-out configuration.
        ValueError: neither mode requested, or an unknown ``split``.
    """
    _check_request(greedy, sampled, split)
    spec = job.spec
    env = spec.environment
    layouts = check_layouts(env)
    mazes = eval_mazes(env, n) if split == "held-out" else training_eval_mazes(env, n)
    corners = eval_corners(env) if split == "held-out" else 1
    report = EvalReport(job=job.metadata.name, model_path=str(model_path),
                        adapter_path=str(adapter_path) if adapter_path else None, size=int(env.size),
                        mazes=len(mazes), layouts=layouts, split=split, corners=corners)
    alg = spec.algorithm
    greedy_trajs: list[Trajectory] = []
    if greedy:
        res, greedy_trajs = evaluate(engine, mazes, env, SamplingParams(0.0, 1.0, alg.max_tokens_per_turn),
                                     mode="greedy", corners=corners,
                                     on_turn=progress.on_turn(f"{split} greedy") if progress else None)
        report.results.append(res)
    if sampled:
        res, _ = evaluate(engine, mazes, env, SamplingParams(alg.temperature, alg.top_p, alg.max_tokens_per_turn),
                          mode="sampled", seed=int(env.eval_seed), corners=corners,
                          on_turn=progress.on_turn(f"{split} sampled") if progress else None)
        report.results.append(res)
    if gif_dir and greedy_trajs and "image" in env.observation:
        wins = [i for i, t in enumerate(greedy_trajs) if t.success]
        losses = [i for i, t in enumerate(greedy_trajs) if not t.success]
        half = min(len(wins), max(gifs - len(losses), (gifs + 1) // 2))
        for i in sorted(wins[:half] + losses[: gifs - half]):
            tag = "success" if greedy_trajs[i].success else "failure"
            report.gifs.append(str(write_gif(greedy_trajs[i], Path(gif_dir) / f"maze-{i:03d}-{tag}.gif")))
    return report


def run_eval(
    job: Any,
    model_path: str | Path,
    adapter_path: str | Path | None = None,
    greedy: bool = True,
    sampled: bool = True,
    gif_dir: str | Path | None = None,
    n: int | None = None,
    *,
    gifs: int = 4,
    split: str = "held-out",
    progress: EvalProgress | None = None,
) -> EvalReport:
    """Evaluate a model (and optional LoRA adapter) on the job's held-out mazes (or, with ``split="training"``, on as
    many mazes on training layouts): :func:`load_engine` then :func:`evaluate_split` (arguments as there).

    Raises:
        FileNotFoundError: no checkpoint at ``model_path`` / no adapter at ``adapter_path``.
        daedalus_trainer.layouts.LayoutError: invalid held-out configuration.
        ValueError: neither mode requested, or an unknown ``split`` (before anything is loaded).
    """
    _check_request(greedy, sampled, split)
    engine = load_engine(job, model_path, adapter_path)
    return evaluate_split(engine, job, split, greedy, sampled, gif_dir, n, gifs=gifs, model_path=model_path,
                          adapter_path=adapter_path, progress=progress)
