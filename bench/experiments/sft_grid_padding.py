"""SFT with each maze picture padded to a multiple of PAD pixels (the variant) vs as it is (PAD=1).

Measures: whether padding the 112 px picture (7 cells x 16 px) with grey to the 32 px visual-token grid (2x2 patches
of 16 px merged into one token) helps the tiny model learn, against the default where the processor resizes it.
Runs ``daedalus_trainer.sft.run_sft`` for STEPS steps (no wall-clock budget: ``sft.maxSeconds`` 100000) into OUT,
resuming from ``OUT/checkpoint`` when there is one, with a greedy evaluation on the 64 held-out mazes at the end;
prints ``DONE <seconds>`` and the SFT report without its history (the per-50-step loss and per-turn
``step_accuracy`` on held-out demonstration turns are in ``OUT/sft_report.json``, or ``OUT/checkpoint/state.json``
while it runs).

The variant is made by replacing ``daedalus_trainer.prompts.user_content`` in this script (PAD > 1 only), so that
training, accuracy and evaluation prompts are all padded. That is a patch of the thing being varied, acceptable in an
experiment; it is not a test and the project's code is unchanged.

Figures (2026-11-30, shared 2-core machine, one seed each)::

    PAD=32 .venv/bin/python bench/experiments/sft_grid_padding.py runs/experiments/sft-pad32 1000
    PAD=1  .venv/bin/python bench/experiments/sft_grid_padding.py runs/experiments/sft-pad1 1000
    PAD=1  .venv/bin/python bench/experiments/sft_grid_padding.py runs/experiments/sft-pad1-2000 2000

per-turn step accuracy at step 700: PAD=32 0.85, PAD=1 0.91 (the PAD=32 run was stopped there; padding was dropped).
PAD=1, 1000 steps: 60.9% held-out greedy success (the "60.9% start" of the other experiments is
``runs/experiments/sft-pad1/model``); 2000 steps: 56.3%. 64 held-out mazes: 95% CI about +-12 points.

Run from the repository root.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import apply_overrides, load_example, override  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                             epilog="environment: PAD=<pixels> pads each picture to a multiple of PAD px "
                                    "(default 32; PAD=1 leaves pictures as they are)")
ap.add_argument("out", help="SFT output directory (the model lands in OUT/model)")
ap.add_argument("steps", type=int, help="SFT steps (sft.steps)")
ap.add_argument("overrides", nargs="*", type=override, metavar="KEY.PATH=VALUE",
                help="overrides under the spec of examples/local-tiny.yaml, values parsed as YAML")
a = ap.parse_args()

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)
from daedalus_trainer import prompts  # noqa: E402

PAD = int(os.environ.get("PAD", "32"))
orig = prompts.user_content


def padded(obs, settings):
    """``prompts.user_content`` with each image (H, W, 3 uint8) padded bottom/right with grey (169) to multiples of
    PAD."""
    parts, imgs = orig(obs, settings)
    out = []
    for im in imgs:
        h, w, _ = im.shape
        H, W = -(-h // PAD) * PAD, -(-w // PAD) * PAD
        canvas = np.empty((H, W, 3), np.uint8)
        canvas[:] = (169, 169, 169)
        canvas[:h, :w] = im
        out.append(canvas)
    return parts, out


if PAD > 1:
    prompts.user_content = padded
from daedalus_trainer import sft  # noqa: E402
from daedalus_trainer.config import parse_job  # noqa: E402

doc = load_example()
doc["spec"]["sft"]["steps"] = a.steps
doc["spec"]["sft"]["maxSeconds"] = 100000
apply_overrides(doc, a.overrides)
job = parse_job(doc)
t = time.time()
r = sft.run_sft(job, a.out, resume=True, final_eval=True, progress=False)
print("DONE", time.time() - t)
rep = json.load(open(os.path.join(a.out, "sft_report.json")))
print({k: v for k, v in rep.items() if k != "history"})
