"""The trainer's HTTP endpoint over real HTTP on a loopback port, with the real metrics registry and real checkpoints.

A background thread plays the training loop: it polls ``ControlState`` at "step boundaries" and writes a real
checkpoint with ``CheckpointManager`` when asked.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import math
import threading
import time
from pathlib import Path

import pytest
import requests
import torch
from prometheus_client.parser import text_string_to_metric_families

from daedalus_trainer.checkpoint import AdapterState, CheckpointManager, TrainerState, load_latest
from daedalus_trainer.metrics import METRICS, StepStats, TrainerMetrics, markdown_table
from daedalus_trainer.server import (
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    ControlState,
    TrainerServer,
    load_control_token,
)

TOKEN = "s3cret-token-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def token_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The operator mounts the control token as a Secret file; the server reads it through the environment."""
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.setenv(TOKEN_FILE_ENV, str(path))
    return path


@pytest.fixture
def metrics() -> TrainerMetrics:
    return TrainerMetrics("maze-run", "team-a", total_steps=50, checkpoint_interval=10)


@pytest.fixture
def control() -> ControlState:
    return ControlState(total_steps=50, attempt=2)


@pytest.fixture
def server(metrics: TrainerMetrics, control: ControlState, token_file: Path):
    with TrainerServer(metrics, control, host="127.0.0.1", port=0) as srv:
        yield srv


def stats(step: int, **over) -> StepStats:
    base = dict(step=step, success_ratio=0.25, reward_mean=0.25, episode_turns=7.5, rollout_tokens=120,
                zero_variance_groups=3, rollout_seconds=2.0, learner_seconds=0.5, kl=0.01, loss=-0.2, grad_norm=1.5)
    return StepStats(**(base | over))


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def save_real_checkpoint(root: Path, step: int):
    g = torch.Generator().manual_seed(step)
    param = torch.nn.Parameter(torch.randn(4, 8, generator=g))
    opt = torch.optim.AdamW([param], lr=1e-3)
    param.sum().backward()
    opt.step()
    adapter = AdapterState({"base_model.model.q_proj.lora_A.weight": param.detach()}, {"peft_type": "LORA", "r": 4})
    return CheckpointManager(root, keep=2).save(step, adapter, opt.state_dict(), TrainerState(sampler={"i": step}))


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


# --------------------------------------------------------------------------------------------------------------------
# /metrics, /healthz, /status
# --------------------------------------------------------------------------------------------------------------------


def test_metrics_endpoint_exposes_every_metric_in_the_table(server: TrainerServer, metrics: TrainerMetrics,
                                                            tmp_path: Path) -> None:
    metrics.observe_step(stats(1))
    metrics.observe_step(stats(2, rollout_tokens=80, zero_variance_groups=1, kl=None))
    metrics.observe_eval(0.625)
    info = save_real_checkpoint(tmp_path / "ckpt", 2)
    metrics.observe_checkpoint(info)

    resp = requests.get(server.url + "/metrics", timeout=5)
    assert resp.status_code == 200 and resp.headers["Content-Type"].startswith("text/plain")
    fams = families(resp.text)
    samples = {}
    for fam in fams.values():
        for s in fam.samples:
            assert s.labels["job"] == "maze-run" and s.labels["namespace"] == "team-a", s
            if "le" not in s.labels:
                samples[s.name] = s.value
    for spec in METRICS:
        sample = {"histogram": spec.name + "_count"}.get(spec.type, spec.name)
        assert sample in samples, f"{spec.name} missing from /metrics"
        family = spec.name.removesuffix("_total") if spec.type == "counter" else spec.name
        assert fams[family].type == spec.type and fams[family].documentation == spec.help
    assert samples["daedalus_train_step"] == 2
    assert samples["daedalus_train_total_steps"] == 50
    assert samples["daedalus_checkpoint_interval_steps"] == 10
    assert samples["daedalus_rollout_tokens_total"] == 200
    assert samples["daedalus_train_zero_variance_groups_total"] == 4
    assert samples["daedalus_train_kl"] == 0.01  # None (no update) keeps the last value
    assert samples["daedalus_eval_success_ratio"] == 0.625
    assert samples["daedalus_checkpoint_last_step"] == 2
    assert samples["daedalus_checkpoint_bytes"] == info.bytes > 0
    assert samples["daedalus_checkpoint_last_timestamp_seconds"] == pytest.approx(info.time)
    assert samples["daedalus_rollout_seconds_count"] == 2 and samples["daedalus_rollout_seconds_sum"] == 4.0
    assert samples["daedalus_checkpoint_save_seconds_count"] == 1
    assert samples["daedalus_checkpoint_save_seconds_sum"] == pytest.approx(info.seconds)

    # The README table lists the same names.
    table = markdown_table()
    assert all(f"`{spec.name}`" in table for spec in METRICS)

    # OpenMetrics negotiation works as Prometheus asks for it.
    om = requests.get(server.url + "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"},
                      timeout=5)
    assert om.headers["Content-Type"].startswith("application/openmetrics-text") and om.text.endswith("# EOF\n")


