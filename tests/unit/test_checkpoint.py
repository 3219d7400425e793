"""Checkpoints (DESIGN §4): round trip, manifest verification, fallback on corruption, rotation, full disk, export.

Full disk: two honest simulations, both real writes through the real checkpoint code.
1. ``FullDisk``: a test double for the DISK passed as the documented ``opener`` parameter; it writes real files and
   raises ``OSError(ENOSPC)`` once a byte budget is spent, exactly as ``write(2)`` does on a full file system.
   Always runs (CI may not allow mounts).
2. A real 1 MiB tmpfs (``mount -t tmpfs -o size=1m``): runs where mounting is permitted (root with CAP_SYS_ADMIN, as
   on the development machine), skipped with the reason otherwise.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import logging
import os
import random
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from daedalus_trainer.checkpoint import (
    LATEST,
    MANIFEST,
    AdapterState,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointManager,
    CheckpointSaveError,
    PackedTensor,
    TrainerState,
    atomic_write_json,
    atomic_write_text,
    capture_rng_state,
    export_adapter,
    list_checkpoints,
    pack_tensors,
    unpack_tensors,
    load_checkpoint,
    load_latest,
    resolve_resume,
    restore_interrupted_export,
    restore_rng_state,
    verify_checkpoint,
)

torch.set_num_threads(1)

PREFIX = "base_model.model.layers.0.self_attn.q_proj"


class TinyLoRA(torch.nn.Module):
    """A frozen linear layer with a LoRA pair: y = W x + B A x (Hu et al. 2021). x: [batch, 8] -> y: [batch, 6]."""

    def __init__(self, seed: int, rank: int = 4) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.base = torch.nn.Linear(8, 6)
        with torch.no_grad():  # seeded too: nn.Linear's own init draws from the global RNG
            self.base.weight.copy_(torch.randn(6, 8, generator=g))
            self.base.bias.copy_(torch.randn(6, generator=g))
        self.base.requires_grad_(False)
        self.lora_A = torch.nn.Parameter(torch.randn(rank, 8, generator=g) * 0.1)
        self.lora_B = torch.nn.Parameter(torch.randn(6, rank, generator=g) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.lora_A.T @ self.lora_B.T

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        return {f"{PREFIX}.lora_A.weight": self.lora_A.detach().clone(),
                f"{PREFIX}.lora_B.weight": self.lora_B.detach().clone()}


LORA_CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": {"q_proj", "v_proj"},
               "task_type": "CAUSAL_LM", "base_model_name_or_path": "tiny"}


def train_steps(model: TinyLoRA, opt: torch.optim.Optimizer, n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(5, 8, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def make_state(step: int, extra_tensors: dict[str, torch.Tensor] | None = None):
    model = TinyLoRA(seed=0)
    opt = torch.optim.AdamW([model.lora_A, model.lora_B], lr=1e-2)
    train_steps(model, opt, max(step, 1), seed=step)
    tensors = model.adapter_tensors() | (extra_tensors or {})
    state = TrainerState(sampler={"seed": 7, "next_index": step * 8},
                         rng=capture_rng_state(),
                         metric_history=[{"step": s, "reward_mean": s / 10, "kl": float("nan")} for s in range(step)])
    return AdapterState(tensors, LORA_CONFIG), opt.state_dict(), state


def save_steps(manager: CheckpointManager, steps) -> dict:
    infos = {}
    for s in steps:
        infos[s] = manager.save(s, *make_state(s))
    return infos


# --------------------------------------------------------------------------------------------------------------------


def test_round_trip_restores_adapter_optimizer_and_rng_exactly(tmp_path: Path) -> None:
    model = TinyLoRA(seed=1)
    opt = torch.optim.AdamW([model.lora_A, model.lora_B], lr=1e-2)
    train_steps(model, opt, 3, seed=11)
    extra = {"bf16.weight": torch.randn(3, 2).to(torch.bfloat16)}
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    rng = capture_rng_state()
    expected_draws = (random.random(), np.random.rand(), torch.rand(3))
    manager = CheckpointManager(tmp_path / "ckpt", keep=2)
    info = manager.save(3, AdapterState(model.adapter_tensors() | extra, LORA_CONFIG), opt.state_dict(),
                        TrainerState(sampler={"next": 24}, rng=rng, metric_history=[{"step": 3, "kl": float("nan")}],
                                     extra={"note": "x"}))
    assert info.step == 3 and info.path == (tmp_path / "ckpt" / "step-000003").absolute()
    assert info.bytes == sum(p.stat().st_size for p in info.path.rglob("*") if p.is_file())
    assert info.seconds > 0 and abs(info.time - os.path.getmtime(info.path / MANIFEST)) < 60

    # Continue the original for 2 steps; the resumed copy must match bit for bit.
    train_steps(model, opt, 2, seed=99)

    loaded = manager.load_latest()
    assert loaded is not None and loaded.step == 3 and loaded.path == info.path
    tensors = loaded.load_adapter_tensors()
    assert set(tensors) == {f"{PREFIX}.lora_A.weight", f"{PREFIX}.lora_B.weight", "bf16.weight"}
    assert tensors["bf16.weight"].dtype == torch.bfloat16 and torch.equal(tensors["bf16.weight"], extra["bf16.weight"])
    config = loaded.load_adapter_config()
    assert config["r"] == 4 and config["target_modules"] == ["q_proj", "v_proj"]  # set written as sorted list

    resumed = TinyLoRA(seed=1)
    with torch.no_grad():
        resumed.lora_A.copy_(tensors[f"{PREFIX}.lora_A.weight"])
        resumed.lora_B.copy_(tensors[f"{PREFIX}.lora_B.weight"])
    resumed_opt = torch.optim.AdamW([resumed.lora_A, resumed.lora_B], lr=1e-2)
    resumed_opt.load_state_dict(loaded.load_optimizer_state())
    train_steps(resumed, resumed_opt, 2, seed=99)
    assert torch.equal(resumed.lora_A, model.lora_A) and torch.equal(resumed.lora_B, model.lora_B)

    assert loaded.info.step == 3 and loaded.info.path == info.path and loaded.info.bytes == info.bytes
    assert loaded.info.time == pytest.approx(info.time, abs=5)  # manifest time is taken just before the commit
    ts = loaded.trainer_state
    assert ts.sampler == {"next": 24} and ts.extra == {"note": "x"}
    assert ts.metric_history[0]["step"] == 3 and np.isnan(ts.metric_history[0]["kl"])
    random.random(), np.random.rand(), torch.rand(3)  # move the generators on
    restore_rng_state(ts.rng)
    draws = (random.random(), np.random.rand(), torch.rand(3))
    assert draws[0] == expected_draws[0] and draws[1] == expected_draws[1] and torch.equal(draws[2], expected_draws[2])


def test_layout_manifest_and_pointer(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    info = CheckpointManager(root, keep=3).save(120, *make_state(2))
    files = sorted(p.relative_to(info.path).as_posix() for p in info.path.rglob("*") if p.is_file())
    assert files == ["MANIFEST.json", "adapter/adapter_config.json", "adapter/adapter_model.safetensors",
                     "optimizer.pt", "trainer_state.json"]
    manifest = json.loads((info.path / MANIFEST).read_text())
    assert manifest["step"] == 120
    for entry in manifest["files"]:
        data = (info.path / entry["path"]).read_bytes()
        assert entry["bytes"] == len(data) and entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert {e["path"] for e in manifest["files"]} == set(files) - {"MANIFEST.json"}
    assert json.loads((info.path / "trainer_state.json").read_text())["step"] == 120
    assert (root / LATEST).read_text() == "step-000120\n"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000120"]  # no temporaries left
    assert verify_checkpoint(info.path) == []


def test_peft_writer_round_trip_is_loadable_by_peft(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = torch.nn.Linear(8, 8)
            self.out = torch.nn.Linear(8, 2)

        def forward(self, x):
            return self.out(torch.relu(self.q_proj(x)))

    torch.manual_seed(0)
    base = Net()
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()  # non-zero B so the adapter changes the output
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    x = torch.randn(4, 8)
    model(x).sum().backward()
    opt.step()
    expected = model(x).detach()

    info = CheckpointManager(tmp_path / "ckpt", keep=1).save(
        1, lambda d: model.save_pretrained(d), opt.state_dict(), TrainerState())
    loaded = load_latest(tmp_path / "ckpt")
    assert loaded is not None and loaded.step == 1
    listed = {e["path"] for e in loaded.manifest["files"]}
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors"} <= listed

    torch.manual_seed(0)
    fresh_base = Net()  # same seed, same base weights as `base` before peft wrapped it
    reloaded = peft.PeftModel.from_pretrained(fresh_base, str(info.adapter_dir))
    assert torch.equal(reloaded(x), expected)


def test_writer_that_writes_nothing_is_a_clear_error_and_leaves_nothing(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    manager = CheckpointManager(root, keep=2)
    save_steps(manager, [1])
    _, opt_state, state = make_state(2)
    with pytest.raises(CheckpointSaveError, match="adapter writer did not write adapter_config.json"):
        manager.save(2, lambda d: None, opt_state, state)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001"]


@pytest.mark.parametrize(
    ("target", "damage", "reason"),
    [
        ("adapter/adapter_model.safetensors", "truncate", "size mismatch"),
        ("optimizer.pt", "flip", "sha256 mismatch"),
        ("trainer_state.json", "flip", "sha256 mismatch"),
        ("adapter/adapter_config.json", "delete", "missing"),
        ("MANIFEST.json", "delete", "missing"),
        ("MANIFEST.json", "truncate", "unreadable JSON"),
    ],
)
def test_corrupt_newest_falls_back_to_previous_with_log(tmp_path: Path, caplog, target: str, damage: str,
                                                         reason: str) -> None:
    root = tmp_path / "ckpt"
    save_steps(CheckpointManager(root, keep=3), [10, 20])
    victim = root / "step-000020" / target
    if damage == "truncate":
        size = victim.stat().st_size
        with open(victim, "r+b") as f:
            f.truncate(size // 2)
    elif damage == "flip":
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0x01
        victim.write_bytes(bytes(data))
    else:
        victim.unlink()

    with caplog.at_level(logging.WARNING, logger="daedalus_trainer.checkpoint"):
        loaded = load_latest(root)
    assert loaded is not None and loaded.step == 10
    assert loaded.path.name == "step-000010"
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("step-000020" in line and target in line and reason in line and "falling back to step-000010" in line
               for line in lines), lines


def test_a_state_whose_step_disagrees_with_its_directory_fails_and_resume_falls_back(tmp_path: Path,
                                                                                       caplog) -> None:
    """step-000020's trainer_state.json says step 17 (a state copied from another checkpoint) and its manifest lists
    the edited file's real size and sha256, so only the disagreement is wrong: verification names both numbers and
    load_latest resumes from step 10 with the usual warning."""
    root = tmp_path / "ckpt"
    save_steps(CheckpointManager(root, keep=3), [10, 20])
    newest = root / "step-000020"
    state_file = newest / "trainer_state.json"
    doc = json.loads(state_file.read_text())
    assert doc["step"] == 20
    doc["step"] = 17
    data = json.dumps(doc).encode()
    state_file.write_bytes(data)
    manifest = json.loads((newest / MANIFEST).read_text())
    (entry,) = [e for e in manifest["files"] if e["path"] == "trainer_state.json"]
    entry["bytes"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    (newest / MANIFEST).write_text(json.dumps(manifest))

    problems = verify_checkpoint(newest)
    assert [(p.file, p.reason) for p in problems] == [("trainer_state.json", "step mismatch")]
    assert problems[0].detail == "trainer_state.json says step 17, the directory name step-000020 says step 20"
    with pytest.raises(CheckpointCorruptError, match="step mismatch"):
        load_checkpoint(newest)
    with caplog.at_level(logging.WARNING, logger="daedalus_trainer.checkpoint"):
        loaded = load_latest(root)
    assert loaded is not None and loaded.step == 10 and loaded.path.name == "step-000010"
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(line.startswith(f"checkpoint {newest} rejected: trainer_state.json: step mismatch (trainer_state.json "
                               "says step 17, the directory name step-000020 says step 20); falling back to "
                               "step-000010") for line in lines), lines
    # the same state under a name that encodes no step (an abandoned copy) verifies: nothing to compare it with
    aside = root / "abandoned-step-000020-x"
    os.rename(newest, aside)
    assert verify_checkpoint(aside) == []


@pytest.mark.parametrize("unreadable", ["optimizer.pt", MANIFEST])
def test_an_unreadable_newest_checkpoint_is_an_error_not_a_fallback(tmp_path: Path, unreadable: str) -> None:
    """Permission denied (EACCES, a real one: the file mode is 000 and the reader may not override it) on the newest
    checkpoint's optimizer state or its manifest says nothing about its content: load_latest raises instead of
    resuming from the older checkpoint (whose steps would be trained again, and the newer one moved aside). As root
    the read runs in a child process without CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH (util-linux setpriv)."""
    import sys

    root = tmp_path / "ckpt"
    save_steps(CheckpointManager(root, keep=3), [10, 20])
    (root / "step-000020" / unreadable).chmod(0)
    probe = ("import sys\nfrom daedalus_trainer.checkpoint import CheckpointError, load_latest\n"
             "try:\n    c = load_latest(sys.argv[1])\nexcept CheckpointError as e:\n    print('ERROR', e)\n"
             "else:\n    print('LOADED', c.step)\n")
    cmd = [sys.executable, "-c", probe, str(root)]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without util-linux setpriv: root reads a mode-000 file")
        cmd = [setpriv, "--bounding-set=-dac_override,-dac_read_search", "--", *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith(f"ERROR cannot read checkpoint {root / 'step-000020'}: [Errno 13] Permission "
                                 "denied"), out.stdout
    assert "no older checkpoint was tried and nothing was moved aside" in out.stdout
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000010", "step-000020"]


def test_all_corrupt_raises_and_empty_root_returns_none(tmp_path: Path) -> None:
    assert load_latest(tmp_path / "nothing-here") is None
    root = tmp_path / "ckpt"
    save_steps(CheckpointManager(root, keep=3), [1, 2])
    for d in ("step-000001", "step-000002"):
        (root / d / "optimizer.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointCorruptError, match="none of the 2 checkpoint") as exc:
        load_latest(root)
    assert {p.name for p in exc.value.problems} == {"step-000001", "step-000002"}
    assert "`--resume none`" in str(exc.value) and "never deleted" in str(exc.value)  # the way on, by name


def test_keep_n_rotation_never_deletes_latest(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    manager = CheckpointManager(root, keep=2)
    save_steps(manager, [1, 2, 3, 4, 5])
    assert [s for s, _ in list_checkpoints(root)] == [4, 5]
    assert (root / LATEST).read_text().strip() == "step-000005"
    assert not any(p.name.startswith(".") for p in root.iterdir())
    one = CheckpointManager(root, keep=1)
    one.save(6, *make_state(6))
    assert [s for s, _ in list_checkpoints(root)] == [6]
    with pytest.raises(ValueError, match="keep must be an integer >= 1"):
        CheckpointManager(root, keep=0)


def test_newer_complete_checkpoint_without_pointer_update_is_used(tmp_path: Path) -> None:
    """A crash between the directory rename and the pointer update leaves a complete newer checkpoint."""
    root = tmp_path / "ckpt"
    save_steps(CheckpointManager(root, keep=3), [1, 2])
    (root / LATEST).write_text("step-000001\n")
    loaded = load_latest(root)
    assert loaded is not None and loaded.step == 2


def test_leftover_temporary_from_killed_save_is_ignored_then_removed(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    manager = CheckpointManager(root, keep=3)
    save_steps(manager, [1])
    half = root / ".tmp-step-000002-deadbeef"
    (half / "adapter").mkdir(parents=True)
    (half / "optimizer.pt").write_bytes(b"partial")
    loaded = load_latest(root)
    assert loaded is not None and loaded.step == 1
    manager.save(2, *make_state(2))
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001", "step-000002"]


def test_resume_option_semantics(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    save_steps(CheckpointManager(root, keep=3), [1, 2])
    assert resolve_resume("none", root) is None
    assert resolve_resume("latest", root).step == 2
    assert resolve_resume("latest", tmp_path / "empty") is None
    assert resolve_resume(str(root / "step-000001"), tmp_path / "elsewhere").step == 1
    assert resolve_resume(str(root), tmp_path / "elsewhere").step == 2
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_resume(str(tmp_path / "missing"), root)
    (tmp_path / "afile").write_text("")
    with pytest.raises(CheckpointError, match="afile is a file; give a checkpoint directory"):
        resolve_resume(str(tmp_path / "afile"), root)
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        resolve_resume(str(tmp_path), root / "other")
    (root / "step-000001" / "trainer_state.json").write_text("{}")
    with pytest.raises(CheckpointCorruptError, match="trainer_state.json: size mismatch"):
        resolve_resume(str(root / "step-000001"), root)  # an explicit PATH never falls back


def test_saving_an_older_step_moves_the_abandoned_timeline_aside(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    manager = CheckpointManager(root, keep=5)
    save_steps(manager, [1, 2, 3])
    start = resolve_resume(str(root / "step-000001"), root)
    assert start.step == 1
    manager.save(2, *make_state(2))
    assert [s for s, _ in list_checkpoints(root)] == [1, 2]
    aside = sorted(p.name for p in root.iterdir() if p.name.startswith("abandoned-"))
    assert [n[: len("abandoned-step-000002")] for n in aside] == ["abandoned-step-000002", "abandoned-step-000003"]
    assert all(verify_checkpoint(root / n) == [] for n in aside)  # kept intact, not deleted
    assert load_latest(root).step == 2


def test_resuming_moves_the_timeline_it_does_not_continue_aside_before_any_save(tmp_path: Path) -> None:
    """resume none / an older PATH: once the run is accepted, the checkpoints of the replaced run leave at once, so a
    run interrupted before its first save is not followed by a `latest` resume of the old timeline; the old step-2 is
    set aside, not replaced, when the new run saves its own step 2. Resolving alone moves nothing."""
    root = tmp_path / "ckpt"
    save_steps(CheckpointManager(root, keep=5), [1, 2, 3])
    manager = CheckpointManager(root, keep=5)
    start = manager.resume(str(root / "step-000001"))
    assert start.step == 1 and [s for s, _ in list_checkpoints(root)] == [1, 2, 3]  # a refused run changes nothing
    manager.abandon_other_timelines(start)
    assert [s for s, _ in list_checkpoints(root)] == [1]
    assert load_latest(root).step == 1 and (root / "latest").read_text().strip() == "step-000001"
    aside = sorted(p.name for p in root.iterdir() if p.name.startswith("abandoned-"))
    assert [n[: len("abandoned-step-000002")] for n in aside] == ["abandoned-step-000002", "abandoned-step-000003"]
    assert all(verify_checkpoint(root / n) == [] for n in aside)
    manager.save(2, *make_state(2))
    assert len([p for p in root.iterdir() if p.name.startswith("abandoned-")]) == 2  # the old step 2 still kept

    latest = manager.resume("latest")
    manager.abandon_other_timelines(latest)  # the newest: nothing moves
    assert latest.step == 2 and [s for s, _ in list_checkpoints(root)] == [1, 2]
    manager.abandon_other_timelines(manager.resume("none"))
    assert list_checkpoints(root) == [] and not (root / "latest").exists() and load_latest(root) is None
    assert len([p for p in root.iterdir() if p.name.startswith("abandoned-")]) == 4


def test_resuming_from_outside_the_root_moves_all_of_its_checkpoints_aside(tmp_path: Path) -> None:
    """A PATH in another root, an abandoned-* directory of this root, or a symlink to one of this root's own: the
    first two leave nothing of this root's timeline behind (no older step of it to resume by mistake, no pointer to
    a renamed directory); a symlink counts as the directory it names, which `latest` then names."""
    other, root = tmp_path / "other", tmp_path / "ckpt"
    save_steps(CheckpointManager(other, keep=5), [4])
    save_steps(CheckpointManager(root, keep=5), [2, 6])
    manager = CheckpointManager(root, keep=5)
    manager.abandon_other_timelines(manager.resume(str(other / "step-000004")))
    assert list_checkpoints(root) == [] and not (root / "latest").exists()

    save_steps(manager, [1, 2])
    old = sorted(p for p in root.iterdir() if p.name.startswith("abandoned-step-000006"))[0]
    manager.abandon_other_timelines(manager.resume(str(old)))
    assert list_checkpoints(root) == [] and load_latest(root) is None

    save_steps(manager, [1, 2])
    (tmp_path / "best").symlink_to(root / "step-000001", target_is_directory=True)
    manager.abandon_other_timelines(manager.resume(str(tmp_path / "best")))
    assert [s for s, _ in list_checkpoints(root)] == [1]
    assert (root / "latest").read_text().strip() == "step-000001" and load_latest(root).step == 1


def test_saving_the_latest_step_again_replaces_it(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    manager = CheckpointManager(root, keep=3)
    save_steps(manager, [1, 2])
    adapter, opt_state, state = make_state(2)
    state.extra = {"second": True}
    manager.save(2, adapter, opt_state, state)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001", "step-000002"]
    assert load_latest(root).trainer_state.extra == {"second": True}

    # The same re-save on a disk that fills up at the very end puts the replaced checkpoint back.
    probe = FullDisk(float("inf"))
    CheckpointManager(tmp_path / "probe", keep=3, opener=probe).save(2, adapter, opt_state, state)
    state.extra = {"third": True}
    with pytest.raises(CheckpointSaveError, match="no space left on device"):
        CheckpointManager(root, keep=3, opener=FullDisk(probe.written - 6)).save(2, adapter, opt_state, state)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001", "step-000002"]
    assert load_latest(root).trainer_state.extra == {"second": True}


def test_a_killed_resave_of_the_same_step_loses_neither_copy(tmp_path: Path) -> None:
    """A save of the step `latest` names moves the old copy to .trash-* and then renames the new one in; a kill
    between the two renames leaves neither `step-N` (with keep=1 nothing else either). Resume puts the old copy back
    (it verifies) instead of starting over, and the next save's clean-up does too instead of deleting it."""
    root = tmp_path / "ckpt"
    save_steps(CheckpointManager(root, keep=1), [1, 2])
    assert [s for s, _ in list_checkpoints(root)] == [2]
    os.rename(root / "step-000002", root / ".trash-step-000002-0badc0de")  # the state the kill left
    (root / ".tmp-step-000002-1234abcd").mkdir()  # and the new copy, never renamed in
    assert load_latest(root) is None  # what resume saw before
    loaded = CheckpointManager(root, keep=1).resume("latest")
    assert loaded is not None and loaded.step == 2 and loaded.path.name == "step-000002"
    os.rename(root / "step-000002", root / ".trash-step-000002-0badc0de")
    save_steps(CheckpointManager(root, keep=2), [3])  # a save first: its clean-up restores, then rotates
    assert [s for s, _ in list_checkpoints(root)] == [2, 3]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000002", "step-000003"]


