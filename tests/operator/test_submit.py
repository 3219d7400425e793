"""submit.py against a real local Ray head: submit, duplicate id = already submitted, status, stop, logs, an
unreachable dashboard; and the trainer control client against the stand-in trainer running as a real Ray job."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from daedalus_operator.plan import RayJobState
from daedalus_operator.submit import CheckpointCalls, ControlError, RayJobs, RayUnreachable, TrainerControl

SUPPORT = Path(__file__).resolve().parents[1] / "support"


def wait_state(jobs: RayJobs, sid: str, states: set[RayJobState], timeout: float = 60.0) -> RayJobState:
    deadline = time.monotonic() + timeout
    state = jobs.status(sid).state
    while state not in states and time.monotonic() < deadline:
        time.sleep(0.3)
        state = jobs.status(sid).state
    return state


def test_submit_duplicate_status_logs(ray_head) -> None:
    jobs = RayJobs(ray_head.dashboard_url)
    sid = f"t-dup-{time.time_ns()}-a1"
    assert jobs.status(sid).state == RayJobState.NOT_FOUND
    first = jobs.submit(sid, f"{sys.executable} -c \"import os; print('hello', os.environ['X_TEST'])\"",
                        env_vars={"X_TEST": "42"}, metadata={"job": "t"})
    assert first.created
    again = jobs.submit(sid, "echo never-runs")
    assert not again.created and again.submission_id == sid
    assert wait_state(jobs, sid, {RayJobState.SUCCEEDED, RayJobState.FAILED}) == RayJobState.SUCCEEDED
    assert "hello 42" in jobs.logs(sid)
    assert "never-runs" not in jobs.logs(sid)
    same = [j for j in jobs._c().list_jobs() if j.submission_id == sid]
    assert len(same) == 1 and same[0].entrypoint.endswith("os.environ['X_TEST'])\"")


def test_stop_and_failure_message(ray_head) -> None:
    jobs = RayJobs(ray_head.dashboard_url)
    sid = f"t-stop-{time.time_ns()}-a1"
    jobs.submit(sid, f"{sys.executable} -c \"import time; time.sleep(120)\"")
    assert wait_state(jobs, sid, {RayJobState.RUNNING}) == RayJobState.RUNNING
    assert jobs.stop(sid) is True
    assert wait_state(jobs, sid, {RayJobState.STOPPED, RayJobState.FAILED}) == RayJobState.STOPPED
    assert jobs.stop(sid) is False  # already ended
    assert jobs.stop("no-such-job-a1") is False
    bad = f"t-fail-{time.time_ns()}-a1"
    jobs.submit(bad, f"{sys.executable} -c \"raise SystemExit(3)\"")
    assert wait_state(jobs, bad, {RayJobState.FAILED, RayJobState.SUCCEEDED}) == RayJobState.FAILED
    assert "exit code 3" in jobs.status(bad).message


def test_a_real_failed_entrypoint_s_message_is_summarized_to_its_last_log_lines(ray_head) -> None:
    """Ray's own message for an entrypoint that failed after long log lines (the form summarize_ray_message parses;
    Ray 2.60 quotes the last 10 lines): the raw message's first 1024 characters, what a condition keeps, miss the
    error at its end; the summary ends with it."""
    from daedalus_operator.plan import summarize_ray_message

    jobs = RayJobs(ray_head.dashboard_url)
    sid = f"t-tail-{time.time_ns()}-a1"
    script = ("import sys; [print(f'chatter line {i} ' + 'x' * 200) for i in range(50)]; "
              "print('error: model.path holds no checkpoint', file=sys.stderr); sys.exit(2)")
    jobs.submit(sid, f'{sys.executable} -c "{script}"')
    assert wait_state(jobs, sid, {RayJobState.FAILED, RayJobState.SUCCEEDED}) == RayJobState.FAILED
    message = jobs.status(sid).message
    assert message.startswith("Job entrypoint command failed with exit code 2, last available logs")
    assert message.rstrip().endswith("error: model.path holds no checkpoint")
    assert "error:" not in f"Ray job FAILED: {message}"[:1024]  # what the status kept before
    summary = summarize_ray_message(message)
    assert summary.startswith("Job entrypoint command failed with exit code 2; last log lines: ")
    assert summary.endswith(" | error: model.path holds no checkpoint"), summary
    assert "chatter line 49 " in summary and len(summary) < 800


@pytest.mark.slow
def test_ray_token_authentication_against_a_real_head() -> None:
    """A real Ray head with token authentication, as the operator's RayClusters run (RAY_AUTH_MODE=token,
    RAY_AUTH_TOKEN): with the job's token the operator submits, reads the status and stops; without it, or with
    another (the job's Secret replaced after the pods started), the status is UNREACHABLE and marked unauthorized
    (the operator reads the Secret again) and a submission raises RayUnauthorized. The health endpoint KubeRay's
    probes call stays open without a token."""
    import requests

    from ray_head import start_ray_head

    from daedalus_operator.submit import RayUnauthorized

    token = "t0ken-" + str(time.time_ns())
    head = start_ray_head(num_cpus=1, env={"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token})
    try:
        jobs = RayJobs(head.dashboard_url, token=token)
        sid = f"t-auth-{time.time_ns()}-a1"
        assert jobs.submit(sid, f"{sys.executable} -c \"print('authenticated')\"").created
        assert wait_state(jobs, sid, {RayJobState.SUCCEEDED, RayJobState.FAILED}) == RayJobState.SUCCEEDED
        assert "authenticated" in jobs.logs(sid)
        for other, says in ((None, "without a token"), ("not-" + token, "the job's token")):
            refused = RayJobs(head.dashboard_url, token=other).status(sid)
            assert refused.state == RayJobState.UNREACHABLE and refused.unauthorized, refused
            assert says in refused.message and "Secret" in refused.message, refused.message
            with pytest.raises(RayUnauthorized):
                RayJobs(head.dashboard_url, token=other).submit(f"t-auth-{time.time_ns()}-a2", "echo never")
        assert requests.get(head.dashboard_url + "/api/gcs_healthz", timeout=10).status_code == 200
        assert requests.get(head.dashboard_url + "/api/jobs/", timeout=10).status_code == 401
    finally:
        head.stop()


def test_unreachable_dashboard_is_bounded() -> None:
    from ray_head import free_port

    jobs = RayJobs(f"http://127.0.0.1:{free_port()}", timeout=1.0)
    t0 = time.monotonic()
    obs = jobs.status("x-a1")
    assert obs.state == RayJobState.UNREACHABLE and "unreachable" in obs.message
    with pytest.raises(RayUnreachable):
        jobs.submit("x-a1", "echo")
    assert time.monotonic() - t0 < 10


def test_a_failed_checkpoint_call_records_the_http_status_and_may_be_started_again() -> None:
    """The planner asks again after no answer (status 0) or 401, never after 409/500: the background call records
    ControlError.status. A tiny HTTP server answers POST /stop with the status queued for it."""
    import http.server
    import threading

    from ray_head import free_port

    answers = [401, 409]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's hook
            body = json.dumps({"error": "no"}).encode()
            self.send_response(answers.pop(0))
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    def finished(calls: CheckpointCalls, key: str):
        deadline = time.monotonic() + 10
        while calls.get(key).in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
        return calls.get(key)

    calls = CheckpointCalls()
    assert calls.start("k-a1", TrainerControl(f"http://127.0.0.1:{free_port()}", timeout=1.0), 1, stop=True)
    nobody = finished(calls, "k-a1")
    assert nobody.error and nobody.http_status == 0 and nobody.retryable
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        control = TrainerControl(f"http://127.0.0.1:{server.server_address[1]}", token="t", timeout=1.0)
        assert calls.start("k-a1", control, 1, stop=True)  # a failed call may be started again
        refused = finished(calls, "k-a1")
        assert refused.http_status == 401 and "HTTP 401" in refused.error and refused.retryable
        assert calls.start("k-a1", control, 1, stop=True)
        ended = finished(calls, "k-a1")
        assert ended.http_status == 409 and not ended.retryable
    finally:
        server.shutdown()
        server.server_close()


def test_control_client_against_standin_trainer(ray_head, tmp_path: Path) -> None:
    from ray_head import free_port

    port = free_port()
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    config = {"metadata": {"name": "ctl", "namespace": "ns"},
              "spec": {"algorithm": {"steps": 200}, "checkpoint": {"path": str(tmp_path / "ckpt"), "intervalSteps": 50},
                       "lora": {"rank": 4}}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    jobs = RayJobs(ray_head.dashboard_url)
    sid = f"t-ctl-{time.time_ns()}-a1"
    jobs.submit(sid, f"{sys.executable} {SUPPORT / 'standin_trainer.py'} --config {tmp_path / 'config.json'}",
                env_vars={"DAEDALUS_METRICS_PORT": str(port), "DAEDALUS_CONTROL_TOKEN_FILE": str(token_file),
                          "DAEDALUS_ATTEMPT": "1", "DAEDALUS_STANDIN_STEP_SECONDS": "0.2"})
    try:
        ctl = TrainerControl(f"http://127.0.0.1:{port}", token="s3cret")
        deadline = time.monotonic() + 60
        status = ctl.status()
        while (not status.reachable or (status.step or 0) < 3) and time.monotonic() < deadline:
            time.sleep(0.2)
            status = ctl.status()
        assert status.reachable and status.step >= 3 and status.attempt == 1 and status.total_steps == 200
        with pytest.raises(ControlError) as err:
            TrainerControl(ctl.url, token="wrong").checkpoint(5)
        assert err.value.status == 401
        with pytest.raises(ControlError) as err:
            TrainerControl(ctl.url, token=None).checkpoint(5)
        assert err.value.status == 401
        before = ctl.status().step
        doc = ctl.checkpoint(30)
        assert doc["step"] > before and Path(doc["path"]).is_dir()
        assert (tmp_path / "ckpt" / "ns" / "ctl" / "latest").read_text().strip() == Path(doc["path"]).name
        assert ctl.status().checkpoint_step == doc["step"]
        # the background variant used by the handlers
        calls = CheckpointCalls()
        assert calls.start(sid, ctl, 30) and not calls.start(sid, ctl, 30)  # one in flight per attempt
        deadline = time.monotonic() + 30
        while calls.get(sid).in_flight and time.monotonic() < deadline:
            time.sleep(0.1)
        result = calls.get(sid)
        assert result.step is not None and result.step > doc["step"] and result.error is None
    finally:
        jobs.stop(sid)
    assert wait_state(jobs, sid, {RayJobState.STOPPED, RayJobState.FAILED, RayJobState.SUCCEEDED}) in (
        RayJobState.STOPPED, RayJobState.FAILED)
    assert not TrainerControl(f"http://127.0.0.1:{port}").status().reachable


# ------------------------------------------------------------------------------------------ CheckpointCalls memory
class HeldTrainer:
    """A trainer's control port on a real loopback HTTP server: each ``POST`` is recorded and answered 200 with
    ``{"step": n, "path": "/c/n"}`` (n: its 1-based order) once :attr:`gate` is set (set at first)."""

    def __init__(self) -> None:
        import http.server
        import threading

        self.seen: list[str] = []
        self.gate = threading.Event()
        self.gate.set()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's hook
                outer.seen.append(self.path.split("?")[0])
                n = len(outer.seen)
                outer.gate.wait(30)
                body = json.dumps({"step": n, "path": f"/c/{n}"}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.control = TrainerControl(f"http://127.0.0.1:{self.server.server_address[1]}", token="t", timeout=2.0)

    def close(self) -> None:
        self.gate.set()
        self.server.shutdown()
        self.server.server_close()


def _settled(calls: CheckpointCalls, *keys: str) -> None:
    from fake_kuberay import wait_for

    wait_for(lambda: not any(calls.get(k).in_flight for k in keys), timeout=10, interval=0.02,
             message=f"calls {keys} to end")


def test_retain_drops_the_other_attempts_of_one_owner_only() -> None:
    from daedalus_operator.plan import CheckpointCall

    trainer = HeldTrainer()
    try:
        calls = CheckpointCalls()
        started = [calls.start("j-a1", trainer.control, 5, owner="uid-j"),
                   calls.start("j-a2", trainer.control, 5, owner="uid-j"),
                   calls.start("j-a2/deletion", trainer.control, 5, stop=True, owner="uid-j", attempt="j-a2"),
                   calls.start("k-a1", trainer.control, 5, owner="uid-k"),
                   calls.start("free", trainer.control, 5)]
        assert started == [True] * 5
        _settled(calls, "j-a1", "j-a2", "j-a2/deletion", "k-a1", "free")
        assert len(calls) == 5 and sorted(calls.get(k).step for k in (
            "j-a1", "j-a2", "j-a2/deletion", "k-a1", "free")) == [1, 2, 3, 4, 5]
        calls.retain("uid-j", "j-a2")  # the job moved on to attempt 2: attempt 1's entry goes, both of 2's stay
        assert calls.get("j-a1") == CheckpointCall() and len(calls) == 4
        assert calls.get("j-a2").step is not None and calls.get("j-a2/deletion").step is not None
        calls.retain("uid-j", None)  # the job is gone
        assert calls.get("j-a2") == CheckpointCall() and calls.get("j-a2/deletion") == CheckpointCall()
        assert calls.get("k-a1").step is not None and calls.get("free").step is not None and len(calls) == 2
        calls.retain("uid-k", None)
        assert len(calls) == 1 and calls.get("free").step is not None  # no owner: only forget() drops it
        assert len(trainer.seen) == 5  # one request per start, none repeated
    finally:
        trainer.close()


def test_retain_marks_a_call_in_flight_and_removes_it_when_it_ends() -> None:
    """Two real calls in flight at once (the trainer holds its answers): the one of the earlier attempt is not dropped
    while it runs (so it still reads as in flight and no second request goes to the trainer), and is removed once its
    answer came; the current attempt's call records its answer. A marked call whose attempt is kept again is
    recorded as usual."""
    from fake_kuberay import wait_for

    from daedalus_operator.plan import CheckpointCall

    trainer = HeldTrainer()
    trainer.gate.clear()
    try:
        calls = CheckpointCalls()
        assert calls.start("j-a1", trainer.control, 5, owner="uid")
        assert calls.start("j-a2", trainer.control, 5, owner="uid")
        wait_for(lambda: len(trainer.seen) == 2, timeout=10, interval=0.02, message="both requests")
        calls.retain("uid", "j-a2")
        calls.retain("uid", "j-a2")  # as every reconcile does
        assert calls.get("j-a1").in_flight and len(calls) == 2
        assert not calls.start("j-a1", trainer.control, 5, owner="uid")  # still in flight: not asked twice
        trainer.gate.set()
        _settled(calls, "j-a1", "j-a2")
        assert calls.get("j-a1") == CheckpointCall()  # removed when its call ended
        assert calls.get("j-a2").step in (1, 2) and calls.get("j-a2").error is None and len(calls) == 1
        assert len(trainer.seen) == 2

        trainer.gate.clear()
        assert calls.start("j-a3", trainer.control, 5, owner="uid")
        wait_for(lambda: len(trainer.seen) == 3, timeout=10, interval=0.02, message="the third request")
        calls.retain("uid", "j-a4")  # marked (and j-a2, finished, dropped at once)
        assert calls.get("j-a2") == CheckpointCall() and calls.get("j-a3").in_flight
        calls.retain("uid", "j-a3")  # the status said j-a3 after all: kept
        trainer.gate.set()
        _settled(calls, "j-a3")
        assert calls.get("j-a3") == CheckpointCall(step=3, path="/c/3") and len(calls) == 1
    finally:
        trainer.close()


def test_started_keeps_the_latest_256_starts() -> None:
    from ray_head import free_port

    from daedalus_operator.submit import STARTED_KEEP

    calls = CheckpointCalls()
    nobody = TrainerControl(f"http://127.0.0.1:{free_port()}", timeout=1.0)  # refused at once
    keys = [f"k-{i}" for i in range(300)]
    for key in keys:
        assert calls.start(key, nobody, 1, owner="uid")
    _settled(calls, *keys)
    assert STARTED_KEEP == 256 and [k for k, _ in calls.started] == keys[-256:]
    assert all(calls.get(k).http_status == 0 for k in keys) and len(calls) == 300
    calls.retain("uid", None)
    assert len(calls) == 0