def test_fresh_process_exports_no_placeholder_values(metrics: TrainerMetrics) -> None:
    fams = families(metrics.render().decode())
    assert {f.name for f in fams.values()} >= {s.name.removesuffix("_total") for s in METRICS}
    with_samples = {s.name: s.value for f in fams.values() for s in f.samples if "le" not in s.labels}
    assert with_samples["daedalus_train_step"] == 0 and with_samples["daedalus_rollout_tokens_total"] == 0
    assert with_samples["daedalus_train_total_steps"] == 50
    for absent in ("daedalus_train_success_ratio", "daedalus_train_kl", "daedalus_eval_success_ratio",
                   "daedalus_checkpoint_last_step"):
        assert absent not in with_samples  # no 0/NaN placeholder that alert rules would read


def test_steps_per_hour_over_wall_clock_window() -> None:
    clock = FakeClock()
    m = TrainerMetrics("j", "ns", clock=clock)
    m.observe_step(stats(1, rollout_seconds=3.0, learner_seconds=1.0))
    value = lambda: m.registry.get_sample_value("daedalus_train_steps_per_hour", {"job": "j", "namespace": "ns"})
    assert value() == pytest.approx(900.0)  # first step: 3600 / 4 s
    for step in (2, 3, 4, 5):
        clock.now += 6.0  # checkpoints and evaluation count: 6 s of wall clock per step
        m.observe_step(stats(step, rollout_seconds=3.0, learner_seconds=1.0))
    assert value() == pytest.approx(600.0)
    clock.now += 6.0
    m.observe_step(stats(3))  # steps went back (resume): window restarts, per-step estimate 3600 / (2 + 0.5) s
    assert value() == pytest.approx(1440.0)


def test_step_stats_and_metric_inputs_are_validated() -> None:
    with pytest.raises(ValueError, match="success_ratio must be in"):
        stats(1, success_ratio=1.5)
    with pytest.raises(ValueError, match="rollout_tokens must be >= 0"):
        stats(1, rollout_tokens=-1)
    with pytest.raises(ValueError, match="reward_mean must be finite"):
        stats(1, reward_mean=math.nan)
    m = TrainerMetrics("j", "ns")
    with pytest.raises(ValueError, match=r"success_ratio must be in \[0, 1\]"):
        m.observe_eval(2.0)
    with pytest.raises(ValueError, match="job and namespace must be non-empty"):
        TrainerMetrics("", "ns")


def test_healthz_status_and_unknown_routes(server: TrainerServer, control: ControlState, tmp_path: Path) -> None:
    r = requests.get(server.url + "/healthz", timeout=5)
    assert r.status_code == 200 and r.text == "ok\n"

    doc = requests.get(server.url + "/status", timeout=5).json()
    assert doc == {"step": 0, "totalSteps": 50, "phase": "starting", "latestCheckpoint": None,
                   "successRatio": None, "rewardMean": None, "adapterPath": None, "attempt": 2, "resumedFrom": None,
                   "failureReason": None, "checkpointRequested": False, "stopRequested": False}

    info = save_real_checkpoint(tmp_path / "ckpt", 30)
    control.set_status(step=31, phase="training", success_ratio=0.75, reward_mean=0.75,
                       adapter_path=info.adapter_dir)
    control.checkpoint_done(info)
    doc = requests.get(server.url + "/status", timeout=5).json()
    assert doc["step"] == 31 and doc["phase"] == "training" and doc["successRatio"] == 0.75
    assert doc["adapterPath"] == str(info.adapter_dir)
    assert doc["latestCheckpoint"]["step"] == 30 and doc["latestCheckpoint"]["path"] == str(info.path)
    assert doc["latestCheckpoint"]["time"] == time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(info.time))

    with pytest.raises(ValueError, match="phase must be one of"):
        control.set_status(phase="running")
    assert requests.get(server.url + "/nope", timeout=5).status_code == 404
    assert requests.get(server.url + "/checkpoint", timeout=5).status_code == 405
    assert requests.post(server.url + "/metrics", timeout=5).status_code == 405