# --------------------------------------------------------------------------------------------------------------------
# Full disk
# --------------------------------------------------------------------------------------------------------------------


class FullDisk:
    """A disk with ``budget`` free bytes: an ``opener`` whose files write for real until the budget is spent, then
    raise ``OSError(ENOSPC)`` like write(2) on a full file system. Counts what was written in ``written``."""

    def __init__(self, budget: float) -> None:
        self.budget = budget
        self.written = 0

    def __call__(self, path: Path, mode: str):
        disk = self

        class File(io.FileIO):
            def write(self, b) -> int:
                n = len(memoryview(b))
                if disk.written + n > disk.budget:
                    room = max(0, int(disk.budget - disk.written))
                    super().write(bytes(memoryview(b)[:room]))
                    disk.written += room
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
                disk.written += n
                return super().write(b)

        return File(path, mode)


def assert_previous_intact(root: Path, step: int) -> None:
    assert (root / LATEST).read_text().strip() == f"step-{step:06d}"
    assert [s for s, _ in list_checkpoints(root)] == [step]
    assert verify_checkpoint(root / f"step-{step:06d}") == []
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")], "temporary files left behind"
    assert load_latest(root).step == step


@pytest.mark.parametrize("where", ["first file", "optimizer", "pointer"])
def test_enospc_during_save_keeps_previous_checkpoint(tmp_path: Path, where: str) -> None:
    root = tmp_path / "ckpt"
    save_steps(CheckpointManager(root, keep=3), [1])
    args = make_state(2)
    # Measure what a save of step 2 writes through the opener, on a scratch root.
    probe = FullDisk(float("inf"))
    CheckpointManager(tmp_path / "probe", keep=3, opener=probe).save(2, *args)
    adapter_bytes = (tmp_path / "probe" / "step-000002" / "adapter" / "adapter_model.safetensors").stat().st_size
    budget = {"first file": 100, "optimizer": adapter_bytes + 600, "pointer": probe.written - 6}[where]
    disk = FullDisk(budget)
    with pytest.raises(CheckpointSaveError, match="no space left on device") as exc:
        CheckpointManager(root, keep=3, opener=disk).save(2, *args)
    assert exc.value.errno == errno.ENOSPC and isinstance(exc.value.__cause__, OSError)
    assert disk.written == budget
    assert_previous_intact(root, 1)


