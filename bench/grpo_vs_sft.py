"""GRPO against more SFT: the same starting checkpoint, the same training seconds, the same held-out mazes.

Question (issue #4): once a policy has been fine-tuned on solver demonstrations, is the next budget of compute better
spent on GRPO (reward only for reaching the goal) or on more supervised fine-tuning with the same perfect solver
(its demonstrations and, with the job's ``sft.onPolicyFraction``, its labels on the policy's own states: DAgger)?

Method:

1. Starting point: ``--start`` (a tiny full-model SFT checkpoint such as ``runs/local-tiny/sft/model``); built with the
   job's SFT settings into ``<out>/sft`` when absent.
2. Arm **GRPO**: the job's GRPO (LoRA adapter, group size, mazes per step, learning rate and its schedule...) on a
   local Ray for ``--grpo-steps`` steps (default the job's ``algorithm.steps``: the GRPO ``daedalus run`` trains, its
   cosine decay complete), a checkpoint at ``--points`` evenly spaced steps; its training seconds (rollouts +
   updates) are the budget of the SFT arm. With ``--budget`` instead, GRPO stops after that many training seconds
   and is checkpointed at every ``budget / points`` seconds; its schedule still spans ``--grpo-steps`` steps (before
   2026-12-01 it spanned 100000, i.e. a constant learning rate, which at 2e-3 collapsed the action format after
   ~45 steps in a 600 s run).
3. Arm **SFT**: a LoRA adapter of the same rank and targets on the same start, trained by ``daedalus_trainer.sft``
   with the job's SFT settings (solver demonstrations on the training layouts only and, with ``sft.onPolicyFraction``,
   solver-labelled states from the policy's own greedy episodes; batch ``sft.batchSize``, AdamW at ``--sft-lr``,
   default the GRPO learning rate, warmup-stable-decay over the budget) for the same training seconds (the
   on-policy rollouts included), with a snapshot of the adapter at the seconds of the GRPO arm's snapshots.
4. Every snapshot of both arms (and the start) is evaluated greedily on the held-out mazes at each ``--sizes`` (size 7
   is the training size; the held-out set excludes training layouts by hash; size 9 is never trained on, so all its
   layouts are unseen). Evaluation time is not counted in the budget.

Prints one table per size (seconds of training -> greedy success with 95% Wilson interval for each arm), writes
``<out>/grpo_vs_sft.json`` and ``<out>/grpo_vs_sft.png``.

What it does not show: the comparison is at one (small) budget on one tiny model; SFT here has a perfect solver to
imitate, which real agent tasks rarely have; both arms run single-threaded on CPU, and a loaded machine slows both
(the budget is wall-clock, so a loaded run gets fewer steps in each arm, recorded in the JSON).

Usage::

    .venv/bin/python bench/grpo_vs_sft.py --start runs/local-tiny/sft/model            # the example's 48 steps
    .venv/bin/python bench/grpo_vs_sft.py --start runs/local-tiny/sft/model --budget 180   # a time budget
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import yaml  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _job_doc(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def _with(doc: dict[str, Any], **sections: dict[str, Any]) -> dict[str, Any]:
    """A deep-enough copy of the job document with ``spec.<section>`` keys replaced."""
    out = json.loads(json.dumps(doc))
    for section, values in sections.items():
        out["spec"].setdefault(section, {}).update(values)
    return out


def ensure_start(doc: dict[str, Any], start: Path | None, out: Path) -> Path:
    """The SFT starting point: ``start`` if given, else SFT with the job's settings into ``out/sft``."""
    from daedalus_trainer import sft
    from daedalus_trainer.config import parse_job

    if start is not None:
        if not (start / "config.json").is_file():
            raise SystemExit(f"--start {start}: not a model directory (no config.json)")
        return start
    made = ROOT / "runs" / doc["metadata"]["name"] / "sft" / "model"
    if (made / "config.json").is_file():
        print(f"no --start given: using the SFT checkpoint `make run` left in {made}", flush=True)
        return made
    print(f"no --start given: supervised fine-tuning with the job's settings into {out / 'sft'}", flush=True)
    return Path(sft.run_sft(parse_job(doc), out / "sft", resume=True, final_eval=False))


