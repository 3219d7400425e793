"""The GRPO loop for real: tiny Qwen3-VL after a short SFT, real mazes, real local Ray actors, real checkpoints.

- a run interrupted (stop request -> checkpoint) and resumed equals an uninterrupted run bit for bit on CPU;
- a corrupt newest checkpoint makes resume fall back to the previous one, and the re-trained steps match again;
- a checkpoint or stop requested at a step with a held-out evaluation due is written before that evaluation, and a
  resume from it makes the evaluation up (history and adapter bytes equal to an uninterrupted run's);
- LoRA weights change and base weights do not.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from daedalus_trainer.checkpoint import CheckpointManager, load_latest
from daedalus_trainer.config import parse_job
from daedalus_trainer.grpo import Trainer, learning_rate_at
from daedalus_trainer.server import ControlState

from support.jobs import tiny_job_dict

pytestmark = pytest.mark.slow

TIMING_KEYS = {"rollout_seconds", "learner_seconds"}
#: Rollout workers of the runs whose point is not how work splits across workers: starting the actors is most of a
#: tiny run's time (about 12 s for the learner and 2 workers on 2 cores, 7 s with 1). The uninterrupted run, the
#: bit-identical resume and the fall-back compare with 2 (`daedalus run`'s default on CPU).
ONE_WORKER = 1


def _strip(history):
    return [{k: v for k, v in h.items() if k not in TIMING_KEYS} for h in history]


def _adapter(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(path) / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def uninterrupted(sft_start, local_ray, tmp_path_factory):
    # cosine: each step runs at its own rate, so the resume test below also checks that a resumed run continues the
    # schedule where it stopped
    job = parse_job(tiny_job_dict(algorithm={"lrSchedule": "cosine"}))
    run = tmp_path_factory.mktemp("full")
    result = Trainer(job, run, start_dir=str(sft_start), rollout_workers=2).train("latest")
    return job, run, result


def test_run_learns_something_real(uninterrupted, sft_start):
    job, run, result = uninterrupted
    assert result.steps_done == 6 and result.adapter_dir is not None
    updates = [h for h in result.history if not h["skipped_update"]]
    assert updates, "no GRPO update ran: every group had equal rewards"
    assert all(h["grad_norm"] > 0 for h in updates)
    # the learner ran step s at the cosine's rate for s (1-based): learningRate at step 1, then down towards 0
    rates = [h["learning_rate"] for h in result.history]
    assert rates == pytest.approx([learning_rate_at(job.spec.algorithm, s) for s in range(1, 7)], rel=1e-12)
    assert rates[0] == job.spec.algorithm.learning_rate and rates == sorted(rates, reverse=True)
    # LoRA B matrices start at zero (peft init): after real updates they are not.
    adapter = _adapter(result.adapter_dir)
    lora_b = [v for k, v in adapter.items() if "lora_B" in k]
    assert lora_b and any(float(v.abs().sum()) > 0 for v in lora_b)
    # The base weights are untouched: the exported adapter holds only LoRA tensors.
    assert all("lora_" in k for k in adapter)
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step-")) == [
        "step-000003", "step-000006"]
    # the rollout engine it used (the default, "auto", on a machine without a GPU) is in its checkpoints
    assert _trainer_state(run / "checkpoints" / "step-000006")["extra"]["rollout_engine"] == "transformers"
    assert load_latest(run / "checkpoints").trainer_state.extra["rollout_engine"] == "transformers"


def test_a_rerun_of_a_finished_run_without_a_final_evaluation_starts_no_actor(uninterrupted, sft_start, tmp_path):
    """Resumed at its last step with no final evaluation (``daedalus run``'s Trainer): the result a resume with no
    step left gives, a waiting checkpoint request answered by that checkpoint, the adapter exported again from it,
    and no actor in Ray's actor table. With the final
    evaluation (``daedalus train``'s) the actors are still needed."""
    import shutil

    import ray._private.state as ray_state

    job, run, full = uninterrupted
    shutil.copytree(run / "checkpoints", tmp_path / "checkpoints")
    assert Trainer(job, tmp_path, start_dir=str(sft_start)).nothing_to_train(
        CheckpointManager(tmp_path / "checkpoints", keep=3).resume("latest")) is False  # final_eval on
    actors_before = len(ray_state.actors())
    trainer = Trainer(job, tmp_path, start_dir=str(sft_start), final_eval=False)
    ticket = trainer.control.request_checkpoint()  # a POST /checkpoint waiting as the run starts
    result = trainer.train("latest")
    assert len(ray_state.actors()) == actors_before
    answer = trainer.control.wait(ticket, timeout=0)  # answered by the checkpoint resumed from
    assert answer is not None and answer.error is None and answer.step == 6
    assert (result.steps_done, result.resumed_from, result.stopped) == (6, 6, False)
    assert result.latest_checkpoint.step == 6 and result.history == full.history
    assert trainer.control.status()["phase"] == "finished" and trainer.control.status()["step"] == 6
    a, b = _adapter(full.adapter_dir), _adapter(result.adapter_dir)
    assert result.adapter_dir == tmp_path / "exports" / "adapter" and a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_stop_and_resume_is_bit_identical(uninterrupted, sft_start, tmp_path):
    job, _, full = uninterrupted
    first = Trainer(job, tmp_path, start_dir=str(sft_start), rollout_workers=2)

    def stop_after_step_two(rec):
        if rec["step"] == 2:
            threading.Thread(target=first.control.request_checkpoint, kwargs={"stop": True}, daemon=True).start()

    first.on_step = stop_after_step_two
    part1 = first.train("latest")
    assert part1.stopped and part1.adapter_dir is None
    # The stop request arrives during step 2 or 3; the loop checkpoints at that step boundary and stops.
    stopped_at = part1.steps_done
    assert stopped_at in (2, 3) and part1.latest_checkpoint.step == stopped_at

    part2 = Trainer(job, tmp_path, start_dir=str(sft_start), rollout_workers=2).train("latest")
    assert part2.resumed_from == stopped_at and part2.steps_done == 6
    assert _strip(part2.history) == _strip(full.history)
    a, b = _adapter(full.adapter_dir), _adapter(part2.adapter_dir)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_corrupt_latest_checkpoint_falls_back(uninterrupted, sft_start, tmp_path, caplog):
    job, run, full = uninterrupted
    import shutil

    shutil.copytree(run / "checkpoints", tmp_path / "checkpoints")
    newest = tmp_path / "checkpoints" / "step-000006" / "adapter" / "adapter_model.safetensors"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # flip one byte
    newest.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        result = Trainer(job, tmp_path, start_dir=str(sft_start), rollout_workers=2).train("latest")
    assert result.resumed_from == 3
    assert any("step-000006" in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    a, b = _adapter(full.adapter_dir), _adapter(result.adapter_dir)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_stop_before_a_resumed_run_starts_is_answered_by_its_checkpoint_without_an_actor(uninterrupted, sft_start,
                                                                                             tmp_path):
    """A stop (the operator's, before a node replacement) that reaches a resumed trainer before its actors start:
    no new save is needed, the caller gets the step it resumed from, not an error, and no actor is started to run
    no step (Ray's actor table is unchanged)."""
    import shutil

    import ray._private.state as ray_state

    job, run, _ = uninterrupted
    shutil.copytree(run / "checkpoints" / "step-000003", tmp_path / "checkpoints" / "step-000003")
    trainer = Trainer(job, tmp_path, start_dir=str(sft_start), rollout_workers=ONE_WORKER)
    ticket = trainer.control.request_checkpoint(stop=True)
    actors_before = len(ray_state.actors())
    result = trainer.train("latest")
    assert len(ray_state.actors()) == actors_before
    assert result.stopped and result.resumed_from == 3 and result.steps_done == 3 and result.adapter_dir is None
    assert result.latest_checkpoint.step == 3 and [h["step"] for h in result.history] == [1, 2, 3]
    answer = trainer.control.wait(ticket, timeout=0)
    assert answer is not None and answer.error is None and answer.step == 3
    assert answer.path.endswith("step-000003")
    assert trainer.control.status()["phase"] == "stopped" and trainer.control.status()["step"] == 3


def test_a_checkpoint_verified_by_the_caller_is_not_verified_again(uninterrupted, sft_start, tmp_path):
    """`daedalus train/run --resume PATH` read and verify the checkpoint before Ray starts and hand the Trainer the
    LoadedCheckpoint: it resumes from it without hashing the files a second time. Here the manifest on disk is made to
    list a missing file after the caller's verification, so a second verification would refuse the run; the same
    directory resumed by path is refused."""
    import json
    import shutil

    from daedalus_trainer.checkpoint import CheckpointCorruptError, resolve_resume

    job, run, _ = uninterrupted
    shutil.copytree(run / "checkpoints" / "step-000003", tmp_path / "checkpoints" / "step-000003")
    loaded = resolve_resume(str(tmp_path / "checkpoints" / "step-000003"), tmp_path / "checkpoints")
    manifest = tmp_path / "checkpoints" / "step-000003" / "MANIFEST.json"
    doc = json.loads(manifest.read_text())
    doc["files"].append({"path": "not-there.bin", "bytes": 1, "sha256": "0" * 64})
    manifest.write_text(json.dumps(doc))
    trainer = Trainer(job, tmp_path, start_dir=str(sft_start), rollout_workers=ONE_WORKER)
    trainer.control.request_checkpoint(stop=True)
    result = trainer.train(loaded)
    assert result.stopped and result.resumed_from == 3 and result.steps_done == 3
    with pytest.raises(CheckpointCorruptError, match="not-there.bin"):
        Trainer(job, tmp_path, start_dir=str(sft_start), rollout_workers=ONE_WORKER).train(str(loaded.path))


def test_resume_with_another_rollout_worker_count_warns_and_a_stop_then_is_answered_by_its_checkpoint(
        uninterrupted, sft_start, tmp_path, caplog):
    """The checkpoint's run had 2 rollout workers, this one 1: the mazes stay the same but the tokens do not (each
    worker samples its batch under its own seed), so the resume says it will not be bit-for-bit. A stop that comes
    in once the actors have started, before the first step: no new save, the caller gets the step resumed from."""
    import shutil

    job, run, _ = uninterrupted
    shutil.copytree(run / "checkpoints" / "step-000003", tmp_path / "checkpoints" / "step-000003")
    trainer = Trainer(job, tmp_path, start_dir=str(sft_start), rollout_workers=1)
    tickets = []
    # on_resume runs once the actors hold the checkpoint's state, before the first step
    trainer.on_resume = lambda step: tickets.append(trainer.control.request_checkpoint(stop=True))
    with caplog.at_level(logging.WARNING, logger="daedalus.grpo"):
        result = trainer.train("latest")
    assert result.stopped and result.resumed_from == 3 and result.steps_done == 3
    warned = [r.getMessage() for r in caplog.records if "rollout workers" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("resumed with 1 rollout workers where the checkpoint's run had 2")
    answer = trainer.control.wait(tickets[0], timeout=0)
    assert answer is not None and answer.error is None and answer.step == 3
    assert answer.path.endswith("step-000003")
    assert [p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step-")] == ["step-000003"]


def test_a_failing_loop_still_releases_its_actors(sft_start, local_ray, tmp_path, monkeypatch):
    """The step loop raises in its first step (here: the progress callback) while a POST /checkpoint over real HTTP
    waits for that step's checkpoint: the caller gets 409 with the reason as soon as train() gives up, not a 504 at
    its timeout; the actors are killed and their CPUs come back, so the same process can run another Trainer."""
    import concurrent.futures
    import time

    import ray
    import requests

    from daedalus_trainer.server import TOKEN_ENV, TrainerServer

    monkeypatch.setenv(TOKEN_ENV, "e2e-token")
    job = parse_job(tiny_job_dict(algorithm={"lrSchedule": "cosine"}))
    total = ray.cluster_resources()["CPU"]
    trainer = Trainer(job, tmp_path, start_dir=str(sft_start), rollout_workers=ONE_WORKER)

    def boom(rec):
        raise RuntimeError("progress display failed")

    trainer.on_step = boom
    with TrainerServer(trainer.metrics, trainer.control, host="127.0.0.1", port=0) as srv, \
            concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        waiting = pool.submit(requests.post, srv.url + "/checkpoint?timeout=120",
                              headers={"Authorization": "Bearer e2e-token"}, timeout=150)
        while not trainer.control.checkpoint_requested():
            assert not waiting.done(), waiting.result().text
            time.sleep(0.02)
        with pytest.raises(RuntimeError, match="progress display failed") as info:
            trainer.train("none")
        answer = waiting.result(timeout=30)
    assert answer.status_code == 409, answer.text
    assert answer.json()["error"] == ("trainer failed before the checkpoint was written: RuntimeError: progress "
                                      "display failed")
    assert trainer.control.status()["phase"] == "failed" and trainer.control.status()["step"] == 1
    # ``info`` keeps the traceback, and with it train()'s frame and its actor handles, alive (as any caller that
    # logs or re-raises the error does): Ray's out-of-scope clean-up cannot be what frees the CPUs
    assert info.tb is not None
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < total and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == total


def test_resume_refuses_a_checkpoint_of_another_lora_adapter(uninterrupted, sft_start, tmp_path):
    """lora.alpha changed between runs: the checkpoint's tensors would load silently under another scale. The
    resume (here from an explicit older PATH) is refused before any actor starts, naming the field, and every
    checkpoint stays where it was: a refused run abandons no timeline."""
    import shutil

    from daedalus_trainer.checkpoint import CheckpointError

    _, run, _ = uninterrupted
    shutil.copytree(run / "checkpoints", tmp_path / "checkpoints")
    job = parse_job(tiny_job_dict(algorithm={"lrSchedule": "cosine"}, lora={"alpha": 8}))
    with pytest.raises(CheckpointError, match=r"lora_alpha: checkpoint 32\.0, this run 8\.0"):
        Trainer(job, tmp_path, start_dir=str(sft_start), rollout_workers=2).train(
            str(tmp_path / "checkpoints" / "step-000003"))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(("step-", "abandoned"))
                  ) == ["step-000003", "step-000006"]


def test_resume_refuses_a_checkpoint_of_another_run_and_allows_more_steps(uninterrupted, sft_start, tmp_path):
    """A job created again under the same name with another seed finds the old run's checkpoints: refused before any
    actor starts, naming the field, nothing moved aside. Raising algorithm.steps (train on) is the same run; so is
    the same start copied with its modification times (shutil.copytree)."""
    import shutil

    from daedalus_trainer.checkpoint import CheckpointError
    from daedalus_trainer.grpo import check_same_run, run_identity

    job, run, _ = uninterrupted
    shutil.copytree(run / "checkpoints", tmp_path / "checkpoints")
    other = parse_job(tiny_job_dict(algorithm={"lrSchedule": "cosine", "seed": 1}))
    with pytest.raises(CheckpointError, match=r"other settings \(algorithm\.seed: 0 there, 1 in this job\)"):
        Trainer(other, tmp_path, start_dir=str(sft_start), rollout_workers=2).train("latest")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(("step-", "abandoned"))
                  ) == ["step-000003", "step-000006"]
    saved = load_latest(tmp_path / "checkpoints").trainer_state.extra["identity"]
    assert saved == run_identity(job, str(sft_start)) and saved["start"]  # the start's weight files are in it
    longer = parse_job(tiny_job_dict(algorithm={"lrSchedule": "cosine", "steps": 12}))
    check_same_run(saved, run_identity(longer, str(sft_start)), "here")
    shutil.copytree(sft_start, tmp_path / "start-copy")
    check_same_run(saved, run_identity(job, str(tmp_path / "start-copy")), "here")
    retrained = tmp_path / "start-retrained"
    shutil.copytree(sft_start, retrained)
    weights = next(f for f in sorted(retrained.iterdir()) if f.suffix == ".safetensors")
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1))  # saved again
    with pytest.raises(CheckpointError, match="the starting point's weights differ"):
        check_same_run(saved, run_identity(job, str(retrained)), "here")



class _Recorder(ControlState):
    """The real control state, recording ``(event, value)`` in call order: each phase the loop enters and the step of
    each checkpoint that answers requests. ``stop_at``: ask for a stop when the loop reports that step trained (what a
    ``POST /stop`` arriving while that step's update runs does: the loop sees it at that step's end).
    ``request_when_evaluating``: ask for a checkpoint as the first evaluation starts (its ticket in ``tickets``);
    ``stop_when_evaluating``: ask for a stop then."""

    def __init__(self, *, stop_at: int | None = None, request_when_evaluating: bool = False,
                 stop_when_evaluating: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.events: list[tuple[str, object, float]] = []
        self.stop_at = stop_at
        self.request_when_evaluating = request_when_evaluating or stop_when_evaluating
        self.stop_when_evaluating = stop_when_evaluating
        self.tickets: list[int] = []

    def set_status(self, **kwargs):
        super().set_status(**kwargs)
        if kwargs.get("phase") is not None:
            self.events.append(("phase", kwargs["phase"], time.monotonic()))
        if self.stop_at is not None and kwargs.get("step") == self.stop_at and "success_ratio" in kwargs:
            self.request_checkpoint(stop=True)
        if self.request_when_evaluating and kwargs.get("phase") == "evaluating" and not self.tickets:
            self.tickets.append(self.request_checkpoint(stop=self.stop_when_evaluating))

    def checkpoint_done(self, info, upto=None):
        super().checkpoint_done(info, upto)
        self.events.append(("answered", int(info.step), time.monotonic()))


def _answered_during_first_evaluation(control: _Recorder, step: int) -> None:
    """The first evaluation was followed by an answer with step ``step``'s checkpoint and then by training: the
    request was answered while the evaluation ran, not after it."""
    order = [(kind, value) for kind, value, _ in control.events]
    first_eval = order.index(("phase", "evaluating"))
    assert order[first_eval + 1:first_eval + 3] == [("answered", step), ("phase", "training")], order


def _trainer_state(checkpoint: Path) -> dict:
    return json.loads((Path(checkpoint) / "trainer_state.json").read_text())


def test_a_requested_checkpoint_is_answered_before_the_due_evaluation(sft_start, local_ray, tmp_path, monkeypatch):
    """A POST /checkpoint over real HTTP waits (the operator's, before a node replacement) while step 1 trains, and
    a held-out evaluation is due at step 1: the checkpoint is committed and the POST answered before the evaluation
    starts, then the evaluation runs. That checkpoint's history lacks the step's eval_success_ratio and records the
    evaluation as pending (a resume runs it); the run's own history has it. A second request, arriving during the
    evaluation, is answered at once by the same checkpoint (the learner has not changed), not by a second write."""
    import concurrent.futures

    import requests

    from daedalus_trainer.server import TOKEN_ENV, TrainerServer

    monkeypatch.setenv(TOKEN_ENV, "e2e-token")
    job = parse_job(tiny_job_dict(algorithm={"steps": 2, "evalIntervalSteps": 1}))
    control = _Recorder(total_steps=2, request_when_evaluating=True)
    trainer = Trainer(job, tmp_path, start_dir=str(sft_start), rollout_workers=ONE_WORKER, control=control,
                      final_eval=False)
    answered_at: list[float] = []

    def post():
        r = requests.post(srv.url + "/checkpoint?timeout=300", headers={"Authorization": "Bearer e2e-token"},
                          timeout=330)
        answered_at.append(time.monotonic())
        return r

    with TrainerServer(trainer.metrics, control, host="127.0.0.1", port=0) as srv, \
            concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        waiting = pool.submit(post)
        while not control.checkpoint_requested():
            assert not waiting.done(), waiting.result().text
            time.sleep(0.02)
        result = trainer.train("none")
        answer = waiting.result(timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.json()["step"] == 1 and answer.json()["path"].endswith("step-000001")
    order = [(kind, value) for kind, value, _ in control.events]
    first_eval = order.index(("phase", "evaluating"))
    assert order.index(("answered", 1)) < first_eval, order
    # the request made as the evaluation started is answered during it, by step 1's checkpoint; then training
    assert order[first_eval + 1:first_eval + 3] == [("answered", 1), ("phase", "training")], order
    eval_ended = control.events[first_eval + 1][2]
    assert answered_at[0] < eval_ended, "the POST was answered only after the evaluation"
    during_eval = control.wait(control.tickets[0], timeout=0)
    assert during_eval is not None and during_eval.error is None and during_eval.step == 1
    assert result.steps_done == 2 and 0.0 <= result.history[0]["eval_success_ratio"] <= 1.0
    state = _trainer_state(tmp_path / "checkpoints" / "step-000001")
    assert [h["step"] for h in state["metric_history"]] == [1]
    assert "eval_success_ratio" not in state["metric_history"][0]
    assert state["extra"]["eval_pending_step"] == 1


def test_a_requested_checkpoint_on_the_interval_is_written_again_with_the_evaluation(sft_start, local_ray, tmp_path):
    """A checkpoint request at step 1, which has a held-out evaluation due and is also on the checkpoint interval:
    the request is answered before the evaluation (by the step-1 checkpoint without the ratio), then step 1 is
    written again with the ratio, so a resume from it does not evaluate a second time (no pending marker)."""
    job = parse_job(tiny_job_dict(algorithm={"steps": 2, "evalIntervalSteps": 1}, checkpoint={"intervalSteps": 1}))
    control = _Recorder(total_steps=2)
    ticket = control.request_checkpoint()
    result = Trainer(job, tmp_path, start_dir=str(sft_start), rollout_workers=ONE_WORKER, control=control,
                     final_eval=False).train("none")
    order = [(kind, value) for kind, value, _ in control.events]
    assert order.index(("answered", 1)) < order.index(("phase", "evaluating")), order
    answer = control.wait(ticket, timeout=0)
    assert answer is not None and answer.error is None and answer.step == 1
    ratio = result.history[0]["eval_success_ratio"]
    assert 0.0 <= ratio <= 1.0
    state = _trainer_state(tmp_path / "checkpoints" / "step-000001")
    assert state["metric_history"][0]["eval_success_ratio"] == ratio
    assert "eval_pending_step" not in state["extra"]


@pytest.fixture(scope="module")
def evaluated_every_two(sft_start, local_ray, tmp_path_factory):
    """4 steps, a held-out evaluation after step 2 (not after step 4, the last: final_eval is off), checkpoints at 3
    and 4: uninterrupted."""
    job = parse_job(tiny_job_dict(algorithm={"steps": 4, "evalIntervalSteps": 2}))
    result = Trainer(job, tmp_path_factory.mktemp("eval2"), start_dir=str(sft_start), rollout_workers=ONE_WORKER,
                     final_eval=False).train("latest")
    return job, result


def test_a_stop_at_a_due_evaluation_checkpoints_first_and_resume_runs_it(evaluated_every_two, sft_start, tmp_path):
    """A stop (POST /stop: a suspend, a deletion, a node replacement) arrives while step 2 trains, and step 2 has a
    held-out evaluation due: the checkpoint is written and the loop stops without evaluating. The resumed run
    evaluates step 2's adapter first (greedy on fixed mazes: deterministic), so its per-step history, evaluation
    included, and its adapter bytes equal the uninterrupted run's."""
    job, full = evaluated_every_two
    assert 0.0 <= full.history[1]["eval_success_ratio"] <= 1.0
    assert all("eval_success_ratio" not in h for i, h in enumerate(full.history) if i != 1)
    control = _Recorder(total_steps=4, stop_at=2)
    part1 = Trainer(job, tmp_path, start_dir=str(sft_start), rollout_workers=ONE_WORKER, control=control,
                    final_eval=False).train("latest")
    assert part1.stopped and part1.steps_done == 2 and part1.latest_checkpoint.step == 2
    assert ("phase", "evaluating") not in [(kind, value) for kind, value, _ in control.events]
    assert "eval_success_ratio" not in part1.history[-1]
    state = _trainer_state(tmp_path / "checkpoints" / "step-000002")
    assert "eval_success_ratio" not in state["metric_history"][-1] and state["extra"]["eval_pending_step"] == 2

    # A checkpoint request waiting as the run resumes is answered by the checkpoint resumed from, before the
    # evaluation that resume runs.
    resumed = _Recorder(total_steps=4)
    ticket = resumed.request_checkpoint()
    part2 = Trainer(job, tmp_path, start_dir=str(sft_start), rollout_workers=ONE_WORKER, control=resumed,
                    final_eval=False).train("latest")
    assert part2.resumed_from == 2 and part2.steps_done == 4
    order = [(kind, value) for kind, value, _ in resumed.events]
    assert order[:4] == [("phase", "starting"), ("answered", 2), ("phase", "evaluating"), ("phase", "training")], \
        order  # then step 3
    answer = resumed.wait(ticket, timeout=0)
    assert answer is not None and answer.step == 2 and answer.path.endswith("step-000002")
    assert _strip(part2.history) == _strip(full.history)
    a, b = _adapter(full.adapter_dir), _adapter(part2.adapter_dir)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # the later checkpoints carry the filled-in record and nothing pending
    state = _trainer_state(tmp_path / "checkpoints" / "step-000004")
    assert _strip(state["metric_history"]) == _strip(full.history) and "eval_pending_step" not in state["extra"]


def test_a_checkpoint_requested_during_the_evaluation_is_answered_before_it_ends(sft_start, local_ray, tmp_path):
    """A checkpoint request (a HyperPod reboot's, bounded by checkpointTimeoutSeconds) arrives as step 1's held-out
    evaluation starts, with none before it: step 1's checkpoint is written and the request answered while the rollout
    workers evaluate, not after; that checkpoint records the evaluation as pending, and the run's own history has
    its ratio."""
    job = parse_job(tiny_job_dict(algorithm={"steps": 2, "evalIntervalSteps": 1}))
    control = _Recorder(total_steps=2, request_when_evaluating=True)
    result = Trainer(job, tmp_path, start_dir=str(sft_start), rollout_workers=ONE_WORKER, control=control,
                     final_eval=False).train("none")
    _answered_during_first_evaluation(control, 1)
    answer = control.wait(control.tickets[0], timeout=0)
    assert answer is not None and answer.error is None and answer.step == 1
    assert result.steps_done == 2 and 0.0 <= result.history[0]["eval_success_ratio"] <= 1.0
    state = _trainer_state(tmp_path / "checkpoints" / "step-000001")
    assert "eval_success_ratio" not in state["metric_history"][0] and state["extra"]["eval_pending_step"] == 1


def test_a_stop_during_the_evaluation_abandons_it_and_resume_runs_it(evaluated_every_two, sft_start, tmp_path):
    """A stop arriving as step 2's held-out evaluation starts: step 2 is checkpointed and the stop answered during
    the evaluation, which is abandoned (the run stops without its ratio). The resumed run evaluates step 2 first, so
    its history, evaluation included, and its adapter bytes equal the uninterrupted run's."""
    job, full = evaluated_every_two
    control = _Recorder(total_steps=4, stop_when_evaluating=True)
    part1 = Trainer(job, tmp_path, start_dir=str(sft_start), rollout_workers=ONE_WORKER, control=control,
                    final_eval=False).train("latest")
    assert part1.stopped and part1.steps_done == 2 and part1.latest_checkpoint.step == 2
    _answered_during_first_evaluation(control, 2)
    assert "eval_success_ratio" not in part1.history[-1]
    answer = control.wait(control.tickets[0], timeout=0)
    assert answer is not None and answer.error is None and answer.step == 2
    state = _trainer_state(tmp_path / "checkpoints" / "step-000002")
    assert state["extra"]["eval_pending_step"] == 2

    part2 = Trainer(job, tmp_path, start_dir=str(sft_start), rollout_workers=ONE_WORKER,
                    final_eval=False).train("latest")
    assert part2.resumed_from == 2 and part2.steps_done == 4
    assert _strip(part2.history) == _strip(full.history)
    a, b = _adapter(full.adapter_dir), _adapter(part2.adapter_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_stop_during_the_final_evaluation_is_answered_at_once_and_a_resume_evaluates(sft_start, local_ray,
                                                                                        tmp_path):
    """A stop arriving as the final held-out evaluation starts (after the last step's checkpoint): answered at once
    with that checkpoint, the evaluation abandoned, the adapter still exported. A run resumed from there (at the last
    step: no training left) makes the final evaluation up."""
    job = parse_job(tiny_job_dict(algorithm={"steps": 1}))
    control = _Recorder(total_steps=1, stop_when_evaluating=True)
    trainer = Trainer(job, tmp_path, start_dir=str(sft_start), rollout_workers=ONE_WORKER, control=control)
    result = trainer.train("none")
    _answered_during_first_evaluation(control, 1)
    answer = control.wait(control.tickets[0], timeout=0)
    assert answer is not None and answer.error is None and answer.step == 1
    assert trainer.final_eval_success is None and result.steps_done == 1
    assert (Path(result.adapter_dir) / "adapter_model.safetensors").is_file()

    again = Trainer(job, tmp_path, start_dir=str(sft_start), rollout_workers=ONE_WORKER)
    resumed = again.train("latest")
    assert resumed.resumed_from == 1 and resumed.steps_done == 1
    assert again.final_eval_success is not None and 0.0 <= again.final_eval_success <= 1.0