@contextlib.contextmanager
def real_tmpfs(tmp_path: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of ``size`` (mount(8) syntax: "1m", "64k") mounted under ``tmp_path`` for the block, so ENOSPC
    comes from the kernel; the test is skipped, with the reason, where it cannot be mounted (not root, no mount)."""
    mnt = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root and mount(8)")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                          capture_output=True, text=True, timeout=10)
    if proc.returncode != 0:
        pytest.skip(f"mount -t tmpfs failed: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False, timeout=10)


def test_enospc_on_a_real_full_tmpfs_keeps_previous_checkpoint(tmp_path: Path) -> None:
    with real_tmpfs(tmp_path, "1m") as mnt:
        root = mnt / "ckpt"
        manager = CheckpointManager(root, keep=3)
        first = manager.save(1, *make_state(1))
        assert first.bytes < 200_000
        free_before = shutil.disk_usage(mnt).free
        big = {"big.weight": torch.randn(512, 1024)}  # 2 MiB of float32: cannot fit in 1 MiB
        with pytest.raises(CheckpointSaveError, match="no space left on device") as exc:
            manager.save(2, *make_state(2, extra_tensors=big))
        assert exc.value.errno == errno.ENOSPC
        assert_previous_intact(root, 1)
        assert shutil.disk_usage(mnt).free == free_before  # the partial checkpoint's space was given back


STRACE_PROBE = """\
import sys
from pathlib import Path
import torch
from daedalus_trainer.checkpoint import AdapterState, CheckpointManager, TrainerState, export_adapter
tensors = {"base_model.model.x.lora_A.weight": torch.ones(2, 4), "base_model.model.x.lora_B.weight": torch.ones(4, 2)}
info = CheckpointManager(sys.argv[1]).save(3, AdapterState(tensors, {"peft_type": "LORA", "r": 2}),
                                           {"state": {}, "param_groups": []}, TrainerState())
export_adapter(info, sys.argv[2])
"""


def strace_calls(text: str) -> list[tuple[str, str, int]]:
    """``(syscall, arguments, return value)`` of each completed call in ``strace -f -o`` output, in order; a call
    another thread interrupted (``<unfinished ...>`` then ``<... NAME resumed>``) is joined back into one."""
    import re

    pending: dict[str, str] = {}
    calls = []
    for line in text.splitlines():
        pid, _, rest = line.partition(" ")
        rest = rest.strip()
        if rest.endswith("<unfinished ...>"):
            pending[pid] = rest[:-len("<unfinished ...>")]
            continue
        resumed = re.match(r"<\.\.\. \w+ resumed>(.*)", rest)
        if resumed:
            rest = pending.pop(pid, "") + resumed.group(1)
        m = re.match(r"(\w+)\((.*)\)\s+=\s+(-?\d+)", rest)
        if m:
            calls.append((m.group(1), m.group(2), int(m.group(3))))
    return calls


def test_directories_a_save_creates_are_fsynced_into_their_parents(tmp_path: Path) -> None:
    """The first save into runs/job/checkpoints (none of the three exists) and the export into runs/job/exports,
    traced with strace in a child process: every directory they create has its parent opened (O_DIRECTORY) and
    fsynced after the mkdir, those outside the checkpoint before the rename that commits it, so a power loss after
    the commit cannot lose the entries leading to it. The checkpoint's own directories are flushed by the existing
    pass: adapter/ into the temporary directory before the rename, the renamed directory into the root after it."""
    import sys

    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace is not installed (apt-get install strace): the fsync calls cannot be observed")
    probe = subprocess.run([strace, "-f", "-o", os.devnull, "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"strace cannot trace here (ptrace not permitted?): {probe.stderr.strip()[:200]}")
    runs = tmp_path / "runs"
    root, export = runs / "job" / "checkpoints", runs / "job" / "exports" / "adapter"
    log_file = tmp_path / "strace.txt"
    out = subprocess.run([strace, "-f", "-s", "4096", "-o", str(log_file),
                          "-e", "trace=/^(fsync|openat|mkdir|mkdirat|rename|renameat|renameat2)$",
                          sys.executable, "-c", STRACE_PROBE, str(root), str(export)],
                         capture_output=True, text=True, timeout=300, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert verify_checkpoint(root / "step-000003") == [] and (export / "adapter_config.json").is_file()

    made: dict[str, int] = {}  # directory -> index of its mkdir
    fsynced: list[tuple[int, str]] = []  # (index, directory) of each fsync of an O_DIRECTORY descriptor
    renamed: dict[str, int] = {}  # rename target -> index
    fds: dict[int, str] = {}
    for i, (name, args, ret) in enumerate(strace_calls(log_file.read_text())):
        paths = args.split('"')[1::2]  # the quoted arguments: file names
        if name in ("mkdir", "mkdirat") and ret == 0:
            made[paths[0]] = i
        elif name == "openat" and ret >= 0:
            fds[ret] = paths[0] if "O_DIRECTORY" in args else ""
        elif name == "fsync" and fds.get(int(args)):
            fsynced.append((i, fds[int(args)]))
        elif name.startswith("rename") and ret == 0:
            renamed[paths[-1]] = i

    def fsync_of(directory: Path, after: int, before: float = float("inf")) -> bool:
        return any(after < i < before and d == str(directory) for i, d in fsynced)

    commit = renamed[str(root / "step-000003")]
    for directory in (runs, runs / "job", root):
        assert str(directory) in made, f"{directory} was not created by the save"
        assert fsync_of(directory.parent, made[str(directory)], commit), f"{directory.parent} not fsynced"
    exports = runs / "job" / "exports"
    assert fsync_of(exports.parent, made[str(exports)], renamed[str(export)]), f"{exports.parent} not fsynced"
    (tmp_dir,) = [d for d in made if Path(d).parent == root and Path(d).name.startswith(".tmp-step-000003-")]
    assert fsync_of(Path(tmp_dir), made[tmp_dir + "/adapter"], commit)  # adapter/ flushed into the temporary dir
    assert fsync_of(root, commit)  # the rename itself, into the root


def test_atomic_write_json_keeps_the_old_file_when_serialising_fails_half_way(tmp_path: Path) -> None:
    """A value that is not JSON fails after ``json.dump`` has started writing the temporary file: the old file is
    untouched and no temporary file is left (an in-place write would have truncated it when opening)."""
    path = tmp_path / "eval-before.json"
    atomic_write_json(path, {"start_fingerprint": "abc", "results": [1, 2]})
    before = path.read_bytes()
    assert json.loads(before) == {"start_fingerprint": "abc", "results": [1, 2]} and before.endswith(b"}\n")
    with pytest.raises(TypeError, match="not JSON serializable"):
        atomic_write_json(path, {"results": list(range(5000)), "zz": object()})  # keys in order: the list goes first
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval-before.json"]
    atomic_write_json(path, {"new": True})
    assert json.loads(path.read_text()) == {"new": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval-before.json"]


def test_atomic_write_text_on_a_real_full_tmpfs_keeps_the_old_file(tmp_path: Path) -> None:
    """ENOSPC from the real file system half-way through the write: the old content stays, the partial temporary
    file is removed and its space given back, and a leftover ``<name>.tmp`` of a killed writer does not get in the
    way of the next write."""
    with real_tmpfs(tmp_path, "64k") as mnt:
        path = mnt / "report.json"
        atomic_write_text(path, '{"steps": 6}\n')
        free_before = shutil.disk_usage(mnt).free
        with pytest.raises(OSError) as exc:
            atomic_write_text(path, "x" * (1 << 20))
        assert exc.value.errno == errno.ENOSPC
        assert path.read_text() == '{"steps": 6}\n'
        assert sorted(p.name for p in mnt.iterdir()) == ["report.json"]
        assert shutil.disk_usage(mnt).free == free_before
        (mnt / "report.json.tmp").write_text('{"ste')  # what a kill -9 mid-write leaves
        atomic_write_text(path, '{"steps": 7}\n')
        assert path.read_text() == '{"steps": 7}\n'
        assert sorted(p.name for p in mnt.iterdir()) == ["report.json"]


# --------------------------------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------------------------------


def test_export_adapter_copies_atomically_and_refuses_corrupt_source(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    infos = save_steps(CheckpointManager(root, keep=3), [1, 2])
    dest = tmp_path / "run" / "exports" / "adapter"
    assert export_adapter(infos[1], dest) == dest.absolute()
    assert sorted(p.name for p in dest.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert (dest / "adapter_model.safetensors").read_bytes() == (
        infos[1].adapter_dir / "adapter_model.safetensors").read_bytes()

    export_adapter(load_checkpoint(infos[2].path), dest)  # replaces the previous export
    assert (dest / "adapter_model.safetensors").read_bytes() == (
        infos[2].adapter_dir / "adapter_model.safetensors").read_bytes()
    assert sorted(p.name for p in dest.parent.iterdir()) == ["adapter"]

    weights = infos[1].adapter_dir / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\x00")
    before = (dest / "adapter_model.safetensors").read_bytes()
    with pytest.raises(CheckpointCorruptError, match="adapter_model.safetensors"):
        export_adapter(infos[1].path, dest)
    assert (dest / "adapter_model.safetensors").read_bytes() == before
    assert sorted(p.name for p in dest.parent.iterdir()) == ["adapter"]


_EXPORT_KILLED_BETWEEN_RENAMES = """
import os, signal, sys
from collections.abc import Iterator
from pathlib import Path
from daedalus_trainer.checkpoint import export_adapter

dest = Path(sys.argv[2]).absolute()
real_rename = os.rename

def rename(src, dst, *args, **kwargs):  # the OS call, then kill -9 right after the old export was moved aside
    real_rename(src, dst, *args, **kwargs)
    if Path(src) == dest:
        os.kill(os.getpid(), signal.SIGKILL)

os.rename = rename
export_adapter(sys.argv[1], dest)
print("not killed")
"""


def test_an_export_killed_between_its_renames_leaves_the_old_adapter_to_readers_and_the_next_export(
        tmp_path: Path) -> None:
    """export_adapter replaces an existing export by renaming it aside, then renaming the new copy in. A process
    killed (SIGKILL, in a child, right after the real first rename) between the two left no ``exports/adapter`` and
    nothing put it back. Now a reader (restore_interrupted_export, as evaluation.load_engine calls it) and the next
    export, even one that then fails, find the old adapter back in place, byte for byte; the next good export
    replaces it and removes the leftovers."""
    import signal
    import sys

    root = tmp_path / "ckpt"
    infos = save_steps(CheckpointManager(root, keep=3), [1, 2])
    exports = tmp_path / "run" / "exports"
    dest = exports / "adapter"
    export_adapter(infos[1], dest)
    first = {p.name: p.read_bytes() for p in dest.iterdir()}
    assert set(first) == {"adapter_config.json", "adapter_model.safetensors"}

    child = subprocess.run([sys.executable, "-c", _EXPORT_KILLED_BETWEEN_RENAMES, str(infos[2].path), str(dest)],
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, (child.returncode, child.stdout, child.stderr[-2000:])
    left = sorted(p.name for p in exports.iterdir())
    assert sorted(n.rsplit("-", 1)[0] for n in left) == [".tmp-adapter", ".trash-adapter"], left  # no "adapter"
    crashed = tmp_path / "crashed"
    shutil.copytree(exports, crashed, symlinks=True)

    def same_as_first(d: Path) -> bool:
        return {p.name: p.read_bytes() for p in d.iterdir()} == first

    # a reader
    assert restore_interrupted_export(dest) is True
    assert same_as_first(dest)
    assert restore_interrupted_export(dest) is False  # nothing left to do

    # the next export, one that fails on a corrupt source: the old adapter is back all the same
    shutil.rmtree(exports)
    shutil.copytree(crashed, exports, symlinks=True)
    bad = tmp_path / "bad-step"
    shutil.copytree(infos[2].path, bad)
    (bad / "adapter" / "adapter_model.safetensors").write_bytes(b"not the manifest's bytes")
    with pytest.raises(CheckpointCorruptError):
        export_adapter(bad, dest)
    assert same_as_first(dest)

    # the next good export: the new adapter, and no leftovers
    assert export_adapter(infos[2], dest) == dest.absolute()
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == {
        p.name: p.read_bytes() for p in infos[2].adapter_dir.iterdir()}
    assert sorted(p.name for p in exports.iterdir()) == ["adapter"]


def test_bad_arguments_are_rejected_before_writing(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "ckpt", keep=2)
    adapter, opt_state, state = make_state(1)
    with pytest.raises(ValueError, match="step must be an integer >= 0"):
        manager.save(-1, adapter, opt_state, state)
    with pytest.raises(TypeError, match="trainer_state must be a TrainerState"):
        manager.save(1, adapter, opt_state, {"step": 1})
    with pytest.raises(ValueError, match="non-empty mapping of torch.Tensor"):
        manager.save(1, AdapterState({"a": [1, 2]}, {}), opt_state, state)
    with pytest.raises(TypeError, match="not JSON serialisable"):
        manager.save(1, adapter, opt_state, TrainerState(extra={"obj": object()}))
    assert not (tmp_path / "ckpt").exists()


def test_packed_tensors_round_trip_bit_exactly_and_come_back_writable() -> None:
    """What the learner ships to the checkpoint writer: an AdamW state_dict and an adapter, packed as byte views and
    unpacked from read-only buffers (what ``ray.get`` returns) into equal, writable tensors of the same dtype."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 3))
    opt = torch.optim.AdamW([w], lr=1e-3)
    w.grad = torch.randn(4, 3)
    opt.step()
    state = {"adapter": {"a": torch.randn(2, 5), "b16": torch.randn(3, 2).to(torch.bfloat16),
                         "strided": torch.arange(12, dtype=torch.int64).reshape(3, 4).t(),
                         "empty": torch.zeros(0, 3)},  # "any shape": unpack had failed on no elements
             "optimizer": opt.state_dict(), "note": ("kept", 3)}
    packed = pack_tensors(state)
    leaf = packed["adapter"]["b16"]
    assert isinstance(leaf, PackedTensor) and leaf.dtype == "bfloat16" and leaf.shape == (3, 2)
    assert leaf.data.dtype == np.uint8 and leaf.data.nbytes == 3 * 2 * 2
    assert isinstance(packed["optimizer"]["state"][0]["step"], PackedTensor)  # 0-dim tensor
    for t in (leaf, packed["adapter"]["a"]):
        t.data.setflags(write=False)  # as mapped from Ray's object store
    back = unpack_tensors(packed)
    for k, v in state["adapter"].items():
        assert back["adapter"][k].dtype == v.dtype and torch.equal(back["adapter"][k], v)
        assert back["adapter"][k].shape == v.shape
    got, want = back["optimizer"], state["optimizer"]
    assert got["param_groups"] == want["param_groups"] and back["note"] == ("kept", 3)
    for k in ("step", "exp_avg", "exp_avg_sq"):
        assert torch.equal(got["state"][0][k], want["state"][0][k]) and got["state"][0][k].shape == want["state"][0][k].shape
    back["adapter"]["b16"].add_(1)  # writable, and no longer the sender's memory
    assert not torch.equal(back["adapter"]["b16"], state["adapter"]["b16"])
    opt.load_state_dict(got)  # what a resumed learner does with it
    opt.step()


def test_atomic_write_writes_through_a_symlink_and_a_fifo(tmp_path: Path) -> None:
    """``daedalus eval --json /dev/stdout`` and a link a user set up: the target gets the text, the link stays a
    link (a rename over it would have replaced it by a regular file), and no ``.tmp`` sibling is left."""
    import threading

    from daedalus_trainer.checkpoint import atomic_write_json, atomic_write_text

    target = tmp_path / "results" / "eval.json"
    target.parent.mkdir()
    target.write_text("old\n")
    link = tmp_path / "eval.json"
    link.symlink_to(target)
    atomic_write_json(link, {"success": 0.5})
    assert link.is_symlink() and json.loads(target.read_text()) == {"success": 0.5}
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()), daemon=True)
    reader.start()
    atomic_write_text(fifo, "through the pipe\n")
    reader.join(timeout=10)
    assert got == ["through the pipe\n"] and not fifo.is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.json", "pipe", "results"]


