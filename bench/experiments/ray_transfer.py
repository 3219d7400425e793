"""Shipping LoRA-sized state through Ray: torch tensors vs :class:`daedalus_trainer.checkpoint.PackedTensor` byte views.

Measures, on a local Ray (2 CPUs), the two transfers the GRPO trainer makes with a rank-32 LoRA of Qwen3-VL-8B's
shapes (349 MB fp32 as 72 tensors; ``bench/checkpoint.py`` has the shapes and their sources):

- publication (every step): a learner-like actor copies its adapter (as ``Policy.adapter_state``) and returns it;
  two worker actors each load it into their parameters (``copy_``), as ``RolloutWorker`` does. Seconds from the
  call until both workers are done;
- snapshot (every checkpoint, ~3x the bytes with AdamW's moments; here the same 349 MB): seconds the actor is busy
  returning it (timed by a trivial call queued behind it) and seconds of the driver's ``ray.get``.

Four repeats each, alternating; medians. Figures (2026-11-30, 2-core machine, load ~1): publication 0.84 s as
tensors [0.65, 1.08] vs 0.20 s packed [0.19, 0.39]; snapshot of 349 MB: actor busy 0.31 s vs 0.04 s, ``ray.get``
0.37 s vs 0.00 s (for 1.04 GB in an earlier side run: busy 2.2-3.8 s vs 0.13-0.69 s, ``ray.get`` 1.3-4.9 s vs ~0 s).
Run from the repository root:
``.venv/bin/python bench/experiments/ray_transfer.py``.
"""

import argparse
import statistics
import time

import ray
import torch

from daedalus_trainer.checkpoint import pack_tensors, unpack_tensors

N = 87_293_952 // 2 // 36  # 72 tensors of this many fp32 values: 349 MB


@ray.remote
class Holder:
    def __init__(self):
        self.state = {f"t{i}": torch.randn(N) for i in range(72)}

    def adapter(self, packed: bool):
        copy = {k: v.clone() for k, v in self.state.items()}  # as Policy.adapter_state
        return pack_tensors(copy) if packed else copy

    def snapshot(self, packed: bool):
        return pack_tensors(self.state) if packed else self.state

    def ping(self):
        return 1


@ray.remote
class Loader:
    def __init__(self):
        self.params = {f"t{i}": torch.zeros(N) for i in range(72)}

    def load(self, state):
        for k, v in unpack_tensors(state).items():
            self.params[k].copy_(v)
        return 1


def main() -> None:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    holder, loaders = Holder.remote(), [Loader.remote() for _ in range(2)]
    ray.get([w.load.remote(holder.adapter.remote(False)) for w in loaders])  # warm-up
    publish, busy, get = ({False: [], True: []} for _ in range(3))
    for _ in range(4):
        for packed in (False, True):
            t0 = time.perf_counter()
            ref = holder.adapter.remote(packed)
            ray.get([w.load.remote(ref) for w in loaders])
            publish[packed].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ref = holder.snapshot.remote(packed)
            ray.get(holder.ping.remote())
            t1 = time.perf_counter()
            state = ray.get(ref)
            get[packed].append(time.perf_counter() - t1)
            busy[packed].append(t1 - t0)
            del state, ref
    for packed in (False, True):
        name = "packed " if packed else "tensors"
        print(f"{name}: publish to 2 workers {statistics.median(publish[packed]):.2f} s "
              f"[{min(publish[packed]):.2f}, {max(publish[packed]):.2f}]; snapshot: actor busy "
              f"{statistics.median(busy[packed]):.2f} s, ray.get {statistics.median(get[packed]):.2f} s")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
