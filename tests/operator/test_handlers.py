"""handlers.gather reading kopf's indexes: a snapshot that cannot be taken must skip the reconcile (kopf retries),
never hand the planner an empty view of the pods or nodes (which reads as "every pod and node is gone")."""

from __future__ import annotations

import http.server
import json
import logging
import threading
import time
from pathlib import Path

import kopf
import pytest
import yaml

from daedalus_operator import api
from daedalus_operator.handlers import Runtime, execute, gather, job_view
from daedalus_operator.metrics import WAKE_REASONS, OperatorMetrics
from daedalus_operator.nodes import ClusterState
from daedalus_operator.plan import Observed, RequestCheckpoint
from daedalus_operator.settings import OperatorSettings

ROOT = Path(__file__).resolve().parents[2]


class ChangingStore:
    """A kopf index store whose dict another thread keeps resizing: every iteration fails as CPython's does."""

    def __bool__(self) -> bool:
        return True

    def __iter__(self):
        raise RuntimeError("dictionary changed size during iteration")


class EmptiedStore:
    """A store that was non-empty when tested and emptied before it was read (kopf's event loop removed the object)."""

    def __bool__(self) -> bool:
        return True

    def __iter__(self):
        return iter(())


class Index(dict):
    """The mapping interface of ``kopf.Index`` (key -> store)."""


def _job():
    doc = yaml.safe_load((ROOT / "examples" / "local-tiny.yaml").read_text())
    doc["metadata"].update(namespace="ml", uid="0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0", generation=1)
    doc["status"] = {"phase": "Running", "attempt": 1, "submissionId": "local-tiny-0f1e2d3c-a1",
                     "submissionConfirmed": True, "attemptStartTime": "2026-01-01T00:00:00Z", "currentStep": 5}
    return job_view(doc)


def _rt() -> Runtime:
    return Runtime(settings=OperatorSettings(), metrics=OperatorMetrics())


@pytest.mark.parametrize("which, index", [
    ("pods_by_job", Index({("ml", "local-tiny"): ChangingStore()})),
    ("clusters_by_job", Index({("ml", "local-tiny"): ChangingStore()})),
    ("nodes_by_name", Index({"node-a": ChangingStore()})),
    ("nodes_by_name", Index({"node-a": EmptiedStore()})),
], ids=["pods", "clusters", "nodes-changing", "nodes-emptied"])
def test_an_index_that_cannot_be_read_skips_the_reconcile(which: str, index: Index) -> None:
    indexes = {"pods_by_job": None, "nodes_by_name": None, "clusters_by_job": None, "services_by_job": None,
               which: index}
    with pytest.raises(kopf.TemporaryError):
        gather(_rt(), _job(), indexes)


# ------------------------------------------------------------------------------------------------ checkpoint requests
class SecretOnly:
    """The one Kubernetes read ``RequestCheckpoint`` makes: the job's token Secret."""

    def __init__(self, token: str):
        self.token = token

    def get(self, key: str, namespace: str, name: str) -> dict:
        assert (namespace, name) == ("ml", api.secret_name("local-tiny")), (namespace, name)
        return {"stringData": {api.TOKEN_KEY: self.token}}