def documented_status_fields(doc: str) -> dict[str, set[str]]:
    """The fields the ``GET /status`` route's docstring lists (``JSON ``{a, b {c, d}, e}``...``): each top-level name
    mapped to the names listed in braces after it (empty for a plain field)."""
    head = "``GET /status``: JSON ``{"
    assert head in doc, "the GET /status route is not documented"
    text = doc[doc.index(head) + len(head):]
    fields: dict[str, set[str]] = {}
    depth, token, last = 0, "", ""
    for ch in text:
        if ch in "{},":
            name = " ".join(token.split())
            if name and depth == 0:
                fields[name] = set()
                last = name
            elif name:
                fields[last].add(name)
            token = ""
            if ch == "{":
                depth += 1
            elif ch == "}":
                if depth == 0:
                    return fields
                depth -= 1
        else:
            token += ch
    raise AssertionError("unbalanced braces in the GET /status field list")


def test_the_status_docstring_lists_every_field_served(server: TrainerServer, control: ControlState,
                                                       tmp_path: Path) -> None:
    """Compare the field list in the module docstring with what a real server answers, on a fresh trainer and on one
    that resumed and has a checkpoint (then ``latestCheckpoint``'s own fields count too)."""
    from daedalus_trainer import server as server_module

    documented = documented_status_fields(server_module.__doc__)
    served = requests.get(server.url + "/status", timeout=5).json()
    assert set(served) == set(documented), (sorted(set(served) - set(documented)),
                                            sorted(set(documented) - set(served)))
    info = save_real_checkpoint(tmp_path / "ckpt", 4)
    control.set_status(step=4, phase="training", latest_checkpoint=info, resumed_from=4)
    served = requests.get(server.url + "/status", timeout=5).json()
    assert served["resumedFrom"] == 4
    nested = {k: set(v) for k, v in served.items() if isinstance(v, dict)}
    assert nested == {k: v for k, v in documented.items() if v} == {"latestCheckpoint": {"step", "path", "time"}}


# --------------------------------------------------------------------------------------------------------------------
# POST /checkpoint and /stop
# --------------------------------------------------------------------------------------------------------------------


def test_checkpoint_requires_the_bearer_token(server: TrainerServer, control: ControlState) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"},
                    {"Authorization": f"Bearer {TOKEN}x"}):
        for route in ("/checkpoint", "/stop"):
            r = requests.post(server.url + route, headers=headers, timeout=5)
            assert r.status_code == 401, (route, headers)
            assert r.headers["WWW-Authenticate"].startswith("Bearer")
    assert not control.checkpoint_requested() and not control.stop_requested()


def test_unauthenticated_body_is_never_awaited(server: TrainerServer, control: ControlState) -> None:
    """A caller without the token that announces a body and never sends it gets its 401 at once and the connection
    closes: it cannot park a handler thread on the body."""
    import socket

    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"POST /checkpoint HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\n")
        sock.settimeout(3)
        data = b""
        while chunk := sock.recv(4096):  # the server closes: recv returns b"" (a timeout raises instead)
            data += chunk
    assert data.startswith(b"HTTP/1.1 401") and b"Connection: close" in data
    assert not control.checkpoint_requested()


