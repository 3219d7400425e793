"""One operator test environment: the honest kmock API in a thread, the fake KubeRay, a real local Ray head (passed
in), and the Daedalus operator running for real (``daedalus_operator.main.run``: kopf's operator in a thread).

Swapping the trainer is one line: pass ``entrypoint=REAL_TRAINER`` instead of the default ``STANDIN_TRAINER``.
``{config}`` in an entrypoint is the config file the fake kubelet materialised from the job's ConfigMap.

Usage::

    env = OperatorEnv(tmp_path, ray_head).start()
    env.fake.add_node("node-a")
    env.apply(env.job_manifest())
    env.wait_phase("Running")
    ...
    env.stop()
"""

from __future__ import annotations

import copy
import os
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

import yaml
from fake_kuberay import FakeKubeRay, wait_for
from jobs import set_spec_fields
from kmock_api import KubeClient, KubeServer
from ray_head import RayHead, free_port

SUPPORT = Path(__file__).resolve().parent
ROOT = SUPPORT.parents[1]
RLTJ = "daedalus.dev/v1alpha1/rltrainingjobs"

#: The stand-in trainer (tests/support/standin_trainer.py); ``{step}`` is the seconds per step.
STANDIN_TRAINER = (f"env DAEDALUS_STANDIN_STEP_SECONDS={{step}} {sys.executable} {SUPPORT / 'standin_trainer.py'} "
                   "--config {config} --resume latest")
#: The real trainer (``daedalus train``): what the lead's end-to-end scenarios swap in.
REAL_TRAINER = f"{sys.executable} -m daedalus_trainer train --config {{config}} --resume latest"


def with_pod_env(entrypoint: str, volumes: Path) -> str:
    """``entrypoint`` behind ``pod_env.py``: the Ray job gets the head container's environment (the control token from
    the job's Secret) that the fake kubelet wrote under ``volumes/pod-env``, as on a cluster."""
    return f"{sys.executable} {SUPPORT / 'pod_env.py'} {volumes / 'pod-env'} -- {entrypoint}"


def stop_operator_thread(stop_flag: Any, thread: threading.Thread | None, timeout: float) -> None:
    """Set kopf's stop flag (if any) and join the operator thread (if any).

    Raises:
        RuntimeError: the thread did not stop within ``timeout`` seconds.
    """
    if stop_flag is not None:
        stop_flag.set()
    if thread is not None:
        thread.join(timeout)
        if thread.is_alive():
            raise RuntimeError("the operator did not stop")