def run_grpo(doc: dict[str, Any], start: Path, out: Path, steps: int, points: int,
             budget: float | None = None) -> dict[str, Any]:
    """Arm GRPO: the job's GRPO for ``steps`` steps, its learning-rate schedule spanning them (``algorithm.steps =
    steps``, as ``daedalus run`` trains); with ``budget`` it stops earlier once the summed rollout + learner seconds
    reach it. A checkpoint is taken at ``points`` evenly spaced marks: steps ``ceil(steps * k / points)``, or with
    ``budget`` ``budget * k / points`` seconds.

    Returns ``{"snapshots": [(training seconds, step, adapter_dir)], "steps": n, "seconds": s, "history": [...]}``.
    """
    import ray

    from daedalus_trainer.checkpoint import list_checkpoints
    from daedalus_trainer.config import parse_job
    from daedalus_trainer.grpo import Trainer, init_ray

    job = parse_job(_with(doc, algorithm={"steps": steps, "evalIntervalSteps": 0},
                          checkpoint={"intervalSteps": 1_000_000, "keep": 1000}))
    init_ray(local=True)
    if budget is None:
        pending: list[float] = sorted({math.ceil(steps * (k + 1) / points) for k in range(points)})
    else:
        pending = [budget * (k + 1) / points for k in range(points)]
    taken: list[tuple[float, int]] = []
    spent = 0.0
    trainer: Trainer | None = None

    def on_step(rec: dict[str, Any]) -> None:
        nonlocal spent
        spent += rec["rollout_seconds"] + rec["learner_seconds"]
        print(f"  grpo step {rec['step']:4d}  {spent:6.1f} s  rollout success {rec['success_ratio']:.2f}  "
              f"turns {rec['episode_turns']:.1f}", flush=True)
        reached = (lambda m: rec["step"] >= m) if budget is None else (lambda m: spent >= m)
        while pending and reached(pending[0]):
            mark = pending.pop(0)
            taken.append((spent if budget is None else mark, rec["step"]))
            assert trainer is not None
            trainer.control.request_checkpoint(stop=not pending)

    trainer = Trainer(job, out / "grpo", start_dir=str(start), work_dir=out / "grpo", on_step=on_step,
                      final_eval=False)
    result = trainer.train(resume="none")
    ray.shutdown()
    if pending and result.steps_done and (not taken or taken[-1][1] != result.steps_done):
        taken.append((spent, result.steps_done))  # the steps ended before the budget: the final checkpoint
    by_step = {step: path for step, path in list_checkpoints(out / "grpo" / "checkpoints")}
    snapshots = [(mark, step, str(by_step[step] / "adapter")) for mark, step in taken]
    return {"snapshots": snapshots, "steps": result.steps_done, "seconds": spent, "history": result.history}


def run_more_sft(doc: dict[str, Any], start: Path, out: Path, budget: float, marks: list[float],
                 lr: float) -> dict[str, Any]:
    """Arm SFT: a LoRA adapter on ``start`` trained with the job's SFT settings for ``budget`` seconds."""
    from daedalus_trainer import sft
    from daedalus_trainer.config import parse_job

    job = parse_job(_with(doc, model={"sftAdapter": str(start)},
                          sft={"maxSeconds": budget, "steps": 10_000_000, "learningRate": lr, "evalEvery": 0}))
    sft_dir = out / "more-sft"
    sft.run_sft(job, sft_dir, resume=False, final_eval=False, snapshot_seconds=marks[:-1], progress=False)
    report = json.loads((sft_dir / sft.REPORT_NAME).read_text())
    snaps = [(m, None, str(sft_dir / sft.SNAPSHOTS_DIRNAME / f"{m:g}s")) for m in marks[:-1]]
    snaps.append((marks[-1], report["steps"], str(sft_dir / sft.ADAPTER_DIRNAME)))
    return {"snapshots": snaps, "steps": report["steps"], "seconds": report["seconds"]}


def evaluate_all(doc: dict[str, Any], start: Path, arms: dict[str, dict[str, Any]], sizes: list[int],
                 mazes: int) -> dict[str, Any]:
    """Greedy held-out success of the start and of every snapshot at every size."""
    from daedalus_trainer.config import parse_job
    from daedalus_trainer.evaluation import run_eval

    results: dict[str, Any] = {}
    for size in sizes:
        # one corner pair per layout, as the recorded figures (bench/README.md) were measured
        job = parse_job(_with(doc, environment={"size": size, "maxTurns": 0, "evalMazes": mazes, "evalCorners": 1}))

        def greedy(adapter: str | None) -> dict[str, Any]:
            rep = run_eval(job, start, adapter_path=adapter, greedy=True, sampled=False)
            r = rep.results[0]
            return {"success": r.success_rate, "ci95": [r.ci_low, r.ci_high], "episodes": r.episodes,
                    "successes": r.successes, "mean_turns": r.mean_turns, "wall_bump_rate": r.wall_bump_rate}

        row = {"start": greedy(None)}
        print(f"size {size}: start {row['start']['success']:.1%}", flush=True)
        for arm, res in arms.items():
            row[arm] = []
            for mark, step, adapter in res["snapshots"]:
                g = greedy(adapter)
                row[arm].append({"seconds": mark, "step": step, **g})
                print(f"size {size}: {arm} at {mark:.0f} s: {g['success']:.1%}", flush=True)
        results[str(size)] = row
    return results


