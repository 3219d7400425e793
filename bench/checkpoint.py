"""Checkpoint save/restore throughput at the real size of a rank-32 LoRA on Qwen3-VL-8B, against ``dd`` on the same disk.

Run: ``.venv/bin/python bench/checkpoint.py [--dir DIR] [--repeats 5]`` (about 3 minutes on 2 cores; needs ~4 GB of
free disk under ``--dir`` and ~6 GB of memory: the async part starts a local Ray whose actor holds a second copy).
Smallest run (about 20 s, the smoke test in ``tests/bench``): ``--rank 1 --keep-caches`` (a 33 MB checkpoint of the
same layout; the machine's page cache left alone, so every read is a page-cache read).

What is written: exactly what :meth:`daedalus_trainer.checkpoint.CheckpointManager.save` writes for the trainer's
learner, with random values (standard normal; second moments uniform in [0, 1)):

- ``adapter/adapter_model.safetensors``: LoRA A ``[r, in]`` and B ``[out, r]`` for q/k/v/o/gate/up/down of each of the
  36 decoder layers, fp32 (peft keeps adapter weights in fp32 on a bf16 base by default, ``autocast_adapter_dtype``),
  under PEFT's key names (``base_model.model.model.language_model.layers.N.self_attn.q_proj.lora_A.weight``);
- ``optimizer.pt``: ``torch.optim.AdamW.state_dict()`` over those parameters (``exp_avg`` and ``exp_avg_sq``, fp32,
  plus the scalar ``step``), created by a real AdamW step and then overwritten with random values;
- ``trainer_state.json`` (a 100-step metric history, RNG states) and ``MANIFEST.json``.

Shapes, Qwen3-VL-8B-Instruct's language model (``text_config``): 36 layers, hidden 4096, intermediate 12288,
32 attention heads and 8 KV heads of head_dim 128 (q/o: 4096 x 4096; k/v: 4096 -> 1024). The official
https://huggingface.co/Qwen/Qwen3-VL-8B-Instruct/blob/main/config.json is not in this project's reference store; the
same values appear in three independent copies found with the search tool: the ``text_config`` of a Qwen3-VL-8B
fine-tune (https://huggingface.co/Steinate/Cortex/blame/main/config.json: hidden_size 4096, intermediate_size 12288,
num_hidden_layers 36, num_attention_heads 32, num_key_value_heads 8, head_dim 128), the GGUF metadata of
``qwen3-vl:8b-instruct`` (https://ollama.com/library/qwen3-vl:8b-instruct-q8_0/blobs/4768dcaebbaf: block_count 36,
embedding_length 4096, feed_forward_length 12288, head_count 32, head_count_kv 8, key_length 128) and MindSpeed-MM's
``examples/qwen3vl/model_8B.json`` (initialised from Qwen3-VL-8B-Instruct: 36 layers, hidden 4096, 32 heads).

Per LoRA'd layer r*(in+out) parameters: q, o 32*8192; k, v 32*5120; gate, up, down 32*16384 -> 2,424,832 per
decoder layer, 87,293,952 in all: 349 MB of adapter + 698 MB of AdamW moments = 1.05 GB per checkpoint.

Anchors, measured in the same run on the same directory, interleaved with ours (order alternates per repeat):

- write: ``dd if=/dev/zero of=<dir>/dd.bin bs=16M count=N conv=fsync`` (N*16 MiB ~ the checkpoint size), and the same
  from a random file in /dev/shm (in case the virtual disk treats zeros specially);
- read: ``dd if=<dir>/dd.bin of=/dev/null bs=16M`` after ``sync; echo 3 > /proc/sys/vm/drop_caches`` (root only; the
  script says whether dropping worked). Our restore is measured after the same drop: ``CheckpointManager.load_latest``
  (which reads every byte once for the sha256 manifest check) + ``load_adapter_tensors`` + ``load_optimizer_state``.

Stall, two figures. The step time is from the 8B GPU regime: 30 s, the upper end of "approximately 25~30s per step"
for GRPO on Qwen2.5-VL with 7 generations on 8xA100-80G (VLM-R1, https://github.com/om-ai-lab/VLM-R1/issues/30), a
short (pessimistic) step; the ratio against ~290 s/step (Qwen3.5-9B multimodal GRPO on Geo3K, 8xH800,
https://github.com/verl-project/verl/issues/7203) is printed too.

- synchronous (``checkpoint_stall``): ``CheckpointManager.save`` seconds / step seconds, what a loop that saved in
  line would stall; it still describes the write itself.
- async (``checkpoint_stall_async``): what :meth:`daedalus_trainer.grpo.Trainer.train` does now, through
  :class:`daedalus_trainer.grpo.CheckpointWriter`: ``save`` calls ``learner.checkpoint_state.remote(packed=True)``
  (Ray copies the adapter, its config and the optimizer ``state_dict``, tensors as byte views, into its object store
  when the call returns) and queues, on one writer thread, the ``ray.get``, the unpacking into tensors and
  ``CheckpointManager.save``; the loop
  goes on at once, but the learner's next task (the next step's adapter publication, which the rollouts wait for)
  starts only after that serialization. :func:`async_stall` calls that same class on a local Ray started by the
  trainer's ``init_ray``, with a :class:`daedalus_trainer.actors.Learner` subclass (its real ``checkpoint_state``)
  holding this state. Loop stall = seconds from calling ``CheckpointWriter.save`` until a trivial learner call made
  right after it returns (so the learner's serialization counts) / step seconds; the background copy and write
  must finish within ``intervalSteps`` x step seconds, or the next save waits in ``settle()``.
  Not measured: the device -> host copy of a GPU learner's state, the network when the learner's node is not the
  driver's, and the writer thread's contention with the next step (the benchmark waits for each write idle).

Last lines: ``checkpoint_stall``, ``checkpoint_restore``, ``checkpoint_stall_async: <%> % of a step (learner snapshot
<s> s, background copy + write <s> s)`` and, final, ``checkpoint_save: <MB/s> MB/s (dd conv=fsync: <MB/s> MB/s, <ratio>x)``.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lib"))

import torch  # noqa: E402

from benchutil import figure_line, print_load, summarize  # noqa: E402

# Qwen3-VL-8B-Instruct text_config (see the module docstring for the sources).
LAYERS = 36
HIDDEN = 4096
INTERMEDIATE = 12288
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: (in_features, out_features) of each LoRA target.
SHAPES = {
    "q_proj": (HIDDEN, HEADS * HEAD_DIM), "k_proj": (HIDDEN, KV_HEADS * HEAD_DIM),
    "v_proj": (HIDDEN, KV_HEADS * HEAD_DIM), "o_proj": (HEADS * HEAD_DIM, HIDDEN),
    "gate_proj": (HIDDEN, INTERMEDIATE), "up_proj": (HIDDEN, INTERMEDIATE), "down_proj": (INTERMEDIATE, HIDDEN),
}
STEP_SECONDS_8B = 30.0  # VLM-R1 issue #30 (upper end of 25-30 s per GRPO step on 8xA100-80G)
STEP_SECONDS_9B = 290.0  # verl issue #7203 (Qwen3.5-9B multimodal GRPO, 8xH800, steady state)
MB = 1e6


def lora_key(layer: int, target: str, which: str) -> str:
    """PEFT's saved key for a Qwen3-VL language-model LoRA matrix (``which`` is ``lora_A`` or ``lora_B``)."""
    block = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return f"base_model.model.model.language_model.layers.{layer}.{block}.{target}.{which}.weight"