class OperatorEnv:
    """See the module docstring.

    Args:
        tmp: a per-test temporary directory (volumes, checkpoints, kubeconfig live under it).
        ray_head: the running local Ray head (``None``: no Ray; the dashboard port then points nowhere).
        entrypoint: the Ray job entrypoint template (``{config}``; ``{step}`` for the stand-in's step time).
        step_seconds: the stand-in's seconds per step.
        poll: the operator's ``--poll-interval``.
        extra_args: more operator flags.
    """

    def __init__(self, tmp: Path, ray_head: RayHead | None, *, entrypoint: str = STANDIN_TRAINER, step_seconds: float = 0.3,
                 poll: float = 0.5, extra_args: tuple[str, ...] = ()):
        self.tmp = Path(tmp)
        self.ray = ray_head
        self.entrypoint = entrypoint.replace("{step}", f"{step_seconds:g}")
        self.poll = poll
        self.extra_args = tuple(extra_args)
        self.kube_server = KubeServer()
        self.kube: KubeClient | None = None
        self.fake: FakeKubeRay | None = None
        self.control_port = free_port()
        self.metrics_port = free_port()
        self.liveness_port = free_port()
        self.volumes = self.tmp / "pod-volumes"
        self.checkpoints = self.tmp / "checkpoints"
        self.kubeconfig = self.tmp / "kubeconfig"
        self._thread: threading.Thread | None = None
        self._stop: threading.Event | None = None
        self.runtime: Any = None
        self.operator_error: BaseException | None = None

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def start(self, *, operator: bool = True, fake_kuberay: bool = True) -> "OperatorEnv":
        self.volumes.mkdir(parents=True, exist_ok=True)
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        self.kube_server.start()
        self.kube_server.write_kubeconfig(self.kubeconfig)
        self.kube = self.kube_server.client()
        self.fake = FakeKubeRay(self.kube, dashboard_port=self.ray.dashboard_port if self.ray else free_port(),
                                volume_root=self.volumes)
        if fake_kuberay:
            self.fake.start()
        if operator:
            self.start_operator()
        return self

    @property
    def api(self):
        return self.kube_server.api

    def operator_args(self) -> list[str]:
        return ["--all-namespaces", "--standalone", "--kubeconfig", str(self.kubeconfig),
                "--poll-interval", str(self.poll), "--control-port", str(self.control_port),
                "--metrics-port", str(self.metrics_port), "--liveness", f"http://127.0.0.1:{self.liveness_port}/healthz",
                "--entrypoint", with_pod_env(self.entrypoint, self.volumes),
                "--config-dir", str(self.volumes / "etc-daedalus"), "--request-timeout", "3",
                "--unreachable-grace", "30",
                *(["--verbose"] if os.environ.get("DAEDALUS_TEST_VERBOSE") else []), *self.extra_args]

    def start_operator(self, timeout: float = 60.0) -> None:
        """Run the operator in a thread and wait until kopf is ready (liveness endpoint up)."""
        from daedalus_operator.main import run

        self._stop = threading.Event()
        ready = threading.Event()
        stop = self._stop

        def target() -> None:
            try:
                self.runtime = run(self.operator_args(), stop_flag=stop, ready_flag=ready)
            except BaseException as e:  # noqa: BLE001 - surfaced by the tests
                self.operator_error = e
                ready.set()

        self._thread = threading.Thread(target=target, name="daedalus-operator", daemon=True)
        self._thread.start()
        if not ready.wait(timeout):
            raise RuntimeError("the operator did not become ready")
        if self.operator_error:
            raise RuntimeError(f"the operator failed to start: {self.operator_error!r}")

    def stop_operator(self, timeout: float = 30.0) -> None:
        stop_operator_thread(self._stop, self._thread, timeout)
        self._thread = None

    def stop(self) -> None:
        try:
            self.stop_operator()
        finally:
            try:
                self.stop_ray_jobs()
            finally:
                if self.fake:
                    self.fake.stop()
                self.kube_server.stop()

    def stop_ray_jobs(self, timeout: float = 30.0) -> list[str]:
        """Stop every Ray job still running on the shared head and wait until each has ended (returns their ids).

        The head outlives each test: a trainer left running would keep its actors' CPUs and starve the next test's
        trainer (whose actors would then wait for resources, and the test for a first step, forever)."""
        if self.ray is None:
            return []
        from ray.job_submission import JobSubmissionClient

        client = JobSubmissionClient(self.ray.dashboard_url)
        live = [j.submission_id for j in client.list_jobs() if j.submission_id and not j.status.is_terminal()]
        for sid in live:
            client.stop_job(sid)
        deadline = time.monotonic() + timeout
        while live and time.monotonic() < deadline:
            if all(client.get_job_status(sid).is_terminal() for sid in live):
                break
            time.sleep(0.2)
        return live

    # -- jobs -------------------------------------------------------------------------------------------------------
    def job_manifest(self, name: str = "local-tiny", namespace: str = "ml", **spec_overrides: Any) -> dict:
        """``examples/local-tiny.yaml`` as a namespace-local variant: checkpoints under the test's tmp, short restart
        backoff; ``a__b=value`` overrides ``spec.a.b``."""
        doc = yaml.safe_load((ROOT / "examples" / "local-tiny.yaml").read_text())
        doc["metadata"] = {"name": name, "namespace": namespace}
        spec = doc["spec"]
        spec["checkpoint"]["path"] = str(self.checkpoints)
        spec["resilience"]["restartBackoffSeconds"] = 1
        set_spec_fields(spec, **spec_overrides)
        return doc

    def apply(self, manifest: dict) -> dict:
        """Create the RLTrainingJob, defaulted like the API server does with the generated CRD."""
        from daedalus_trainer.crd import apply_defaults, openapi_schema

        body = apply_defaults(openapi_schema(), copy.deepcopy(manifest))
        return self.kube.create(RLTJ, manifest["metadata"].get("namespace", "default"), body)

    def get_job(self, name: str = "local-tiny", namespace: str = "ml") -> dict | None:
        return self.kube.get(RLTJ, namespace, name)

    def status(self, name: str = "local-tiny", namespace: str = "ml") -> dict:
        return (self.get_job(name, namespace) or {}).get("status") or {}

    def wait_status(self, predicate: Callable[[dict], Any], timeout: float = 60.0, message: str = "status",
                    name: str = "local-tiny", namespace: str = "ml") -> dict:
        """The job's status once ``predicate`` holds; AssertionError after ``timeout`` seconds, with what the status,
        the events and the Ray head said then (:meth:`diagnosis`)."""
        try:
            return wait_for(lambda: (lambda st: st if predicate(st) else None)(self.status(name, namespace)),
                            timeout=timeout, message=message)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.diagnosis(name, namespace)}") from None

    def diagnosis(self, name: str = "local-tiny", namespace: str = "ml", log_chars: int = 3000) -> str:
        """What a timed-out wait should print: the job's status, its event reasons, and every Ray job on the head with
        its status, message and (for the job's current submission) the tail of its logs."""
        import json

        lines = []
        status: dict = {}
        try:
            status = self.status(name, namespace)
            lines.append(f"status: {json.dumps(status, sort_keys=True)[:4000]}")
            lines.append(f"events: {self.event_reasons(name=name, namespace=namespace)}")
        except Exception as exc:  # noqa: BLE001 - a diagnosis must not hide the failure it explains
            lines.append(f"status/events unavailable: {exc!r}")
        if self.ray is not None:
            try:
                from ray.job_submission import JobSubmissionClient

                client = JobSubmissionClient(self.ray.dashboard_url)
                current = status.get("submissionId")
                for job in client.list_jobs():
                    lines.append(f"ray job {job.submission_id}: {job.status.value} {job.message or ''}".rstrip())
                    if job.submission_id and job.submission_id == current:
                        lines.append("  log tail: " + client.get_job_logs(job.submission_id)[-log_chars:])
            except Exception as exc:  # noqa: BLE001
                lines.append(f"ray jobs unavailable: {exc!r}")
        return "\n".join(lines)

    def wait_phase(self, phase: str, timeout: float = 60.0, **kw: Any) -> dict:
        return self.wait_status(lambda st: st.get("phase") == phase, timeout, f"phase {phase}", **kw)

    def events(self, name: str = "local-tiny", namespace: str = "ml") -> list[dict]:
        return [e for e in self.kube.list("v1/events", namespace)
                if (e.get("involvedObject") or {}).get("name") == name]

    def event_reasons(self, **kw: Any) -> list[str]:
        return [e.get("reason") for e in sorted(self.events(**kw), key=lambda e: e["metadata"]["resourceVersion"]
                                                  .zfill(12))]

    def wait_event_reasons(self, *reasons: str, timeout: float = 20.0, **kw: Any) -> list[str]:
        """The job's event reasons in order, once every one of `reasons` is among them.

        kopf posts events from a background queue, so a status patch can be visible before the event recorded
        with it: read the list only after the awaited reasons arrived (AssertionError after `timeout` seconds).
        """

        if not reasons:
            return self.event_reasons(**kw)

        def arrived() -> list[str] | None:
            got = self.event_reasons(**kw)
            return got if all(r in got for r in reasons) else None

        return wait_for(arrived, timeout=timeout, message=f"events {list(reasons)}")

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def trainer_root(self, name: str = "local-tiny", namespace: str = "ml") -> Path:
        return self.checkpoints / namespace / name

    def steps_log(self, name: str = "local-tiny", namespace: str = "ml") -> list[dict]:
        import json

        path = self.trainer_root(name, namespace) / "steps.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def env_flag(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


def now() -> float:
    return time.time()