def print_tables(results: dict[str, Any], arms: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for size, row in results.items():
        t = Table(title=f"held-out greedy success, size {size} ({row['start']['episodes']} mazes)")
        t.add_column("training seconds", justify="right")
        for arm in arms:
            t.add_column(arm, justify="right")
        s = row["start"]
        t.add_row("0 (SFT start)", *[f"{s['success']:.1%} [{s['ci95'][0]:.0%}, {s['ci95'][1]:.0%}]"] * len(arms))
        for i, point in enumerate(row[arms[0]]):
            cells = []
            for arm in arms:
                p = row[arm][i]
                cells.append(f"{p['success']:.1%} [{p['ci95'][0]:.0%}, {p['ci95'][1]:.0%}]")
            t.add_row(f"{point['seconds']:.0f}", *cells)
        console.print(t)


def plot(results: dict[str, Any], arms: list[str], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.2 * len(results), 3.6), squeeze=False)
    for ax, (size, row) in zip(axes[0], results.items()):
        for arm in arms:
            xs = [0.0] + [p["seconds"] for p in row[arm]]
            ys = [row["start"]["success"]] + [p["success"] for p in row[arm]]
            lo = [row["start"]["ci95"][0]] + [p["ci95"][0] for p in row[arm]]
            hi = [row["start"]["ci95"][1]] + [p["ci95"][1] for p in row[arm]]
            ax.plot(xs, ys, marker="o", label=arm)
            ax.fill_between(xs, lo, hi, alpha=0.15)
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("training seconds (evaluation excluded)")
        ax.set_ylabel("held-out greedy success")
        ax.set_title(f"size {size}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--job", type=Path, default=ROOT / "examples" / "local-tiny.yaml", help="RLTrainingJob YAML")
    ap.add_argument("--start", type=Path, default=None,
                    help="SFT checkpoint (full tiny model dir); default: runs/<job>/sft/model from `make run` if present, "
                         "else SFT with the job's settings")
    ap.add_argument("--grpo-steps", type=int, default=None,
                    help="GRPO steps of the GRPO arm, its learning-rate schedule spanning them (default: the job's "
                         "algorithm.steps, i.e. the GRPO `daedalus run` trains); the SFT arm then gets the same "
                         "training seconds")
    ap.add_argument("--budget", type=float, default=None,
                    help="instead: stop the GRPO arm after this many training seconds (the schedule still spans "
                         "--grpo-steps steps, so a cosine decay may not have ended when the budget binds); the SFT "
                         "arm gets the same budget")
    ap.add_argument("--points", type=int, default=3, help="evaluation points per arm (default 3)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[7, 9], help="maze sizes to evaluate (default 7 9)")
    ap.add_argument("--eval-mazes", type=int, default=64, help="held-out mazes per size (default 64)")
    ap.add_argument("--sft-lr", type=float, default=None, help="learning rate of the SFT arm (default: GRPO's)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-grpo-vs-sft", help="output directory")
    args = ap.parse_args(argv)
    if args.points < 1 or (args.budget is not None and args.budget <= 0) or (args.grpo_steps or 1) < 1:
        ap.error("--points and --grpo-steps must be >= 1 and --budget > 0")

    logging.basicConfig(level=logging.WARNING)
    import torch
    import transformers

    torch.set_num_threads(1)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    doc = _job_doc(args.job)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    start = ensure_start(doc, args.start, args.out)
    lr = args.sft_lr if args.sft_lr is not None else float(doc["spec"].get("algorithm", {}).get("learningRate", 3e-3))
    steps = args.grpo_steps or int(doc["spec"].get("algorithm", {}).get("steps", 100))

    what = f"{args.budget:.0f} training seconds" if args.budget else f"{steps} steps"
    print(f"arm GRPO: {what} (learning-rate schedule over {steps} steps) from {start}", flush=True)
    grpo = run_grpo(doc, start, args.out, steps, args.points, budget=args.budget)
    # the SFT arm: the same training seconds, snapshots at the seconds the GRPO arm's snapshots were taken
    marks = [mark for mark, _, _ in grpo["snapshots"]]
    budget = args.budget if args.budget and grpo["seconds"] >= args.budget else grpo["seconds"]
    marks[-1] = budget
    print(f"arm SFT: {budget:.0f} training seconds of LoRA SFT at lr {lr:g} from {start}", flush=True)
    more = run_more_sft(doc, start, args.out, budget, marks, lr)
    arms = {"GRPO": grpo, "more SFT": more}
    results = evaluate_all(doc, start, arms, args.sizes, args.eval_mazes)
    print_tables(results, list(arms))
    doc_out = {
        "job": str(args.job), "start": str(start), "budget_seconds": budget, "marks": marks,
        "grpo_schedule_steps": steps, "grpo_steps": grpo["steps"], "sft_steps": more["steps"], "sft_learning_rate": lr,
        "load_average": list(os.getloadavg()), "wall_seconds": time.perf_counter() - started,
        "results": results,
    }
    (args.out / "grpo_vs_sft.json").write_text(json.dumps(doc_out, indent=2) + "\n")
    png = plot(results, list(arms), args.out / "grpo_vs_sft.png")
    print(f"GRPO steps {grpo['steps']}, SFT steps {more['steps']} in {budget:.0f} s each; "
          f"figures: {args.out / 'grpo_vs_sft.json'}  {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