def build_optimizer(rank: int, seed: int = 0):
    """Random adapter tensors (PEFT names, fp32), adapter config, and a live AdamW over them (state filled in).

    Returns:
        ``(tensors: dict[str, Tensor], config: dict, optimizer: torch.optim.AdamW, n_params: int)``; the optimizer's
        parameters share storage with ``tensors``.
    """
    from peft import LoraConfig

    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(LAYERS):
        for target in TARGETS:
            fan_in, fan_out = SHAPES[target]
            tensors[lora_key(layer, target, "lora_A")] = torch.randn(rank, fan_in, generator=gen)
            tensors[lora_key(layer, target, "lora_B")] = torch.randn(fan_out, rank, generator=gen)
    params = [torch.nn.Parameter(t) for t in tensors.values()]  # shares storage with tensors
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    for p in params:
        p.grad = torch.empty_like(p).normal_(generator=gen)
    optimizer.step()  # creates the real state layout (step, exp_avg, exp_avg_sq)
    for p in params:
        st = optimizer.state[p]
        st["exp_avg"].normal_(generator=gen)
        st["exp_avg_sq"].uniform_(generator=gen)
        p.grad = None
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(TARGETS),
                        base_model_name_or_path="Qwen/Qwen3-VL-8B-Instruct").to_dict()
    n_params = sum(t.numel() for t in tensors.values())
    return tensors, config, optimizer, n_params