def test_identity_differences_names_each_differing_field_shared_by_both():
    """The comparison behind the GRPO and SFT resumes' refusal: each field both identities have and that differs,
    sorted, with both values (or the caller's wording); fields only one side has and a missing identity pass."""
    from daedalus_trainer.checkpoint import identity_differences

    saved = {"algorithm.seed": 0, "environment.size": 7, "start": [["model.safetensors", 1, 2]], "old.field": 1}
    now = {"algorithm.seed": 1, "environment.size": 7, "start": [["model.safetensors", 1, 3]], "new.field": 2}
    assert identity_differences(saved, now) == [
        "algorithm.seed: 0 there, 1 in this job",
        "start: [['model.safetensors', 1, 2]] there, [['model.safetensors', 1, 3]] in this job"]
    assert identity_differences(saved, now, {"start": "the start differs"}) == [
        "algorithm.seed: 0 there, 1 in this job", "the start differs"]
    assert identity_differences(saved, dict(saved, **{"new.field": 3})) == []
    assert identity_differences(None, now) == [] and identity_differences({}, now) == []


def test_error_reason_is_the_first_line_or_sentence_without_its_full_stop():
    """The one helper behind the one-line load errors of policy.py (first line) and sft.py (first sentence): a
    multi-line message keeps its first line, ``sentence`` cuts that line at its first ". ", the closing full stop
    goes, and an exception without a message is named by its type."""
    from daedalus_trainer.checkpoint import error_reason

    exc = ValueError("Unrecognized configuration class Foo. Use one of Bar.\nModel type should be one of X, Y.")
    assert error_reason(exc) == "Unrecognized configuration class Foo. Use one of Bar"
    assert error_reason(exc, sentence=True) == "Unrecognized configuration class Foo"
    assert error_reason(OSError("  Error no file named model.safetensors found in directory /m.  ")) == \
        "Error no file named model.safetensors found in directory /m"
    assert error_reason(EOFError()) == "EOFError" and error_reason(EOFError(""), sentence=True) == "EOFError"