def test_a_checkpoint_request_refused_with_401_is_asked_again_with_the_token_read_again() -> None:
    """The Secret was replaced after this process cached its token: POST /stop answers 401; the planner asks again
    (CheckpointCall.retryable) and execute reads the token from the Secret again instead of the cached one."""
    seen: list[str] = []

    class Trainer(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's hook
            seen.append(self.headers.get("Authorization", ""))
            ok = seen[-1] == "Bearer new"
            body = json.dumps({"step": 13, "path": "/c/13"} if ok else {"error": "wrong token"}).encode()
            self.send_response(200 if ok else 401)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Trainer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        rt = _rt()
        job = _job()
        rt.kube = SecretOnly("new")
        rt.tokens[job.uid] = "old"
        observed = Observed(cluster=ClusterState(exists=True, ready=True, head_host="127.0.0.1",
                                                 control_port=server.server_address[1]))
        action = RequestCheckpoint(job.status.submission_id, 12)

        def settled():
            deadline = time.monotonic() + 10
            while rt.calls.get(action.submission_id).in_flight and time.monotonic() < deadline:
                time.sleep(0.02)
            return rt.calls.get(action.submission_id)

        execute(rt, job, observed, action, logging.getLogger("test"))
        assert settled().http_status == 401 and seen == ["Bearer old"]
        execute(rt, job, observed, action, logging.getLogger("test"))
        assert settled().step == 13 and seen == ["Bearer old", "Bearer new"]
    finally:
        server.shutdown()
        server.server_close()


# ------------------------------------------------------------------------------------------------ the poll budget
def _node(name: str, *, health: str = "Schedulable", heartbeat: str = "2026-01-01T00:00:00Z") -> dict:
    return {"metadata": {"name": name, "resourceVersion": heartbeat,
                         "labels": {"sagemaker.amazonaws.com/node-health-status": health}},
            "spec": {}, "status": {"conditions": [{"type": "Ready", "status": "True",
                                                    "lastHeartbeatTime": heartbeat}]}}


def _pod(name: str, node: str, rv: str) -> dict:
    return {"metadata": {"name": name, "resourceVersion": rv}, "spec": {"nodeName": node}}


def _indexes(*, pods=(("head", "node-a", "10"), ("worker", "node-b", "11")), nodes=None, cluster_rv="7",
             other_pod_rv="1") -> dict:
    nodes = nodes or {"node-a": _node("node-a"), "node-b": _node("node-b"), "node-c": _node("node-c")}
    return {
        "pods_by_job": Index({("ml", "local-tiny"): [_pod(*p) for p in pods],
                              ("ml", "other"): [_pod("other-head", "node-c", other_pod_rv)]}),
        "nodes_by_name": Index({n: [v] for n, v in nodes.items()}),
        "clusters_by_job": Index({("ml", "local-tiny"): [{"metadata": {"name": "local-tiny-ray",
                                                                       "resourceVersion": cluster_rv}}]}),
        "services_by_job": Index(),
    }


def test_a_jobs_reconcile_lock_is_shared_while_used_and_not_kept_after() -> None:
    """Reconciles of one job share one lock (the second waits for the first); once nobody holds or waits for it the
    operator keeps no entry for the job, so a long-running operator that saw many jobs does not keep one lock each."""
    rt = _rt()
    first = rt.lock_for("ml/a")
    assert first.acquire(timeout=0)
    waiter_got: list[bool] = []
    waiter = threading.Thread(target=lambda: waiter_got.append(rt.lock_for("ml/a").acquire(timeout=0.2)))
    waiter.start()
    waiter.join()
    assert waiter_got == [False]  # the same lock, held: another reconcile of the job waits
    assert rt.lock_for("ml/b").acquire(timeout=0)  # other jobs are not serialised with it
    assert set(rt.locks) == {"ml/a"}  # "ml/b": no reference left
    first.release()
    del first
    assert len(rt.locks) == 0
    assert rt.lock_for("ml/a").acquire(timeout=0)  # a fresh one, unheld


def test_dependency_fingerprint_follows_what_the_planner_reads() -> None:
    from daedalus_operator.handlers import dependency_fingerprint

    base = dependency_fingerprint("ml", "local-tiny", _indexes())
    assert base == dependency_fingerprint("ml", "local-tiny", _indexes())
    # unchanged: another job's pods, a node none of the job's pods runs on, a node's heartbeat
    assert base == dependency_fingerprint("ml", "local-tiny", _indexes(other_pod_rv="2"))
    nodes = {"node-a": _node("node-a"), "node-b": _node("node-b", heartbeat="2026-01-01T00:05:00Z"),
             "node-c": _node("node-c", health="UnschedulablePendingReplacement")}
    assert base == dependency_fingerprint("ml", "local-tiny", _indexes(nodes=nodes))
    # changed: HyperPod's label on a node of the job, a pod's new version, a pod gone, the RayCluster's version
    nodes = {"node-a": _node("node-a"), "node-b": _node("node-b", health="UnschedulablePendingReplacement")}
    assert base != dependency_fingerprint("ml", "local-tiny", _indexes(nodes=nodes))
    assert base != dependency_fingerprint("ml", "local-tiny", _indexes(pods=(("head", "node-a", "10"),
                                                                             ("worker", "node-b", "12"))))
    assert base != dependency_fingerprint("ml", "local-tiny", _indexes(pods=(("head", "node-a", "10"),)))
    assert base != dependency_fingerprint("ml", "local-tiny", _indexes(cluster_rv="8"))
    not_ready = _node("node-a")
    not_ready["status"]["conditions"][0]["status"] = "Unknown"
    assert base != dependency_fingerprint("ml", "local-tiny", _indexes(nodes={"node-a": not_ready,
                                                                              "node-b": _node("node-b")}))


def test_poll_gate_due() -> None:
    from daedalus_operator.handlers import PollGate

    fp = ("pods", "nodes")
    gate = PollGate(quiet=True, budgeted=True, fingerprint=fp, versions=frozenset({"5", "6"}), at=100.0)
    assert not gate.due("6", fp, now=101.0, interval=10.0, tick=2.0)
    assert not gate.due("5", fp, now=108.9, interval=10.0, tick=2.0)  # the version read before its own write
    assert gate.due("6", fp, now=109.0, interval=10.0, tick=2.0)  # half a tick early is on time
    assert gate.due("7", fp, now=101.0, interval=10.0, tick=2.0)  # someone else wrote the job
    assert gate.due("6", ("pods", "other nodes"), now=101.0, interval=10.0, tick=2.0)
    # a quiet job outside Running (not budgeted): only on a change, or every IDLE_RESYNC_SECONDS
    from daedalus_operator.handlers import IDLE_RESYNC_SECONDS

    idle = PollGate(quiet=True, budgeted=False, fingerprint=fp, versions=frozenset({"6"}), at=100.0)
    assert not idle.due("6", fp, now=150.0, interval=10.0, tick=2.0)
    assert idle.due("6", fp, now=100.0 + IDLE_RESYNC_SECONDS, interval=10.0, tick=2.0)
    assert idle.due("6", ("pods", "other nodes"), now=101.0, interval=10.0, tick=2.0)
    # --idle-resync 60: the safety net after 60 s, never before the steady interval
    assert not idle.due("6", fp, now=158.0, interval=10.0, tick=2.0, idle=60.0)
    assert idle.due("6", fp, now=160.0, interval=10.0, tick=2.0, idle=60.0)
    assert not idle.due("6", fp, now=160.0, interval=90.0, tick=2.0, idle=60.0)
    assert PollGate(quiet=False, fingerprint=fp, versions=frozenset({"6"}), at=100.0).due(
        "6", fp, now=100.1, interval=10.0, tick=2.0)
    # why (what Runtime.should_poll counts): the first change found, else the interval, else nothing
    assert gate.wake("6", fp, now=101.0, interval=10.0, tick=2.0) is None
    assert gate.wake("6", fp, now=109.0, interval=10.0, tick=2.0) == "interval"
    assert gate.wake("7", ("pods", "other nodes"), now=109.0, interval=10.0, tick=2.0) == "job"
    assert gate.wake("6", ("pods", "other nodes"), now=101.0, interval=10.0, tick=2.0) == "nodes"
    assert PollGate(quiet=False).wake("6", fp, now=0.0, interval=10.0, tick=2.0) == "active"


def test_poll_gate_says_what_changed() -> None:
    """PollGate.changed names the first dependency that differs from the gate's reconcile (the reason label of
    daedalus_operator_poll_wakes_total), on real fingerprints of the same indexes the operator keeps."""
    from daedalus_operator.handlers import PollGate, dependency_fingerprint

    def fp(**kw) -> tuple:
        return dependency_fingerprint("ml", "local-tiny", _indexes(**kw))

    gate = PollGate(quiet=True, budgeted=True, fingerprint=fp(), versions=frozenset({"5", "6"}), at=100.0)
    assert gate.changed("6", fp()) is None and gate.changed("5", fp(other_pod_rv="9")) is None
    assert gate.changed("7", fp()) == "job"
    assert gate.changed("7", fp(cluster_rv="8")) == "job"  # the body is checked first
    assert gate.changed("6", fp(pods=(("head", "node-a", "10"), ("worker", "node-b", "12")))) == "pods"
    sick = {"node-a": _node("node-a"), "node-b": _node("node-b", health="UnschedulablePendingReplacement")}
    assert gate.changed("6", fp(nodes=sick)) == "nodes"
    assert gate.changed("6", fp(cluster_rv="8")) == "raycluster"
    served = _indexes()
    served["services_by_job"] = Index({("ml", "local-tiny"): [{"metadata": {"name": "local-tiny-serve",
                                                                           "resourceVersion": "3"}}]})
    assert gate.changed("6", dependency_fingerprint("ml", "local-tiny", served)) == "rayservice"


def test_steady_interval_shares_the_budget_and_skips_are_counted() -> None:
    import time as _time

    from daedalus_operator.handlers import PollGate

    rt = Runtime(settings=OperatorSettings(poll_interval=2.0, poll_budget=20.0), metrics=OperatorMetrics())
    assert rt.steady_interval() == 2.0
    now = _time.monotonic()
    for i in range(300):  # 100 quiet and Running (budgeted), 100 quiet in other phases, 100 busy
        rt.put_gate(f"uid-{i}", PollGate(quiet=i % 3 < 2, budgeted=i % 3 == 0, at=now))
    assert rt.budgeted == 100 and rt.steady_interval() == 5.0
    assert rt.metrics.steady_poll_seconds._value.get() == 5.0
    rt.put_gate("uid-0", PollGate(quiet=False, at=now))  # replaced: no longer budgeted
    rt.put_gate("uid-3", None)  # deleted
    assert rt.budgeted == 98 and rt.steady_interval() == 4.9
    unlimited = Runtime(settings=OperatorSettings(poll_interval=2.0, poll_budget=0.0), metrics=OperatorMetrics())
    for uid, gate in rt.gates.items():
        unlimited.put_gate(uid, gate)
    assert unlimited.steady_interval() == 2.0
    # a gate no reconcile refreshed for longer than the horizon (a job deleted during a tick) stops counting
    rt.put_gate("uid-6", PollGate(quiet=True, budgeted=True, at=now - 3600))
    rt.pruned_at = 0.0
    assert rt.steady_interval() == 4.85 and "uid-6" not in rt.gates and rt.budgeted == 97

    import time as _time

    from daedalus_operator.handlers import dependency_fingerprint

    indexes = _indexes()
    body = {"metadata": {"name": "local-tiny", "namespace": "ml", "uid": "u1", "resourceVersion": "6"}}
    assert rt.should_poll(body, indexes)  # never reconciled by this process
    rt.put_gate("u1", PollGate(quiet=True, budgeted=True, fingerprint=dependency_fingerprint("ml", "local-tiny",
                                                                                            indexes),
                               versions=frozenset({"6"}), at=_time.monotonic()))
    assert not rt.should_poll(body, indexes)
    assert not rt.should_poll(body, indexes)
    assert rt.metrics.poll_skips._value.get() == 2
    assert rt.should_poll(body, _indexes(cluster_rv="8"))
    assert rt.should_poll({"metadata": dict(body["metadata"], resourceVersion="9")}, indexes)
    assert rt.metrics.poll_skips._value.get() == 2
    wakes = {r: rt.metrics.poll_wakes.labels(reason=r)._value.get() for r in WAKE_REASONS}
    assert wakes == {"job": 1, "pods": 0, "nodes": 0, "raycluster": 1, "rayservice": 0}
    # a quiet job outside Running looked at 100 s ago: due with --idle-resync 50, not with the default 300
    waiting = PollGate(quiet=True, budgeted=False, fingerprint=dependency_fingerprint("ml", "local-tiny", indexes),
                       versions=frozenset({"6"}), at=_time.monotonic() - 100.0)
    rt.put_gate("u1", waiting)
    assert not rt.should_poll(body, indexes)
    short = Runtime(settings=OperatorSettings(poll_interval=2.0, poll_budget=20.0, idle_resync=50.0),
                    metrics=OperatorMetrics())
    short.put_gate("u1", waiting)
    assert short.should_poll(body, indexes)
    assert rt.metrics.poll_skips._value.get() == 3


def test_is_quiet() -> None:
    from daedalus_operator.handlers import is_quiet
    from daedalus_operator.plan import EnsureChildren, Event, EventType, Plan, TrainerObservation

    running = {"phase": "Running", "attempt": 2, "latestCheckpoint": {"step": 40, "path": "/c/step-000040"}}
    stepped = TrainerObservation(reachable=True, step=12, attempt=2, resumed_from=10)
    Phase = api.Phase
    assert is_quiet("requeue", Plan(Phase.RUNNING, requeue_after=2.0), "Running", running, 2.0, stepped)
    assert is_quiet("ok", Plan(Phase.SUCCEEDED), "Succeeded", {"phase": "Succeeded"}, 2.0, None)
    assert is_quiet("requeue", Plan(Phase.PROVISIONING, requeue_after=2.0), "Provisioning", {}, 2.0, None)
    # not quiet: an error, an action, an event, a sooner requeue, a new phase, a phase that is never quiet
    assert not is_quiet("error", Plan(Phase.RUNNING, requeue_after=2.0), "Running", running, 2.0, stepped)
    assert not is_quiet("requeue", Plan(Phase.RUNNING, actions=[EnsureChildren()], requeue_after=2.0), "Running",
                        running, 2.0, stepped)
    assert not is_quiet("requeue", Plan(Phase.RUNNING, events=[Event(EventType.NORMAL, "Recovered", "")],
                                        requeue_after=2.0), "Running", running, 2.0, stepped)
    assert not is_quiet("requeue", Plan(Phase.RUNNING, requeue_after=0.5), "Running", running, 2.0, stepped)
    assert not is_quiet("requeue", Plan(Phase.RUNNING, requeue_after=2.0), "Provisioning", running, 2.0, stepped)
    assert not is_quiet("requeue", Plan(Phase.CHECKPOINTING, requeue_after=2.0), "Checkpointing",
                        {"phase": "Checkpointing"}, 2.0, stepped)
    # not quiet: a recovery under way, a grace period counting, a trainer that has not stepped in this attempt
    assert not is_quiet("requeue", Plan(Phase.RUNNING, requeue_after=2.0), "Running",
                        dict(running, recovery={"reason": "NodeReplacement"}), 2.0, stepped)
    assert not is_quiet("requeue", Plan(Phase.RUNNING, requeue_after=2.0), "Running",
                        dict(running, unreachableSince="2026-01-01T00:00:00Z"), 2.0, stepped)
    # a pod not Ready inside --pod-ready-grace: nothing in status says so, the plan does (looked at every tick)
    assert not is_quiet("requeue", Plan(Phase.RUNNING, requeue_after=2.0, in_grace=True), "Running", running, 2.0,
                        stepped)
    for trainer in (None, TrainerObservation(), TrainerObservation(reachable=True, step=10, attempt=2, resumed_from=10),
                    TrainerObservation(reachable=True, step=12, attempt=1, resumed_from=0),
                    TrainerObservation(reachable=True, step=0, attempt=2),
                    TrainerObservation(reachable=True, step=40, attempt=2)):  # no resumedFrom: the checkpoint's step
        assert not is_quiet("requeue", Plan(Phase.RUNNING, requeue_after=2.0), "Running", running, 2.0, trainer)
    assert is_quiet("requeue", Plan(Phase.RUNNING, requeue_after=2.0), "Running", running, 2.0,
                    TrainerObservation(reachable=True, step=41, attempt=2))


# ------------------------------------------------------------------------------------------------ deleting a job
class ControlTrainer:
    """The trainer's control port as the finalizer meets it: records every ``POST`` (path, ``Authorization``,
    ``timeout`` query) and answers them with ``answers`` in order, each ``(HTTP status, body)``, after
    ``delay`` seconds; ``None``: never answers until :meth:`close`."""

    def __init__(self, *answers: tuple[int, dict] | None, delay: float = 0.0):
        self.seen: list[tuple[str, str, str]] = []
        self.released = threading.Event()
        outer = self
        queue = list(answers)

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's hook
                from urllib.parse import parse_qs, urlsplit

                url = urlsplit(self.path)
                outer.seen.append((url.path, self.headers.get("Authorization", ""),
                                   parse_qs(url.query).get("timeout", [""])[0]))
                answer = queue.pop(0) if queue else (500, {"error": "unexpected request"})
                if answer is None:
                    outer.released.wait(30)
                    return
                time.sleep(delay)
                body = json.dumps(answer[1]).encode()
                self.send_response(answer[0])
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.port = self.server.server_address[1]

    def close(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


def _deleted_body(phase: str = "Running", checkpoint_timeout: int | None = None, confirmed: bool = True) -> dict:
    doc = yaml.safe_load((ROOT / "examples" / "local-tiny.yaml").read_text())
    doc["metadata"].update(namespace="ml", uid="0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0", generation=1,
                           deletionTimestamp="2026-01-01T00:00:00Z")
    if checkpoint_timeout is not None:
        doc["spec"]["resilience"]["checkpointTimeoutSeconds"] = checkpoint_timeout
    doc["status"] = {"phase": phase, "attempt": 1, "submissionId": "local-tiny-0f1e2d3c-a1", "currentStep": 5,
                     "submissionConfirmed": confirmed}
    return doc


def _head(trainer: ControlTrainer, **kw) -> ClusterState:
    from ray_head import free_port

    # the dashboard port answers nothing: the Ray job's state is unknown, so the trainer is asked
    return ClusterState(exists=True, ready=True, head_host="127.0.0.1", control_port=trainer.port,
                        dashboard_port=free_port(), **kw)


def _until_decided(rt: Runtime, body: dict, cluster: ClusterState, clock: list[float]) -> tuple[object, int]:
    """Call checkpoint_before_deletion as kopf retries the finalizer (after each TemporaryError's delay) until it
    decides; ``clock[0]`` is the ``waited`` it is given (seconds, advanced by each delay). Returns (outcome, waits)."""
    from daedalus_operator.handlers import DELETION_POLL_SECONDS, checkpoint_before_deletion

    waits = 0
    for _ in range(200):
        try:
            return checkpoint_before_deletion(rt, body, cluster, None, clock[0]), waits
        except kopf.TemporaryError as e:
            assert 0 < e.delay <= DELETION_POLL_SECONDS
            waits += 1
            time.sleep(0.05)  # the background call progresses in real time; the bound is kept by ``clock``
            clock[0] += e.delay
    raise AssertionError("checkpoint_before_deletion never decided")


def test_deleting_a_running_job_asks_its_trainer_for_one_checkpoint_and_stop_with_the_token() -> None:
    from daedalus_operator.handlers import CHECKPOINTED_BEFORE_DELETION, checkpoint_before_deletion

    trainer = ControlTrainer((200, {"step": 17, "path": "/c/step-000017", "time": "2026-01-01T00:00:09Z"}),
                             delay=0.5)
    try:
        rt = Runtime(settings=OperatorSettings(request_timeout=1.0), metrics=OperatorMetrics())
        rt.kube = SecretOnly("tok")
        body, cluster = _deleted_body(), _head(trainer)
        with pytest.raises(kopf.TemporaryError):  # the request is made in the background: the finalizer waits
            checkpoint_before_deletion(rt, body, cluster, None, 0.0)
        outcome, waits = _until_decided(rt, body, cluster, [0.0])
        assert waits >= 1  # the call was in flight for half a second: looked at again, never asked twice
        assert trainer.seen == [("/stop", "Bearer tok", "90")]  # min(300 s spec, 3/4 of the 120 s deletion_timeout)
        assert (outcome.step, outcome.path, outcome.reason, outcome.warning) == (
            17, "/c/step-000017", CHECKPOINTED_BEFORE_DELETION, False)
        assert "step 17" in outcome.message
    finally:
        trainer.close()


@pytest.mark.parametrize("checkpoint_timeout, deletion_timeout, bound", [(300, 4.0, 3.0), (2, 120.0, 2.0)],
                         ids=["deletion-timeout", "checkpointTimeoutSeconds"])
def test_a_trainer_that_never_answers_holds_the_deletion_no_longer_than_the_bound(
        checkpoint_timeout: int, deletion_timeout: float, bound: float) -> None:
    from daedalus_operator.handlers import NO_CHECKPOINT_BEFORE_DELETION, checkpoint_before_deletion

    trainer = ControlTrainer(None)
    try:
        rt = Runtime(settings=OperatorSettings(request_timeout=1.0, deletion_timeout=deletion_timeout),
                     metrics=OperatorMetrics())
        rt.kube = SecretOnly("tok")
        body, cluster = _deleted_body(checkpoint_timeout=checkpoint_timeout), _head(trainer)
        clock = [0.0]
        outcome, _ = _until_decided(rt, body, cluster, clock)
        assert bound <= clock[0] < bound + 1.0  # released once the bound passed, not later
        assert trainer.seen == [("/stop", "Bearer tok", f"{bound:g}")]  # one request, told the bound
        assert outcome.step is None and outcome.warning and outcome.reason == NO_CHECKPOINT_BEFORE_DELETION
        assert f"within {bound:g} s" in outcome.message
        # a look with time left at the call that still hangs waits on it: never a second request
        with pytest.raises(kopf.TemporaryError):
            checkpoint_before_deletion(rt, body, cluster, None, 0.0)
        assert len(trainer.seen) == 1
    finally:
        trainer.close()


def test_a_refused_checkpoint_is_asked_again_only_when_that_may_help() -> None:
    """401 (the Secret was replaced): the token is read again and the checkpoint asked again; 409 (the trainer
    ended) is final: stop at once, no second request."""
    trainer = ControlTrainer((401, {"error": "wrong token"}), (200, {"step": 9, "path": "/c/9"}))
    try:
        rt = Runtime(settings=OperatorSettings(request_timeout=1.0), metrics=OperatorMetrics())
        rt.kube = SecretOnly("new")
        rt.tokens["0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"] = "old"
        outcome, _ = _until_decided(rt, _deleted_body(), _head(trainer), [0.0])
        assert [auth for _, auth, _ in trainer.seen] == ["Bearer old", "Bearer new"] and outcome.step == 9
    finally:
        trainer.close()
    trainer = ControlTrainer((409, {"error": "trainer already finished"}))
    try:
        rt = Runtime(settings=OperatorSettings(request_timeout=1.0), metrics=OperatorMetrics())
        rt.kube = SecretOnly("tok")
        clock = [0.0]
        outcome, _ = _until_decided(rt, _deleted_body(), _head(trainer), clock)
        assert len(trainer.seen) == 1 and outcome.step is None and "409" in outcome.message
        # the trainer had ended (the planner's own /stop, a finished run): no Warning that steps were lost
        assert not outcome.warning and "already ended" in outcome.message and "lost" not in outcome.message
        assert clock[0] < 5.0  # decided on the answer, not on the bound
    finally:
        trainer.close()


@pytest.mark.parametrize("phase", ["Pending", "Provisioning", "Recovering", "Suspended", "Succeeded", "Failed"])
def test_deleting_a_job_without_a_running_trainer_asks_for_no_checkpoint(phase: str) -> None:
    from daedalus_operator.handlers import checkpoint_before_deletion

    trainer = ControlTrainer()
    try:
        rt = Runtime(settings=OperatorSettings(request_timeout=1.0), metrics=OperatorMetrics())
        rt.kube = SecretOnly("tok")
        outcome = checkpoint_before_deletion(rt, _deleted_body(phase), _head(trainer), None, 0.0)
        assert outcome.reason is None and not outcome.warning and phase in outcome.message  # a log line only
        # a Running job whose RayCluster is already being deleted (foreground cascading deletion): nobody to ask
        outcome = checkpoint_before_deletion(rt, _deleted_body(), _head(trainer, deleting=True), None, 0.0)
        assert outcome.warning and "being deleted" in outcome.message
        assert trainer.seen == []
    finally:
        trainer.close()


def test_an_unconfirmed_submission_with_an_unanswering_dashboard_is_not_waited_for() -> None:
    """A Running job whose submission the dashboard never confirmed (a dead head) and that it does not now report
    running: no trainer is known to run, so the deletion asks for nothing and goes on at once (with the Warning),
    instead of retrying a refused connection for the whole bound."""
    from daedalus_operator.handlers import NO_CHECKPOINT_BEFORE_DELETION, checkpoint_before_deletion

    trainer = ControlTrainer()
    try:
        rt = Runtime(settings=OperatorSettings(request_timeout=1.0), metrics=OperatorMetrics())
        rt.kube = SecretOnly("tok")
        outcome = checkpoint_before_deletion(rt, _deleted_body(confirmed=False), _head(trainer), None, 0.0)
        assert outcome.warning and outcome.reason == NO_CHECKPOINT_BEFORE_DELETION
        assert "never confirmed" in outcome.message and trainer.seen == []
    finally:
        trainer.close()


@pytest.mark.parametrize("status, phase, sid, confirmed, problem", [
    (None, "Pending", None, False, None),
    ({}, "Pending", None, False, None),
    ({"phase": "Running", "submissionId": "j-a1", "submissionConfirmed": True}, "Running", "j-a1", True, None),
    # other fields no version of the model reads do not matter here
    ({"phase": "Checkpointing", "submissionId": "j-a2", "submissionConfirmed": True,
      "attemptStartTime": "yesterday", "consecutiveFailures": "many", "conditions": "none"},
     "Checkpointing", "j-a2", True, None),
    ({"phase": "Running", "submissionId": "j-a1", "submissionConfirmed": "true"}, "Running", "j-a1", False, None),
    ({"phase": "Preempted", "submissionId": "j-a1"}, None, "j-a1", False, "status.phase is not a phase"),
    ({"phase": ["Running"], "submissionId": "j-a1"}, None, "j-a1", False, "(it holds ['Running'])"),
    ({"phase": "Running", "submissionId": 7}, "Running", None, False, "status.submissionId is not a string"),
    # no trainer runs in a finished phase: nothing to warn about
    ({"phase": "Succeeded", "submissionId": 7}, "Succeeded", None, False, None),
    ("Running", None, None, False, "status is not an object (it holds 'Running')"),
], ids=["none", "empty", "running", "other-fields-invalid", "confirmed-not-bool", "unknown-phase", "phase-list",
        "sid-int", "sid-int-succeeded", "not-a-mapping"])
def test_deletion_fields_reads_each_field_on_its_own(status, phase, sid, confirmed, problem) -> None:
    from daedalus_operator.handlers import deletion_fields, read_status

    fields = deletion_fields(status)
    assert (fields.phase, fields.submission_id, fields.submission_confirmed) == (phase, sid, confirmed)
    if problem is None:
        assert fields.problem is None
    else:
        assert problem in fields.problem, fields.problem
    if isinstance(status, dict) and "attemptStartTime" in status:
        assert read_status(status)[1] is not None  # the reconcile's reader refuses this status as a whole


def test_a_status_with_unreadable_other_fields_still_checkpoints_before_deletion() -> None:
    """A Running status that :func:`read_status` refuses for a field the deletion does not need (here the attempt's
    start time and a counter): the trainer is still asked, and its checkpoint written."""
    from daedalus_operator.handlers import CHECKPOINTED_BEFORE_DELETION

    trainer = ControlTrainer((200, {"step": 21, "path": "/c/step-000021"}))
    try:
        rt = Runtime(settings=OperatorSettings(request_timeout=1.0), metrics=OperatorMetrics())
        rt.kube = SecretOnly("tok")
        body = _deleted_body()
        body["status"].update(attemptStartTime="yesterday", consecutiveFailures="many")
        outcome, _ = _until_decided(rt, body, _head(trainer), [0.0])
        assert (outcome.step, outcome.reason) == (21, CHECKPOINTED_BEFORE_DELETION)
        assert [path for path, _, _ in trainer.seen] == ["/stop"]
    finally:
        trainer.close()


@pytest.mark.parametrize("phase", ["Preempted", ["Running"]], ids=["unknown", "not-a-string"])
def test_an_unreadable_phase_gives_no_checkpoint_and_a_warning_at_once(phase) -> None:
    """A phase this operator cannot read (a newer version's, or not a string): whether a trainer runs is unknown. No
    request, no wait, and a Warning that names the value (before, an unknown phase was logged at info as "no trainer
    runs" and a list raised TypeError, which kopf retried with no bound)."""
    from daedalus_operator.handlers import NO_CHECKPOINT_BEFORE_DELETION, checkpoint_before_deletion

    trainer = ControlTrainer()
    try:
        rt = Runtime(settings=OperatorSettings(request_timeout=1.0), metrics=OperatorMetrics())
        rt.kube = SecretOnly("tok")
        outcome = checkpoint_before_deletion(rt, _deleted_body(phase), _head(trainer), None, 0.0)
        assert outcome.warning and outcome.reason == NO_CHECKPOINT_BEFORE_DELETION and outcome.step is None
        assert repr(phase) in outcome.message and "status.phase" in outcome.message
        assert trainer.seen == []
    finally:
        trainer.close()


def test_a_forgotten_checkpoint_call_records_nothing_when_it_ends_late() -> None:
    """The finalizer forgets the deletion's call when it releases; a trainer that answers after that (the call was
    still in flight at the bound) must not leave an entry behind for ever, nor overwrite a call started again."""
    from fake_kuberay import wait_for

    from daedalus_operator.plan import CheckpointCall
    from daedalus_operator.submit import CheckpointCalls, TrainerControl

    trainer = ControlTrainer((200, {"step": 3, "path": "/c/3"}), (200, {"step": 4, "path": "/c/4"}), delay=0.5)
    try:
        calls = CheckpointCalls()
        control = TrainerControl(f"http://127.0.0.1:{trainer.port}", token="tok", timeout=1.0)
        assert calls.start("k", control, 5.0, stop=True)
        calls.forget("k")
        wait_for(lambda: len(trainer.seen) == 1, timeout=5, message="the first request")
        time.sleep(1.0)  # it was answered after the forget
        assert calls.get("k") == CheckpointCall()  # nothing recorded
        assert calls.start("k", control, 5.0, stop=True)  # started again: only its own answer counts
        wait_for(lambda: calls.get("k").step is not None, timeout=5, message="the second answer")
        assert calls.get("k").step == 4
    finally:
        trainer.close()


class NoChildren:
    """The Kubernetes API as a finalizer meets it for a job whose children are gone or going: a GET answers
    ``cluster`` for the RayCluster (``None``: gone) and nothing else, every DELETE is recorded (the real API answers
    404 for a missing child, which KubeAPI.delete takes as done)."""

    def __init__(self, cluster: dict | None = None) -> None:
        self.deleted: list[tuple[str, str]] = []
        self.cluster = cluster

    def get(self, key: str, namespace: str, name: str) -> dict | None:
        return self.cluster if key.endswith("/rayclusters") else None

    def delete(self, key: str, namespace: str, name: str) -> None:
        self.deleted.append((key.split("/")[-1], name))


def _finished_calls(rt: Runtime, trainer: ControlTrainer, *started: tuple[str, str, str]) -> None:
    """Start one real background call per ``(key, owner, attempt)`` against ``trainer`` and wait until all ended."""
    from fake_kuberay import wait_for

    from daedalus_operator.submit import TrainerControl

    control = TrainerControl(f"http://127.0.0.1:{trainer.port}", token="tok", timeout=2.0)
    for key, owner, attempt in started:
        assert rt.calls.start(key, control, 5.0, owner=owner, attempt=attempt)
    wait_for(lambda: not any(rt.calls.get(k).in_flight for k, _, _ in started), timeout=10, interval=0.02,
             message="the calls to end")


def test_gather_keeps_only_the_current_attempts_checkpoint_calls() -> None:
    """A job on attempt 2: the entry of attempt 1's checkpoint call is dropped on the next reconcile's gather (it is
    never read again); attempt 2's stays and is what the planner sees; another job's entry is untouched."""
    from daedalus_operator.plan import CheckpointCall

    uid = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
    trainer = ControlTrainer(*[(200, {"step": n, "path": f"/c/{n}"}) for n in (4, 8, 9)])
    try:
        rt = _rt()
        _finished_calls(rt, trainer, ("local-tiny-0f1e2d3c-a1", uid, "local-tiny-0f1e2d3c-a1"))
        _finished_calls(rt, trainer, ("local-tiny-0f1e2d3c-a2", uid, "local-tiny-0f1e2d3c-a2"))
        _finished_calls(rt, trainer, ("other-a1", "uid-other", "other-a1"))  # one at a time: the answers in order
        doc = yaml.safe_load((ROOT / "examples" / "local-tiny.yaml").read_text())
        doc["metadata"].update(namespace="ml", uid=uid, generation=1)
        doc["status"] = {"phase": "Running", "attempt": 2, "submissionId": "local-tiny-0f1e2d3c-a2",
                         "submissionConfirmed": True, "attemptStartTime": "2026-01-01T00:00:00Z"}
        indexes = {"pods_by_job": None, "nodes_by_name": None, "clusters_by_job": None, "services_by_job": None}
        observed = gather(rt, job_view(doc), indexes)
        assert rt.calls.get("local-tiny-0f1e2d3c-a1") == CheckpointCall()
        assert observed.checkpoint_call.step == 8 and rt.calls.get("other-a1").step == 9 and len(rt.calls) == 2
    finally:
        trainer.close()


def test_finalizing_a_job_drops_all_its_checkpoint_calls() -> None:
    """The finalizer's release drops every entry of the job: earlier attempts', the current one's and the checkpoint
    before deletion's (before, only the current attempt's two were forgotten, so earlier attempts' stayed for ever)."""
    from daedalus_operator.handlers import deletion_checkpoint_key, finalize

    uid = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
    sid = "local-tiny-0f1e2d3c-a2"
    trainer = ControlTrainer(*[(200, {"step": n, "path": f"/c/{n}"}) for n in (1, 2, 3, 4)])
    try:
        rt = Runtime(settings=OperatorSettings(request_timeout=1.0), metrics=OperatorMetrics())
        rt.kube = NoChildren()
        _finished_calls(rt, trainer, ("local-tiny-0f1e2d3c-a1", uid, "local-tiny-0f1e2d3c-a1"), (sid, uid, sid),
                        (deletion_checkpoint_key(sid), uid, sid), ("other-a1", "uid-other", "other-a1"))
        body = _deleted_body("Succeeded")
        body["status"].update(attempt=2, submissionId=sid)
        finalize(rt, body, logging.getLogger("test"))
        assert ("rayclusters", "local-tiny-ray") in rt.kube.deleted
        assert len(rt.calls) == 1 and rt.calls.get("other-a1").step is not None
    finally:
        trainer.close()


def test_finalizing_a_job_drops_its_ray_client_and_unreadable_status_record() -> None:
    """Runtime.ray (Ray clients by dashboard URL) and Runtime.unreadable (the last StatusUnreadable report by uid)
    lose the deleted job's entries; other jobs' stay."""
    from daedalus_operator.handlers import finalize

    uid = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
    cluster = {"metadata": {"name": "local-tiny-ray", "namespace": "ml", "deletionTimestamp": "2026-01-01T00:00:01Z",
                            "ownerReferences": [{"kind": "RLTrainingJob", "name": "local-tiny", "uid": uid}]},
               "status": {"state": "ready", "head": {"serviceIP": "10.0.0.5"}}}
    rt = Runtime(settings=OperatorSettings(request_timeout=1.0), metrics=OperatorMetrics())
    rt.kube = NoChildren(cluster)
    mine, other = rt.ray_jobs("http://10.0.0.5:8265"), rt.ray_jobs("http://10.0.0.6:8265")
    assert mine is not other  # (clients are made lazily: no request to either address)
    rt.unreadable.update({uid: "41", "uid-other": "7"})
    finalize(rt, _deleted_body("Succeeded"), logging.getLogger("test"))
    assert list(rt.ray) == ["http://10.0.0.6:8265"] and rt.ray["http://10.0.0.6:8265"] is other
    assert rt.unreadable == {"uid-other": "7"}


def test_the_finalizer_deletes_the_jobs_children_and_leaves_objects_it_does_not_own() -> None:
    """Each child's name read back before its delete: the job's own RayService and NetworkPolicy and its Secret (one
    without a controller owner counts: a token replaced by hand) are deleted; a RayCluster and a ConfigMap of
    someone else and the budget of an earlier job of the same name are not (no Ray call to the foreign head
    either)."""
    from daedalus_operator.handlers import finalize

    uid = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
    mine = [{"kind": "RLTrainingJob", "name": "local-tiny", "uid": uid, "controller": True}]
    theirs = [{"kind": "Deployment", "name": "web", "uid": "1111", "controller": True}]
    earlier = [{"kind": "RLTrainingJob", "name": "local-tiny", "uid": "2222", "controller": True}]
    objects = {
        ("rayclusters", "local-tiny-ray"): {"metadata": {"name": "local-tiny-ray", "namespace": "ml",
                                                         "ownerReferences": theirs},
                                            "status": {"state": "ready", "head": {"serviceIP": "10.0.0.5"}}},
        ("configmaps", api.config_map_name("local-tiny")): {"metadata": {"ownerReferences": theirs}},
        ("secrets", api.secret_name("local-tiny")): {"metadata": {}},
        ("networkpolicies", api.network_policy_name("local-tiny")): {"metadata": {"ownerReferences": mine}},
        ("poddisruptionbudgets", api.disruption_budget_name("local-tiny")): {"metadata": {"ownerReferences": earlier}},
        ("rayservices", api.rayservice_name("local-tiny")): {"metadata": {"ownerReferences": mine}},
    }

    class Held(NoChildren):
        def get(self, key: str, namespace: str, name: str) -> dict | None:
            return objects.get((key.split("/")[-1], name))

    rt = Runtime(settings=OperatorSettings(request_timeout=1.0), metrics=OperatorMetrics())
    rt.kube = Held()
    asked: list[str] = []

    class Jobs:  # a Ray client double: records the heads asked to stop a job
        def __init__(self, url: str) -> None:
            self.url = url

        def stop(self, submission_id: str) -> bool:
            asked.append(self.url)
            return True

    rt.ray_jobs = lambda url, token=None: Jobs(url)
    body = _deleted_body("Succeeded")
    assert body["status"]["submissionId"]  # with the job's own ready RayCluster, finalize would stop it on its head
    finalize(rt, body, logging.getLogger("test"))
    assert sorted(rt.kube.deleted) == sorted([("rayservices", api.rayservice_name("local-tiny")),
                                              ("networkpolicies", api.network_policy_name("local-tiny")),
                                              ("secrets", api.secret_name("local-tiny"))])
    assert asked == []  # nothing was asked of the foreign head
    # the same RayCluster owned by the job: its Ray job is stopped there and it is deleted
    objects[("rayclusters", "local-tiny-ray")]["metadata"]["ownerReferences"] = mine
    rt.kube = Held()
    finalize(rt, body, logging.getLogger("test"))
    assert asked == ["http://10.0.0.5:8265"] and ("rayclusters", "local-tiny-ray") in rt.kube.deleted


def test_missing_workers_are_counted_against_the_raycluster_not_an_edited_spec() -> None:
    """The job's worker group is scaled from 1 to 2 replicas while attempt 1 runs on a RayCluster built with 1 (the
    operator never patches it). gather compares the pods with what that RayCluster asks for: head + 1 worker, both
    Ready, is healthy; no worker pod counts as missing, so the running attempt is not stopped for a WorkerLost that
    the cluster can never mend."""
    from daedalus_operator import resources
    from daedalus_operator.api import Reason

    doc = yaml.safe_load((ROOT / "examples" / "local-tiny.yaml").read_text())
    doc["metadata"].update(namespace="ml", uid="0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0", generation=1)
    doc["status"] = {"phase": "Running", "attempt": 1, "submissionId": "local-tiny-0f1e2d3c-a1",
                     "submissionConfirmed": True, "attemptStartTime": "2026-01-01T00:10:00Z", "currentStep": 5}
    built = resources.build_raycluster(job_view(doc), OperatorSettings())  # 1 worker replica
    built["metadata"]["creationTimestamp"] = "2026-01-01T00:00:00Z"
    doc["spec"]["cluster"]["workerGroups"][0]["replicas"] = 2
    job = job_view(doc)
    assert job.expected_pods == 3

    def pod(name: str, role: str) -> dict:
        return {"metadata": {"name": name, "namespace": "ml", "creationTimestamp": "2026-01-01T00:01:00Z",
                             "labels": {api.JOB_LABEL: "local-tiny", api.RAY_NODE_TYPE_LABEL: role}},
                "spec": {"nodeName": "node-a"},
                "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}

    node = {"metadata": {"name": "node-a"}, "spec": {}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    indexes = {"pods_by_job": Index({("ml", "local-tiny"): [pod("h", "head"), pod("w", "worker")]}),
               "nodes_by_name": Index({"node-a": [node]}),
               "clusters_by_job": Index({("ml", "local-tiny"): [built]}), "services_by_job": None}
    observed = gather(_rt(), job, indexes)  # no head address: the Ray job reads UNREACHABLE without a request
    assert observed.cluster.expected_pods == 2
    assert observed.health.lost_pods == () and observed.health.first_issue() is None
    # a RayCluster with 2 workers (created from the edited spec) and one of them gone: that one is missing
    built["spec"]["workerGroupSpecs"][0]["replicas"] = 2
    observed = gather(_rt(), job, indexes)
    assert observed.health.first_issue() == (Reason.WORKER_LOST, None,
                                             "worker pod (missing): fewer worker pods than the spec asks for")
    # the same RayCluster left by an earlier job of this name (same label, same name, another owner uid) is not
    # this job's: no cluster, so nothing is asked of its head and EnsureChildren's create names what holds the name
    assert observed.cluster.exists
    built["metadata"]["ownerReferences"][0]["uid"] = "2222"
    observed = gather(_rt(), job, indexes)
    assert not observed.cluster.exists and observed.cluster.dashboard_url is None


# ------------------------------------------------------------------------------------------------ PodDisruptionBudget
class BudgetAPI:
    """The PodDisruptionBudget calls of ``disruption_budget_once``, answered from a dict of names, or with the error
    ``fail`` (status, reason) while it is set; each call is recorded as ``(verb, name)``."""

    def __init__(self, *, fail: tuple[int, str] | None = None, exists: dict | None = None):
        self.fail = fail
        self.objects: dict[str, dict] = {}
        self.calls: list[tuple[str, str]] = []
        if exists is not None:
            self.objects[exists["metadata"]["name"]] = exists

    def get(self, key: str, namespace: str, name: str) -> dict | None:
        from daedalus_operator import kube

        assert key == kube.PDBS and namespace == "ml"
        self.calls.append(("get", name))
        return self.objects.get(name)

    def create(self, key: str, namespace: str, body: dict) -> dict:
        from daedalus_operator import kube

        assert key == kube.PDBS and namespace == "ml"
        name = body["metadata"]["name"]
        self.calls.append(("create", name))
        if self.fail:
            raise kube.KubeError(*self.fail, "refused")
        if name in self.objects:
            raise kube.KubeError(409, "AlreadyExists", "exists")
        self.objects[name] = body
        return body

    def delete(self, key: str, namespace: str, name: str) -> bool:
        from daedalus_operator import kube

        assert key == kube.PDBS and namespace == "ml"
        self.calls.append(("delete", name))
        if self.fail:
            raise kube.KubeError(*self.fail, "refused")
        return self.objects.pop(name, None) is not None


def _job_with(checkpoint_on_drain: bool):
    doc = yaml.safe_load((ROOT / "examples" / "local-tiny.yaml").read_text())
    doc["metadata"].update(namespace="ml", uid="0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0", generation=1)
    doc["spec"].setdefault("resilience", {})["checkpointOnDrain"] = checkpoint_on_drain
    return job_view(doc)


def test_the_disruption_budget_is_made_once_and_follows_the_field() -> None:
    from daedalus_operator.handlers import disruption_budget_once

    from daedalus_operator import resources

    rt, name = _rt(), api.disruption_budget_name("local-tiny")
    # an operator restart: the job's budget is there, one 409 and the read-back that finds it the job's, then nothing
    rt.kube = BudgetAPI(exists=resources.build_disruption_budget(_job_with(True)))
    for _ in range(3):
        disruption_budget_once(rt, _job_with(True))
    assert rt.kube.calls == [("create", name), ("get", name)]
    disruption_budget_once(rt, _job_with(False))
    disruption_budget_once(rt, _job_with(False))
    assert rt.kube.calls[2:] == [("delete", name)] and name not in rt.kube.objects
    disruption_budget_once(rt, _job_with(True))
    assert rt.kube.calls[3:] == [("create", name)]
    assert rt.kube.objects[name]["spec"]["minAvailable"] == 2
    # the RayCluster seen and then gone (suspended, deleted): forgotten, made again with the next one
    rt.children(_job_with(True).uid).note_cluster(True)
    rt.children(_job_with(True).uid).note_cluster(False)
    disruption_budget_once(rt, _job_with(True))
    assert rt.kube.calls[4:] == [("create", name), ("get", name)]  # still there here: 409, read back, the job's
    # a new process with checkpointOnDrain off: one GET (as many calls as a blind DELETE), the job's budget deleted
    rt = _rt()
    rt.kube = BudgetAPI(exists=resources.build_disruption_budget(_job_with(True)))
    disruption_budget_once(rt, _job_with(False))
    disruption_budget_once(rt, _job_with(False))
    assert rt.kube.calls == [("get", name), ("delete", name)] and not rt.kube.objects


def test_a_budget_of_that_name_the_job_does_not_own_is_left_alone() -> None:
    """Someone else's PodDisruptionBudget named ``<job>-ray``. With checkpointOnDrain on: not taken as the job's,
    ChildConflict names its owner (the caller logs it as a warning), looked at again only after
    BUDGET_CONFLICT_RETRY_SECONDS, and once its owner has deleted it the job's budget is made. With it off: not
    deleted, and nothing more to do (no error, no further call)."""
    from daedalus_operator import resources
    from daedalus_operator.handlers import BUDGET_CONFLICT_RETRY_SECONDS, ChildConflict, disruption_budget_once

    name = api.disruption_budget_name("local-tiny")
    foreign = resources.build_disruption_budget(_job_with(True))
    foreign["metadata"]["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "Deployment", "name": "web",
                                               "uid": "1111", "controller": True}]
    rt = _rt()
    rt.kube = BudgetAPI(exists=foreign)
    with pytest.raises(ChildConflict, match=r"PodDisruptionBudget ml/local-tiny-ray exists and is not this "
                                            r"job's \(Deployment web\)"):
        disruption_budget_once(rt, _job_with(True))
    disruption_budget_once(rt, _job_with(True))  # not looked at again on every reconcile
    assert rt.kube.objects[name] is foreign and rt.kube.calls == [("create", name), ("get", name)]
    # its owner deletes it; a minute later (BUDGET_CONFLICT_RETRY_SECONDS) the job's budget is made
    del rt.kube.objects[name]
    made = rt.children(_job_with(True).uid)
    assert made.budget is None and made.budget_conflict is not None
    made.budget_conflict -= BUDGET_CONFLICT_RETRY_SECONDS + 1
    disruption_budget_once(rt, _job_with(True))
    assert made.budget is True and made.budget_conflict is None
    assert rt.kube.objects[name]["metadata"]["ownerReferences"][0]["uid"] == _job_with(True).uid

    rt = _rt()
    rt.kube = BudgetAPI(exists=foreign)
    for _ in range(3):
        disruption_budget_once(rt, _job_with(False))
    assert rt.kube.objects[name] is foreign and rt.kube.calls == [("get", name)]
    assert rt.children(_job_with(False).uid).budget is False


def test_a_server_without_policy_v1_is_told_once_and_a_refusal_is_retried(caplog) -> None:
    from daedalus_operator import kube
    from daedalus_operator.handlers import disruption_budget_once

    rt = _rt()
    rt.kube = BudgetAPI(fail=(404, "NotFound"))  # Kubernetes 1.20: no policy/v1
    with caplog.at_level(logging.WARNING, logger="daedalus_operator.handlers"):
        disruption_budget_once(rt, _job_with(True))
        disruption_budget_once(rt, _job_with(True))
    assert len(rt.kube.calls) == 1
    assert [r.getMessage() for r in caplog.records if "does not serve policy/v1" in r.getMessage()] != []
    rt = _rt()
    rt.kube = BudgetAPI(fail=(403, "Forbidden"))  # RBAC not updated: an error, asked again next time
    for _ in range(2):
        with pytest.raises(kube.KubeError):
            disruption_budget_once(rt, _job_with(True))
    assert len(rt.kube.calls) == 2
    rt.kube.fail = None
    disruption_budget_once(rt, _job_with(True))
    assert len(rt.kube.calls) == 3 and rt.kube.objects


# ------------------------------------------------------------------------------------------------ serving
def test_a_rayservice_name_held_by_another_object_is_a_conflict_and_not_the_jobs_serving() -> None:
    """EnsureServing's create answered 409: the RayService is read back; the job's own (the index lagging) is
    fine, another's raises ChildConflict naming it. gather counts only a RayService the job owns as its serving."""
    from daedalus_operator import kube, resources
    from daedalus_operator.handlers import ChildConflict
    from daedalus_operator.plan import EnsureServing

    doc = yaml.safe_load((ROOT / "examples" / "hyperpod-qwen3vl-8b.yaml").read_text())
    doc["metadata"].update(namespace="ml", uid="0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0", generation=1,
                           annotations={resources.SERVING_LORA_URI_ANNOTATION: "s3://bucket/daedalus/exports/"})
    doc["spec"].setdefault("serving", {})["enabled"] = True
    job = job_view(doc)
    ours = resources.build_rayservice(job, job.serving_lora_uri)
    name = ours["metadata"]["name"]
    theirs = {**ours, "metadata": {**ours["metadata"], "ownerReferences": [
        {"apiVersion": "apps/v1", "kind": "Deployment", "name": "web", "uid": "1111", "controller": True}]}}

    class Existing:
        def __init__(self, body: dict) -> None:
            self.body, self.calls = body, []

        def create(self, key: str, namespace: str, body: dict) -> dict:
            self.calls.append(("create", key))
            raise kube.KubeError(409, "AlreadyExists", "exists")

        def get(self, key: str, namespace: str, got: str) -> dict | None:
            self.calls.append(("get", key))
            return self.body if got == name else None

    rt = _rt()
    observed = Observed(cluster=ClusterState())
    rt.kube = Existing(ours)
    execute(rt, job, observed, EnsureServing("/checkpoints/exports/adapter"), logging.getLogger("test"))
    assert rt.kube.calls == [("create", kube.RAYSERVICES), ("get", kube.RAYSERVICES)]
    rt.kube = Existing(theirs)
    with pytest.raises(ChildConflict, match=f"RayService ml/{name} exists and is not this job's \\(Deployment web\\)"):
        execute(rt, job, observed, EnsureServing("/checkpoints/exports/adapter"), logging.getLogger("test"))

    def serving_seen(body: dict) -> bool:
        indexes = {"pods_by_job": None, "nodes_by_name": None, "clusters_by_job": None,
                   "services_by_job": Index({("ml", job.name): [body]})}
        return gather(_rt(), job, indexes).serving_exists

    assert serving_seen(ours) and not serving_seen(theirs)