def build_state(rank: int, seed: int = 0):
    """:func:`build_optimizer`, with the optimizer replaced by its ``state_dict()``.

    Returns:
        ``(tensors: dict[str, Tensor], config: dict, optimizer_state: dict, n_params: int)``.
    """
    tensors, config, optimizer, n_params = build_optimizer(rank, seed)
    return tensors, config, optimizer.state_dict(), n_params


def trainer_state(step: int):
    """A realistic ``TrainerState``: sampler position, RNG states, 100 steps of metric history."""
    from daedalus_trainer.checkpoint import TrainerState, capture_rng_state

    history = [{"step": i, "reward_mean": 0.5, "success_ratio": 0.4, "loss": 0.01, "kl": 0.001, "grad_norm": 0.3,
                "rollout_seconds": 20.0, "learner_seconds": 8.0, "rollout_tokens": 12000} for i in range(100)]
    return TrainerState(sampler={"seed": 0, "next_step": step}, rng=capture_rng_state(), metric_history=history)


def drop_caches() -> bool:
    """``sync`` then ``echo 3 > /proc/sys/vm/drop_caches``; True if the kernel accepted it."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def cached_kib() -> int:
    """``Cached`` from /proc/meminfo in KiB (to show that dropping caches took effect)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Cached:"):
            return int(line.split()[1])
    return -1


_DD_RE = re.compile(r"(\d+) bytes .* copied, ([0-9.]+) s")


def run_dd(*args: str) -> tuple[int, float]:
    """Run ``dd`` and return ``(bytes, seconds)`` from its own summary line.

    Raises:
        RuntimeError: dd failed or printed no summary.
    """
    res = subprocess.run(["dd", *args], capture_output=True, text=True)
    m = _DD_RE.search(res.stderr)
    if res.returncode != 0 or m is None:
        raise RuntimeError(f"dd {' '.join(args)} failed: {res.stderr.strip()}")
    return int(m.group(1)), float(m.group(2))