def test_no_token_configured_is_503(metrics, control, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    with TrainerServer(metrics, control, host="127.0.0.1", port=0) as srv:
        r = requests.post(srv.url + "/checkpoint", headers=AUTH, timeout=5)
    assert r.status_code == 503 and TOKEN_ENV in r.json()["error"]
    assert not control.checkpoint_requested()


def play_training_loop(control: ControlState, root: Path, start_step: int, stop_event: threading.Event,
                       log: list) -> None:
    """What the GRPO loop does at every step boundary (the docstring of ControlState)."""
    step = start_step
    control.set_status(phase="training", step=step)
    while not stop_event.is_set():
        time.sleep(0.02)  # one "training step"
        step += 1
        control.set_status(step=step)
        if control.checkpoint_requested():
            control.set_status(phase="checkpointing")
            info = save_real_checkpoint(root, step)
            log.append(("saved", step, time.monotonic()))
            control.checkpoint_done(info)
            if control.stop_requested():
                control.set_status(phase="stopped")
                return
            control.set_status(phase="training")


@pytest.fixture
def loop(control: ControlState, tmp_path: Path):
    stop_event = threading.Event()
    log: list = []
    root = tmp_path / "ckpt"

    def start(delay: float = 0.0, start_step: int = 10) -> threading.Thread:
        def run() -> None:
            time.sleep(delay)
            play_training_loop(control, root, start_step, stop_event, log)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        threads.append(t)
        return t

    threads: list[threading.Thread] = []
    yield start, log, root
    stop_event.set()
    for t in threads:
        t.join(timeout=5)


def test_checkpoint_blocks_until_the_loop_writes_it(server: TrainerServer, control: ControlState, loop) -> None:
    start, log, root = loop
    start(delay=0.5)  # the loop reaches a step boundary only after 0.5 s
    t0 = time.monotonic()
    r = requests.post(server.url + "/checkpoint?timeout=20", headers=AUTH, timeout=30)
    t1 = time.monotonic()
    assert r.status_code == 200, r.text
    body = r.json()
    assert [entry[0] for entry in log] == ["saved"]
    saved_step, saved_at = log[0][1], log[0][2]
    assert body["step"] == saved_step and body["stopping"] is False
    assert t1 - t0 >= 0.5 and t1 >= saved_at  # it waited for the write, not just for the request to be seen
    loaded = load_latest(root)
    assert loaded is not None and loaded.step == saved_step and body["path"] == str(loaded.path)
    assert not control.checkpoint_requested()
    assert control.status()["latestCheckpoint"]["step"] == saved_step


def test_concurrent_requests_share_one_checkpoint(server: TrainerServer, loop) -> None:
    start, log, _ = loop
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(requests.post, server.url + "/checkpoint?timeout=20", headers=AUTH, timeout=30)
                   for _ in range(3)]
        time.sleep(0.3)  # all three are waiting before the loop starts
        start()
        bodies = [f.result().json() for f in futures]
    assert len(log) == 1 and {b["step"] for b in bodies} == {log[0][1]}


