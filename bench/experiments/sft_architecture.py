"""SFT of a tiny Qwen3-VL with a different architecture (``daedalus_trainer.tiny.TinySpec`` overrides).

Measures: whether the SFT plateau near 60% held-out greedy success comes from the model's size. Builds the random
tiny checkpoint with the given ``TinySpec`` fields into ``OUT/tiny-base`` (JSON lists become tuples), prints its
parameter count, runs ``daedalus_trainer.sft.run_sft`` for STEPS steps from scratch (no wall-clock budget:
``sft.maxSeconds`` 100000; otherwise the job of ``examples/local-tiny.yaml``), then prints every fourth entry of the
SFT history, the final greedy evaluation on the 64 held-out mazes (dict), the SFT CPU seconds and the wall seconds.

Figures (2026-11-30, shared 2-core machine, one seed each; the default is 2 decoder layers and 2 vision blocks,
60.9% at 1000 steps with ``sft_grid_padding.py`` PAD=1)::

    .venv/bin/python bench/experiments/sft_architecture.py runs/experiments/ar4 '{"text_layers": 4}' 1000

65.6% held-out greedy success (1,109,440 parameters; about 1.35x the time per step: the two SFT reports give
542.8 s vs 403.9 s of wall time, 1.34x, and 416 vs 343 CPU s, 1.21x). From this model GRPO reached
59.4% / 65.6% / 64.1% at steps 10 / 20 / 30 (``grpo_heldout.py``).
``'{"text_layers": 4, "vision_depth": 3}' 1000`` (into ``runs/experiments/ar4v3``): 60.9% (1,142,912 parameters).
64 held-out mazes: 95% CI about +-12 points.

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
from _common import load_example  # noqa: E402



def spec_json(text: str) -> dict:
    """argparse type: a JSON object of TinySpec fields."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object of TinySpec fields, got {text!r}")
    return value


ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("out", type=Path, help="output directory (base in OUT/tiny-base, model in OUT/model)")
ap.add_argument("spec", type=spec_json,
                help='TinySpec fields as a JSON object, e.g. \'{"text_layers": 4, "vision_depth": 3}\'')
ap.add_argument("steps", type=int, help="SFT steps (sft.steps)")
a = ap.parse_args()

import torch  # noqa: E402

torch.set_num_threads(1)
from daedalus_trainer import sft, tiny  # noqa: E402
from daedalus_trainer.config import parse_job  # noqa: E402
from daedalus_trainer.policy import load_pretrained  # noqa: E402

out, spec_kw, steps = a.out, a.spec, a.steps
doc = load_example()
doc["spec"]["sft"]["steps"] = steps
doc["spec"]["sft"]["maxSeconds"] = 100000
job = parse_job(doc)
ts = tiny.TinySpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in spec_kw.items()})
tiny.build_tiny_checkpoint(out / "tiny-base", ts)
print("params", tiny.count_parameters(load_pretrained(out / "tiny-base").model), flush=True)
t = time.time()
sft.run_sft(job, out, resume=False, progress=False, final_eval=True)
rep = json.load(open(out / "sft_report.json"))
for h in rep["history"][::4]:
    print(h)
print(rep["final_eval"], rep["cpu_seconds"], time.time() - t)