def save_components(tensors, optim_state, work: Path) -> dict[str, float]:
    """Time the pieces of a save separately, with the libraries ``CheckpointManager.save`` uses: serialising the
    optimizer state (``torch.save`` into memory) and the adapter (``safetensors.torch.save``), sha256 of the bytes,
    and writing + fsync. Seconds per piece (one run; shows where the time goes)."""
    import hashlib
    import io

    import safetensors.torch

    out: dict[str, float] = {}
    t = time.perf_counter()
    buf = io.BytesIO()
    torch.save(optim_state, buf)
    opt_bytes = buf.getvalue()
    out["torch.save optimizer (memory)"] = time.perf_counter() - t
    t = time.perf_counter()
    ad_bytes = safetensors.torch.save({k: v.contiguous() for k, v in tensors.items()}, metadata={"format": "pt"})
    out["safetensors adapter (memory)"] = time.perf_counter() - t
    t = time.perf_counter()
    hashlib.sha256(opt_bytes).hexdigest()
    hashlib.sha256(ad_bytes).hexdigest()
    out["sha256 (memory)"] = time.perf_counter() - t
    t = time.perf_counter()
    for name, data in (("parts-optimizer.pt", opt_bytes), ("parts-adapter.safetensors", ad_bytes)):
        with open(work / name, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    out["write + fsync"] = time.perf_counter() - t
    for name in ("parts-optimizer.pt", "parts-adapter.safetensors"):
        (work / name).unlink()
    return out


def bench_learner_class():
    """A :class:`daedalus_trainer.actors.Learner` whose policy is replaced by the benchmark's state.

    ``checkpoint_state`` is the Learner's own method (inherited, not copied): ``(adapter_state(), adapter_config(),
    optimizer.state_dict())``. ``adapter_state`` copies the tensors as ``Policy.adapter_state`` does
    (``detach().to("cpu", copy=True)``); the optimizer is a live AdamW built by :func:`build_optimizer` (its
    ``state_dict()`` references the live moments, as the learner's does). Built in a function so that importing
    this script does not import the trainer's actors module.
    """
    from daedalus_trainer.actors import Learner

    class BenchLearner(Learner):
        def __init__(self, rank: int, seed: int = 0):
            """No policy to load: the state is :func:`build_optimizer`'s (rank ``rank``, seeded)."""
            torch.set_num_threads(1)
            self._tensors, self._config, self.optimizer, self._n_params = build_optimizer(rank, seed)

        def n_params(self) -> int:
            """LoRA parameters held (also tells the caller that the constructor has finished)."""
            return self._n_params

        def adapter_state(self) -> dict[str, torch.Tensor]:
            """Copies of the adapter tensors, as ``Policy.adapter_state``."""
            return {k: v.detach().to("cpu", copy=True) for k, v in self._tensors.items()}

        def adapter_config(self) -> dict:
            """The PEFT config dict."""
            return dict(self._config)

    return BenchLearner


def async_stall(rank: int, repeats: int, root: Path) -> list[dict[str, float]]:
    """The training loop's stall per checkpoint with the trainer's own background writer
    (:class:`daedalus_trainer.grpo.CheckpointWriter`, which :meth:`daedalus_trainer.grpo.Trainer.train` uses).

    On a local Ray started by the trainer's own ``init_ray(local=True)`` (2 CPUs here, no dashboard), a
    :func:`bench_learner_class` actor (``num_cpus=0.5``, the trainer's CPU option) holds the state. Per repeat the
    loop stall is the time from calling ``CheckpointWriter.save`` until a trivial learner call made right after it
    (``n_params``) returns: what the next step waits before the learner can publish its adapter. The write is then
    waited for (so the next save does not wait for it); its total (state copy into this process + file write) is
    timed around ``settle`` and the file write alone taken from ``CheckpointInfo.seconds``. One warm-up repeat
    first, not returned.

    Returns:
        one dict per repeat: ``stall`` (seconds the loop waited), ``write`` (seconds of ``CheckpointManager.save``
        in the writer thread), ``background`` (seconds from the end of the stall until the checkpoint committed:
        the copy into this process plus the write), ``bytes`` (checkpoint size).
    """
    import ray

    from daedalus_trainer.checkpoint import CheckpointManager
    from daedalus_trainer.grpo import CheckpointWriter, init_ray

    t = time.perf_counter()
    init_ray(local=True)
    try:
        learner = ray.remote(bench_learner_class()).options(num_cpus=0.5).remote(rank)
        n = ray.get(learner.n_params.remote())
        print(f"async: Ray started and learner actor holds {n:,} LoRA parameters + AdamW after "
              f"{time.perf_counter() - t:.1f} s", flush=True)
        checkpointer = CheckpointWriter(CheckpointManager(root, keep=2))
        rows: list[dict[str, float]] = []
        try:
            for rep in range(repeats + 1):
                step = 1000 + rep
                state = trainer_state(step)
                t0 = time.perf_counter()
                checkpointer.save(step, learner, state)  # what Trainer.train's loop calls ...
                ray.get(learner.n_params.remote())  # ... and the learner's next task, queued behind the snapshot
                t1 = time.perf_counter()
                info = checkpointer.settle(final=True)  # the copy + write; the write timed by CheckpointManager.save
                t2 = time.perf_counter()
                if rep == 0:
                    print(f"  async warm-up: loop stall {t1 - t0:.2f} s, write {info.seconds:.2f} s", flush=True)
                    continue
                rows.append({"stall": t1 - t0, "write": info.seconds, "background": t2 - t1, "bytes": info.bytes})
                print(f"  async repeat {rep}: loop stall (learner snapshot) {t1 - t0:.2f} s, background copy + write "
                      f"{t2 - t1:.2f} s (write {info.seconds:.2f} s)", flush=True)
        finally:
            checkpointer.close()
        return rows
    finally:
        ray.shutdown()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir in /tmp)")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5, help=">= 5")
    p.add_argument("--keep-caches", action="store_true",
                   help="do not drop the machine's page cache before reads (restore and dd read are then page-cache "
                        "reads, not the disk's; for smoke runs on a shared machine)")
    args = p.parse_args(argv)
    if args.repeats < 5:
        p.error("--repeats must be >= 5")
    torch.set_num_threads(1)

    from daedalus_trainer.checkpoint import AdapterState, CheckpointManager
    from daedalus_trainer.config import CheckpointSpec

    print_load("start")
    t0 = time.perf_counter()
    tensors, config, optim_state, n_params = build_state(args.rank)
    print(f"state: {n_params:,} LoRA parameters (rank {args.rank}, {len(tensors)} tensors), built in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)

    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="daedalus-ckpt-bench-", dir=base))
    dev = subprocess.run(["df", "--output=source,fstype,target", str(work)], capture_output=True, text=True).stdout
    print(f"directory: {work}\n{dev.strip()}", flush=True)
    shm_random = None
    try:
        manager = CheckpointManager(work / "checkpoints", keep=2)
        adapter = AdapterState(tensors, config)
        # One save to learn the size (and to warm up allocators); not counted.
        info = manager.save(0, adapter, optim_state, trainer_state(0))
        ckpt_bytes = info.bytes
        blocks = max(1, round(ckpt_bytes / (16 << 20)))
        print(f"checkpoint: {ckpt_bytes / MB:.1f} MB ({', '.join(f'{f.name}' for f in sorted(info.path.rglob('*')) if f.is_file())}); "
              f"dd: {blocks} x 16 MiB = {blocks * 16 * 1.048576:.1f} MB", flush=True)
        if Path("/dev/shm").is_dir() and shutil.disk_usage("/dev/shm").free > 3 * blocks * (16 << 20):
            shm_random = Path(tempfile.mkstemp(prefix="daedalus-bench-rand-", dir="/dev/shm")[1])
            run_dd("if=/dev/urandom", f"of={shm_random}", "bs=16M", f"count={blocks}")
        def drop() -> bool:
            """Drop the page cache (True if it worked); never with ``--keep-caches``."""
            return False if args.keep_caches else drop_caches()

        before = cached_kib()
        dropped = drop()
        after = cached_kib()
        print(f"drop_caches: {'works' if dropped else 'skipped (--keep-caches)' if args.keep_caches else 'NOT possible'}"
              f"{'' if dropped else ' (cold reads are page-cache reads)'} "
              f"(Cached {before / 1024:.0f} MiB -> {after / 1024:.0f} MiB)", flush=True)

        rows = []
        ddfile = work / "dd.bin"
        for rep in range(args.repeats):
            step = rep + 1
            r: dict[str, float] = {}

            def ours_save():
                t = time.perf_counter()
                manager.save(step, adapter, optim_state, trainer_state(step))
                r["save"] = time.perf_counter() - t

            def dd_write():
                n, s = run_dd("if=/dev/zero", f"of={ddfile}", "bs=16M", f"count={blocks}", "conv=fsync")
                r["dd_write"] = s
                r["dd_bytes"] = n
                if shm_random is not None:
                    n2, s2 = run_dd(f"if={shm_random}", f"of={ddfile}.rand", "bs=16M", "conv=fsync")
                    r["dd_write_rand"] = s2
                    (work / "dd.bin.rand").unlink()

            def ours_restore():
                drop()
                t = time.perf_counter()
                loaded = manager.load_latest()  # reads every byte once: manifest sha256 check
                r["restore_verify"] = time.perf_counter() - t
                a = loaded.load_adapter_tensors()
                o = loaded.load_optimizer_state()
                r["restore"] = time.perf_counter() - t
                assert loaded.step == step and len(a) == len(tensors) and len(o["state"]) == len(tensors)
                t = time.perf_counter()  # warm: straight after, from the page cache
                loaded = manager.load_latest()
                loaded.load_adapter_tensors()
                loaded.load_optimizer_state()
                r["restore_warm"] = time.perf_counter() - t

            def dd_read():
                drop()
                _, s = run_dd(f"if={ddfile}", "of=/dev/null", "bs=16M")
                r["dd_read"] = s

            order = [ours_save, dd_write] if rep % 2 == 0 else [dd_write, ours_save]
            order += [ours_restore, dd_read] if rep % 2 == 0 else [dd_read, ours_restore]
            for fn in order:
                fn()
            ddfile.unlink()
            rows.append(r)
            print(f"  repeat {rep + 1}: save {r['save']:.2f} s, dd write {r['dd_write']:.2f} s"
                  + (f" (random source {r['dd_write_rand']:.2f} s)" if "dd_write_rand" in r else "")
                  + f"; restore {r['restore']:.2f} s (warm {r['restore_warm']:.2f} s), dd read {r['dd_read']:.2f} s",
                  flush=True)
        dd_bytes = rows[0]["dd_bytes"]
        parts = save_components(tensors, optim_state, work)
        if shm_random is not None:
            shm_random.unlink(missing_ok=True)  # frees 1 GB of /dev/shm for Ray's object store
            shm_random = None
        arows = async_stall(args.rank, args.repeats, work / "async-checkpoints")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if shm_random is not None:
            shm_random.unlink(missing_ok=True)
    print_load("end")

    save_mbs = summarize([ckpt_bytes / r["save"] / MB for r in rows])
    dd_w = summarize([dd_bytes / r["dd_write"] / MB for r in rows])
    rest_mbs = summarize([ckpt_bytes / r["restore"] / MB for r in rows])
    warm_mbs = summarize([ckpt_bytes / r["restore_warm"] / MB for r in rows])
    dd_r = summarize([dd_bytes / r["dd_read"] / MB for r in rows])
    save_s = summarize([r["save"] for r in rows])
    pair_w = summarize([(ckpt_bytes / r["save"]) / (dd_bytes / r["dd_write"]) for r in rows])
    pair_r = summarize([(ckpt_bytes / r["restore"]) / (dd_bytes / r["dd_read"]) for r in rows])
    print(f"\n== checkpoint {ckpt_bytes / MB:.0f} MB (rank-{args.rank} LoRA on Qwen3-VL-8B shapes + AdamW), "
          f"median [min, max] over {len(rows)} repeats ==")
    print(f"save (CheckpointManager.save)     {save_mbs.fmt(0, 'MB/s')}   ({save_s.fmt(2, 's')})")
    print(f"dd write conv=fsync (/dev/zero)   {dd_w.fmt(0, 'MB/s')}")
    if all("dd_write_rand" in r for r in rows):
        print(f"dd write conv=fsync (random)      "
              f"{summarize([dd_bytes / r['dd_write_rand'] / MB for r in rows]).fmt(0, 'MB/s')}")
    print(f"save / dd write, per repeat       {pair_w.fmt(2, 'x')}")
    print(f"restore cold (load_latest + load) {rest_mbs.fmt(0, 'MB/s')}   (caches dropped: {dropped})")
    print(f"restore warm (page cache)         {warm_mbs.fmt(0, 'MB/s')}")
    print(f"dd read (caches dropped)          {dd_r.fmt(0, 'MB/s')}")
    print(f"restore / dd read, per repeat     {pair_r.fmt(2, 'x')}")
    print(f"  of which load_latest (verify)   {summarize([r['restore_verify'] for r in rows]).fmt(2, 's')}; "
          f"deserialise {summarize([r['restore'] - r['restore_verify'] for r in rows]).fmt(2, 's')}")
    print("save's work, timed one by one with the same libraries (once): "
          + ", ".join(f"{k} {v:.2f} s" for k, v in parts.items())
          + "; save also re-reads every file for its manifest sha256")
    print(f"stall per checkpoint              {100 * save_s.median / STEP_SECONDS_8B:.1f}% of a {STEP_SECONDS_8B:.0f} s "
          f"8B-regime step (VLM-R1 #30); {100 * save_s.median / STEP_SECONDS_9B:.2f}% of {STEP_SECONDS_9B:.0f} s "
          f"(verl #7203); max {100 * save_s.max / STEP_SECONDS_8B:.1f}%")
    loop_s = summarize([r["stall"] for r in arows])
    write_s = summarize([r["write"] for r in arows])
    back_s = summarize([r["background"] for r in arows])
    interval = CheckpointSpec.model_fields["interval_steps"].default  # spec.checkpoint.intervalSteps default
    budget = interval * STEP_SECONDS_8B
    print(f"async (grpo.CheckpointWriter: learner snapshot into Ray's object store; ray.get + write on 1 thread), "
          f"{len(arows)} repeats:")
    print(f"  loop stall (learner snapshot)    {loop_s.fmt(2, 's')} = {100 * loop_s.median / STEP_SECONDS_8B:.1f}% of "
          f"a {STEP_SECONDS_8B:.0f} s step (max {100 * loop_s.max / STEP_SECONDS_8B:.1f}%); "
          f"{100 * loop_s.median / STEP_SECONDS_9B:.2f}% of {STEP_SECONDS_9B:.0f} s")
    print(f"  background copy + write          {back_s.fmt(2, 's')} (write alone {write_s.fmt(2, 's')}); must stay "
          f"under interval x step = {interval} (default intervalSteps) x {STEP_SECONDS_8B:.0f} s = {budget:.0f} s or "
          f"the next save waits in settle(): {'holds' if back_s.max < budget else 'DOES NOT hold'} "
          f"(it holds down to intervalSteps = {max(1, math.ceil(back_s.max / STEP_SECONDS_8B))})")
    print()
    print(f"checkpoint_stall: {100 * save_s.median / STEP_SECONDS_8B:.1f} % of a step "
          f"(anchor: 5 % target, {STEP_SECONDS_8B:.0f} s 8B GRPO step)")
    print(figure_line("checkpoint_restore", rest_mbs.median, "MB/s", "dd read, caches dropped", dd_r.median,
                      rest_mbs.median / dd_r.median, digits=0))
    print(f"checkpoint_stall_async: {100 * loop_s.median / STEP_SECONDS_8B:.1f} % of a step (learner snapshot "
          f"{loop_s.median:.2f} s, background copy + write {back_s.median:.2f} s)")
    print(figure_line("checkpoint_save", save_mbs.median, "MB/s", "dd conv=fsync", dd_w.median,
                      save_mbs.median / dd_w.median, digits=0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