def test_stop_checkpoints_and_ends_the_loop(server: TrainerServer, control: ControlState, loop) -> None:
    start, log, root = loop
    thread = start()
    r = requests.post(server.url + "/stop", headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json()["stopping"] is True
    thread.join(timeout=5)
    assert not thread.is_alive() and control.status()["phase"] == "stopped"
    assert load_latest(root).step == r.json()["step"]
    late = requests.post(server.url + "/checkpoint", headers=AUTH, timeout=5)
    assert late.status_code == 409 and late.json()["latestCheckpoint"]["step"] == r.json()["step"]


def test_timeout_answers_504_and_the_request_stays_pending(server: TrainerServer, control: ControlState,
                                                           loop) -> None:
    start, log, _ = loop
    r = requests.post(server.url + "/checkpoint?timeout=0.3", headers=AUTH, timeout=10)
    assert r.status_code == 504 and r.json()["requested"] is True
    assert control.checkpoint_requested()
    start()
    deadline = time.monotonic() + 10
    while not log and time.monotonic() < deadline:
        time.sleep(0.02)
    assert log and not control.checkpoint_requested()  # honoured at the next step boundary anyway

    r = requests.post(server.url + "/checkpoint?timeout=0", headers=AUTH, timeout=5)
    assert r.status_code == 202 and r.json() == {"requested": True, "stopping": False}
    for bad in ("abc", "-1", "99999"):
        assert requests.post(server.url + f"/checkpoint?timeout={bad}", headers=AUTH, timeout=5).status_code == 400


def test_a_request_during_an_older_save_is_answered_by_the_next_one(control: ControlState) -> None:
    """Saves are asynchronous: step 10's interval save is queued (it covers the requests so far), then the operator
    asks for a checkpoint (or a stop) while it is being written. Step 10's commit must not answer that request, whose
    state is newer; the flag stays up so the loop saves step 11, and that answers it. A failed older write likewise
    leaves the newer request pending instead of answering it with 500."""
    from types import SimpleNamespace

    first = control.request_checkpoint()
    covers = control.request_seq()  # what the step-10 save covers, read when it is queued
    later = control.request_checkpoint(stop=True)
    control.checkpoint_done(SimpleNamespace(step=10, path="/c/step-000010", time=1.0e9), upto=covers)
    assert control.wait(first, timeout=0.1).step == 10
    assert control.wait(later, timeout=0.1) is None  # still pending
    assert control.checkpoint_requested() and control.stop_requested() and control.unanswered()
    assert control.status()["latestCheckpoint"]["step"] == 10
    control.checkpoint_failed("older write failed", upto=covers)  # a failure of an older write: not this request's
    assert control.wait(later, timeout=0.1) is None and control.checkpoint_requested()
    control.checkpoint_done(SimpleNamespace(step=11, path="/c/step-000011", time=1.0e9 + 5),
                            upto=control.request_seq())
    assert control.wait(later, timeout=0.1).step == 11
    # answered: nothing left for an evaluation in progress to answer, though the stop's flag stays up
    assert not control.unanswered() and control.checkpoint_requested()
    third = control.request_checkpoint()
    assert control.unanswered()
    control.checkpoint_failed("disk full", upto=control.request_seq())
    assert control.wait(third, timeout=0.1).error == "disk full"
    assert control.status()["checkpointRequested"] and control.stop_requested()  # the stop still stands


def test_failed_save_and_terminal_phase_answer_waiters(server: TrainerServer, control: ControlState) -> None:
    def fail_when_asked(message: str | None, phase: str | None) -> None:
        while not control.checkpoint_requested():
            time.sleep(0.01)
        if message:
            control.checkpoint_failed(message)
        else:
            control.set_status(phase=phase)

    t = threading.Thread(target=fail_when_asked, args=("no space left on device", None))
    t.start()
    r = requests.post(server.url + "/checkpoint?timeout=20", headers=AUTH, timeout=30)
    t.join()
    assert r.status_code == 500 and "no space left" in r.json()["error"]
    assert not control.checkpoint_requested()

    t = threading.Thread(target=fail_when_asked, args=(None, "failed"))
    t.start()
    r = requests.post(server.url + "/checkpoint?timeout=20", headers=AUTH, timeout=30)
    t.join()
    assert r.status_code == 409 and "failed" in r.json()["error"]


def test_a_trainer_that_fails_answers_a_waiting_checkpoint_request_409_with_the_reason(tmp_path: Path,
                                                                                        token_file: Path) -> None:
    """A real Trainer (tiny model) behind a real TrainerServer: a POST /checkpoint is waiting when train() raises
    (asked to resume from a checkpoint whose optimizer state was overwritten). The caller gets 409 naming the
    failure at once, not a 504 at its timeout; /status says failed and why; a later POST /stop gets 409 too."""
    from daedalus_trainer.checkpoint import CheckpointCorruptError
    from daedalus_trainer.config import parse_job
    from daedalus_trainer.grpo import Trainer

    from support.jobs import tiny_job_dict

    bad = save_real_checkpoint(tmp_path / "elsewhere", 4).path
    (bad / "optimizer.pt").write_bytes(b"not the optimizer state the manifest lists")
    trainer = Trainer(parse_job(tiny_job_dict()), tmp_path / "run", work_dir=tmp_path / "work")
    with TrainerServer(trainer.metrics, trainer.control, host="127.0.0.1", port=0) as srv, \
            concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        waiting = pool.submit(requests.post, srv.url + "/checkpoint?timeout=60", headers=AUTH, timeout=90)
        deadline = time.monotonic() + 30
        while not requests.get(srv.url + "/status", timeout=5).json()["checkpointRequested"]:
            assert time.monotonic() < deadline, "the checkpoint request never arrived"
            time.sleep(0.02)
        started = time.monotonic()
        with pytest.raises(CheckpointCorruptError) as info:
            trainer.train(str(bad))
        answer = waiting.result(timeout=90)
        waited = time.monotonic() - started
        status = requests.get(srv.url + "/status", timeout=5).json()
        stop = requests.post(srv.url + "/stop?timeout=5", headers=AUTH, timeout=30)
    reason = status["failureReason"]
    first_line = str(info.value).splitlines()[0]
    assert first_line.startswith(f"checkpoint {bad} failed verification: optimizer.pt: size mismatch")
    assert reason == f"CheckpointCorruptError: {first_line}"
    assert status["phase"] == "failed" and not status["checkpointRequested"]
    assert answer.status_code == 409, answer.text
    assert answer.json() == {"error": f"trainer failed before the checkpoint was written: {reason}",
                             "stopping": False}
    assert waited < 30, f"answered only after {waited:.1f} s"
    assert stop.status_code == 409 and stop.json()["error"] == f"trainer already failed: {reason}"


def test_failure_reason_goes_with_the_failed_phase_only(control: ControlState) -> None:
    control.set_status(phase="failed", failure_reason="RuntimeError: boom")
    assert control.status()["failureReason"] == "RuntimeError: boom"
    with pytest.raises(ValueError, match="failure_reason goes with phase='failed'"):
        control.set_status(phase="training", failure_reason="RuntimeError: boom")
    control.set_status(phase="starting")  # a new attempt on the same state starts without the old reason
    assert control.status()["failureReason"] is None and control.status()["phase"] == "starting"


def test_load_control_token_sources(tmp_path: Path, caplog) -> None:
    f = tmp_path / "tok"
    f.write_text("  from-file\n")
    assert load_control_token({TOKEN_ENV: "from-env", TOKEN_FILE_ENV: str(f)}) == "from-env"
    assert load_control_token({TOKEN_ENV: "", TOKEN_FILE_ENV: str(f)}) == "from-file"
    assert load_control_token({}) is None
    f.write_text("\n")
    assert load_control_token({TOKEN_FILE_ENV: str(f)}) is None
    with caplog.at_level(logging.WARNING, logger="daedalus_trainer.server"):
        assert load_control_token({TOKEN_FILE_ENV: str(tmp_path / "absent")}) is None
    assert any("unreadable" in r.getMessage() for r in caplog.records)


def test_rotated_token_file_takes_effect_without_restart(server: TrainerServer, token_file: Path, loop) -> None:
    start, _, _ = loop
    start()
    token_file.write_text("rotated\n")
    assert requests.post(server.url + "/checkpoint?timeout=0", headers=AUTH, timeout=5).status_code == 401
    r = requests.post(server.url + "/checkpoint?timeout=20", headers={"Authorization": "Bearer rotated"}, timeout=30)
    assert r.status_code == 200 and json.loads(r.text)["step"] > 0


def _raised(exc: BaseException) -> tuple[BaseException, str]:
    """``exc`` raised and caught, with its formatted traceback (what Ray ships from the actor's process)."""
    import traceback

    try:
        raise exc
    except BaseException as caught:  # noqa: BLE001 - any exception, as an actor would ship it
        return caught, traceback.format_exc()


def test_failure_reason_describes_what_an_actor_raised_not_rays_wrapper() -> None:
    """Ray wraps an actor method's exception in ``RayTaskError(<Type>)`` whose first line is Ray's header (process
    title, pid, ip), and an ``__init__``'s in ``ActorDiedError``: ``failureReason`` names the actor's exception and
    its message. The wrappers are Ray's own classes, built as ``ray.get`` builds them."""
    import ray.exceptions

    from daedalus_trainer.actors import RolloutEngineUnavailable
    from daedalus_trainer.grpo import failure_reason

    cause, tb = _raised(ValueError("rewards must be finite, got nan.\nsecond line"))
    wrapped = ray.exceptions.RayTaskError("ray::Learner.update()", tb, cause, pid=12, ip="10.0.0.1")
    method_error = wrapped.as_instanceof_cause()
    assert "pid=12" in str(method_error).splitlines()[0]  # Ray's header: what error_reason alone would quote
    assert failure_reason(method_error) == "ValueError: rewards must be finite, got nan"

    cause, tb = _raised(RolloutEngineUnavailable("algorithm.rolloutEngine is vllm but this rollout worker cannot "
                                                 "run vLLM: no CUDA GPU is visible to the rollout worker."))
    init = ray.exceptions.RayTaskError("ray::RolloutWorker.__init__()", tb, cause, pid=13, ip="10.0.0.1")
    assert failure_reason(ray.exceptions.ActorDiedError(cause=init)) == (
        "ActorDiedError: RolloutEngineUnavailable: algorithm.rolloutEngine is vllm but this rollout worker cannot "
        "run vLLM: no CUDA GPU is visible to the rollout worker")

    # a system-level death (no traceback inside), and plain exceptions, as error_reason words them
    assert failure_reason(ray.exceptions.ActorDiedError()).startswith("ActorDiedError: The actor died unexpectedly")
    assert failure_reason(KeyboardInterrupt()) == "KeyboardInterrupt: KeyboardInterrupt"
    assert failure_reason(OSError(28, "No space left on device")) == "OSError: [Errno 28] No space left on device"
