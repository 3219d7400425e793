"""GRPO's held-out gain, paired and on four times the episodes: every held-out layout from all four corner pairs.

Measures: greedy success of a start model (``--start``, e.g. ``runs/local-tiny/sft/model``) and of the same model with
a GRPO adapter on top (``--adapter``, e.g. ``runs/local-tiny/exports/adapter``) on the job's 64 held-out layouts
(``layouts.eval_mazes`` of ``examples/local-tiny.yaml``), each played from **all four** of VisGym's opposite-corner
start/goal pairs (``envs.maze.generate_maze`` draws one of them per maze; ``daedalus run`` plays that one): 256
episodes per policy instead of 64, and the same 256 before and after, so the gain is a paired difference.

Why: ``daedalus run``'s table gives each success rate a 95% Wilson interval on 64 episodes (about +-12 points), so
the gains GRPO makes in the README's runs (+6 to +16 points) are each inside their own intervals. Greedy decoding is
deterministic, so the same episodes before and after differ only by what GRPO changed; pairing them and quadrupling
the episodes narrows the interval of the *gain*.

Statistics: episodes on one layout are not independent (four corner pairs of the same walls), so a rate's interval
is ``evaluation.clustered_wilson_interval`` (Wilson on the design-effect sample size), not a binomial interval on
256 independent episodes, and the gain's interval is ``evaluation.paired_gain``: a percentile bootstrap over layouts
(10,000 resamples) of the per-layout *differences* (after - before), so it is paired. These are the functions
``daedalus run`` reports with ``environment.evalCorners: 4``; this script applies them to older runs.
``--split training`` runs the same on the 64 training-layout mazes of ``layouts.training_eval_mazes``.

Prints, per policy, successes of 256 and of the 64 drawn-corner episodes (these must equal ``daedalus run``'s
``eval-before.json`` / ``eval-after.json`` greedy counts: a consistency check), the rate with its interval, and the
paired gain with its interval and how many episodes GRPO fixed and broke. ``--json`` writes the figures.

Figures: bench/experiments/README.md (row ``paired_gain.py``). Run from the repository root::

    .venv/bin/python bench/experiments/paired_gain.py --start runs/local-tiny/sft/model \\
        --adapter runs/local-tiny/exports/adapter
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import load_example  # noqa: E402

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--start", required=True, help="start model directory (the SFT model GRPO started from)")
    ap.add_argument("--adapter", required=True, help="GRPO LoRA adapter directory (PEFT format), on top of --start")
    ap.add_argument("--split", choices=("held-out", "training"), default="held-out",
                    help="held-out layouts (default) or as many training-layout mazes")
    ap.add_argument("--json", help="write the figures to this file")
    a = ap.parse_args()

    import numpy as np
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from daedalus_trainer.config import parse_job
    from daedalus_trainer.evaluation import clustered_wilson_interval, evaluate, load_engine, paired_gain
    from daedalus_trainer.layouts import eval_mazes, training_eval_mazes, with_corner_pairs
    from daedalus_trainer.rollout.engine import SamplingParams

    job = parse_job(load_example())
    env = job.spec.environment
    drawn = eval_mazes(env) if a.split == "held-out" else training_eval_mazes(env)  # load_example: 1 pair each
    mazes = with_corner_pairs(drawn, 4)  # the drawn pair first: mazes[::4] == drawn
    greedy = SamplingParams(0.0, 1.0, job.spec.algorithm.max_tokens_per_turn)

    outcomes = {}
    for name, adapter in (("before", None), ("after", a.adapter)):
        t = time.time()
        engine = load_engine(job, a.start, adapter)
        result, _ = evaluate(engine, mazes, env, greedy, corners=4)
        outcomes[name] = result.outcomes
        print(f"{name}: {result.successes}/{result.episodes} episodes ({time.time() - t:.1f} s)", flush=True)

    figures: dict[str, object] = {"split": a.split, "layouts": len(drawn), "episodes": len(mazes),
                                  "start": a.start, "adapter": a.adapter}
    for name, o in outcomes.items():
        lo, hi = clustered_wilson_interval(o, 4)
        own = sum(o[::4])
        figures[name] = {"successes": sum(o), "rate": float(np.mean(o)), "ci95": [lo, hi],
                         "drawn_corner_successes": own}
        print(f"{name:>6}: {np.mean(o):6.1%} [{lo:.1%}, {hi:.1%}] ({sum(o)}/{len(o)}); drawn corner only "
              f"{own}/{len(drawn)}", flush=True)
    gain = paired_gain(outcomes["before"], outcomes["after"], 4)
    figures["gain"] = gain
    print(f"  gain: {100 * gain['gain']:+.1f} points [{100 * gain['ci_low']:+.1f}, {100 * gain['ci_high']:+.1f}] "
          f"(paired bootstrap over layouts); episodes fixed {gain['fixed']}, broken {gain['broken']}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
