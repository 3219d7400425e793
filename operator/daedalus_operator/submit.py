"""Talking to the job's Ray head: a small protocol over Ray's ``JobSubmissionClient`` and the trainer's control client.

:class:`RayJobs` - ``submit`` / ``status`` / ``stop`` / ``logs`` for one head (``http://<head>:8265``):

- ``submit`` uses the submission id decided by the planner; an id the head already knows means *already submitted*
  (Ray answers HTTP 500 "already exists" for a duplicate; docs/engineering-notes.md, "Ray job submission") and is
  never retried under a new id.
- every HTTP call has a timeout (Ray's client has none: a hung dashboard would block a handler forever), by overriding
  the client's request hook.
- ``status`` maps Ray's ``JobStatus`` onto :class:`~daedalus_operator.plan.RayJobState`, with ``NOT_FOUND`` for an
  unknown id (HTTP 404) and ``UNREACHABLE`` for connection errors and timeouts.

:class:`TrainerControl` - the trainer's HTTP endpoint on the head (port 9400): ``GET /status`` and the authenticated
``POST /checkpoint`` (``Authorization: Bearer <token>``; blocks until the checkpoint at the next step boundary is
written, answering ``{step, path, time}``; 401 without or with a wrong token) and ``POST /stop`` (the same, then the
trainer exits cleanly: no step runs after the checkpoint).

:class:`CheckpointCalls` - runs the blocking ``POST /checkpoint`` in a background thread per attempt, so a reconcile
never waits minutes for a step boundary; the planner reads the outcome as a
:class:`~daedalus_operator.plan.CheckpointCall`. The operator drops the entries of a job's earlier attempts on each
reconcile and all of a job's entries when it is deleted (:meth:`CheckpointCalls.retain`).

References: Ray Jobs REST API and Python SDK (https://docs.ray.io/en/latest/cluster/running-applications/job-submission/),
ray.job_submission.JobStatus.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
import time
from typing import Any

import requests
from ray.exceptions import AuthenticationError
from ray.job_submission import JobStatus, JobSubmissionClient

from daedalus_operator.plan import CheckpointCall, RayJobObservation, RayJobState, TrainerObservation

log = logging.getLogger(__name__)

_STATES = {
    JobStatus.PENDING: RayJobState.PENDING,
    JobStatus.RUNNING: RayJobState.RUNNING,
    JobStatus.SUCCEEDED: RayJobState.SUCCEEDED,
    JobStatus.FAILED: RayJobState.FAILED,
    JobStatus.STOPPED: RayJobState.STOPPED,
}


class RayUnreachable(RuntimeError):
    """The Ray dashboard did not answer (connection refused, timeout, DNS)."""


class RayUnauthorized(RayUnreachable):
    """The Ray dashboard refused the token (Ray token authentication, ``RAY_AUTH_MODE=token``: HTTP 401/403, Ray's
    ``AuthenticationError``). Handled as unreachable: a RayCluster whose pods started with another token (the job's
    Secret replaced since) is replaced after the unreachable grace period, and its new pods read the current one."""


#: HTTP header that carries a Ray token (Ray token authentication, Ray >= 2.52: ``Authorization: Bearer <token>``).
AUTHORIZATION = "Authorization"


class _TimeoutClient(JobSubmissionClient):
    """``JobSubmissionClient`` whose every HTTP request has a timeout (Ray 2.60's client passes none to requests)."""

    def __init__(self, address: str, timeout: float, headers: dict[str, str] | None = None):
        self._daedalus_timeout = timeout
        super().__init__(address, headers=headers)

    def _do_request(self, method: str, endpoint: str, **kwargs: Any) -> requests.Response:  # noqa: D401 - Ray's hook
        kwargs.setdefault("timeout", self._daedalus_timeout)
        return super()._do_request(method, endpoint, **kwargs)


@contextlib.contextmanager
def _timeout(client: JobSubmissionClient, seconds: float):
    """Temporarily use another per-request timeout on a :class:`_TimeoutClient` (one thread per client at a time)."""
    old = getattr(client, "_daedalus_timeout", None)
    client._daedalus_timeout = seconds
    try:
        yield
    finally:
        client._daedalus_timeout = old


@dataclasses.dataclass(frozen=True)
class SubmitResult:
    """``created`` is True when this call created the job, False when the id already existed."""

    submission_id: str
    created: bool


class RayJobs:
    """The Ray job protocol against one head's dashboard URL (``http://host:8265``).

    Args:
        dashboard_url: the head's dashboard / job API address.
        timeout: seconds per HTTP request (status, stop, logs, version check).
        submit_timeout: seconds for a submission (Ray answers once the job's supervisor actor runs: several seconds
            on a busy head).
        token: the Ray token (Ray token authentication: the RayCluster's containers run with ``RAY_AUTH_MODE=token``
            and ``RAY_AUTH_TOKEN`` from the job's Secret), sent as ``Authorization: Bearer``; a dashboard without
            token authentication ignores it. A refused token raises :class:`RayUnauthorized`.

    The underlying client is created lazily (its constructor already calls the head), so constructing a
    :class:`RayJobs` never blocks.
    """

    def __init__(self, dashboard_url: str, timeout: float = 5.0, submit_timeout: float = 60.0,
                 token: str | None = None):
        self.url = dashboard_url.rstrip("/")
        self.timeout = timeout
        self.submit_timeout = submit_timeout
        #: The Ray token sent with every request (``Authorization: Bearer``), the job's Secret's; None: no header.
        self.token = token
        self._client: JobSubmissionClient | None = None
        self._lock = threading.Lock()

    def _unauthorized(self, exc: Exception) -> RayUnauthorized:
        which = "the job's token" if self.token else "a request without a token"
        return RayUnauthorized(f"Ray dashboard {self.url} refused {which} ({exc}); the RayCluster's pods read the "
                               "token from the job's Secret when they started")

    def _c(self) -> JobSubmissionClient:
        with self._lock:
            if self._client is None:
                headers = {AUTHORIZATION: f"Bearer {self.token}"} if self.token else None
                try:
                    self._client = _TimeoutClient(self.url, self.timeout, headers)
                except AuthenticationError as exc:
                    raise self._unauthorized(exc) from exc
                except (ConnectionError, requests.RequestException) as exc:
                    raise RayUnreachable(f"Ray dashboard {self.url} unreachable: {exc}") from exc
            return self._client

    def _call(self, fn, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except AuthenticationError as exc:
            raise self._unauthorized(exc) from exc
        except (ConnectionError, requests.RequestException) as exc:
            with self._lock:
                self._client = None  # reconnect (and re-check the version) next time
            raise RayUnreachable(f"Ray dashboard {self.url} unreachable: {exc}") from exc

    def submit(self, submission_id: str, entrypoint: str, *, env_vars: dict[str, str] | None = None,
               metadata: dict[str, str] | None = None) -> SubmitResult:
        """Submit ``entrypoint`` as ``submission_id`` (runtime_env ``env_vars``). An existing id is *already
        submitted*: ``created=False``, nothing else happens.

        Raises:
            RayUnreachable: the dashboard did not answer.
            RuntimeError: Ray refused the job for another reason (the message says why).
        """
        client = self._c()
        try:
            with _timeout(client, self.submit_timeout):
                self._call(client.submit_job, entrypoint=entrypoint, submission_id=submission_id,
                           runtime_env={"env_vars": dict(env_vars or {})}, metadata=dict(metadata or {}))
            log.info("submitted Ray job %s to %s", submission_id, self.url)
            return SubmitResult(submission_id, created=True)
        except RuntimeError as exc:
            if isinstance(exc, RayUnreachable):
                raise
            if self.status(submission_id).state != RayJobState.NOT_FOUND:
                log.info("Ray job %s already submitted to %s", submission_id, self.url)
                return SubmitResult(submission_id, created=False)
            raise

    def status(self, submission_id: str) -> RayJobObservation:
        """The job's state and message; ``NOT_FOUND`` for an unknown id, ``UNREACHABLE`` when the dashboard does not
        answer (never raises for those)."""
        try:
            info = self._call(self._c().get_job_info, submission_id)
        except RayUnreachable as exc:
            return RayJobObservation(RayJobState.UNREACHABLE, str(exc), unauthorized=isinstance(exc, RayUnauthorized))
        except RuntimeError as exc:
            if "status code 404" in str(exc):
                return RayJobObservation(RayJobState.NOT_FOUND, "")
            return RayJobObservation(RayJobState.UNREACHABLE, str(exc))
        return RayJobObservation(_STATES.get(info.status, RayJobState.UNREACHABLE), info.message or "")

    def stop(self, submission_id: str) -> bool:
        """Ask Ray to stop the job (SIGTERM, then SIGKILL after Ray's grace period). True when it was running;
        False when it had already ended or is unknown.

        Raises:
            RayUnreachable: the dashboard did not answer.
            RuntimeError: the dashboard answered with an error other than 404 (the message says which).
        """
        try:
            return bool(self._call(self._c().stop_job, submission_id))
        except RayUnreachable:
            raise
        except RuntimeError as exc:
            if "status code 404" in str(exc):
                return False
            raise

    def logs(self, submission_id: str, tail_chars: int = 4000) -> str:
        """The last ``tail_chars`` characters of the job's driver log ('' when unknown or unreachable)."""
        try:
            return (self._call(self._c().get_job_logs, submission_id) or "")[-tail_chars:]
        except (RuntimeError, RayUnreachable):
            return ""


# ------------------------------------------------------------------------------------------------ trainer control
class ControlError(RuntimeError):
    """A control call failed; ``status`` is the HTTP status (0 when the trainer did not answer)."""

    def __init__(self, message: str, status: int = 0):
        super().__init__(message)
        self.status = status


class TrainerControl:
    """Client of the trainer's endpoint ``http://<head>:<port>``.

    Args:
        base_url: e.g. ``http://10.0.0.5:9400``.
        token: the control token (the job's Secret), needed for POST routes.
        timeout: seconds for ``GET /status``.
    """

    def __init__(self, base_url: str, token: str | None = None, timeout: float = 5.0):
        self.url = base_url.rstrip("/")
        self.token = token
        self.timeout = timeout

    def status(self) -> TrainerObservation:
        """``GET /status`` as a :class:`TrainerObservation`; ``reachable=False`` on any connection error or non-200."""
        try:
            r = requests.get(f"{self.url}/status", timeout=self.timeout)
        except requests.RequestException:
            return TrainerObservation()
        if r.status_code != 200:
            return TrainerObservation()
        try:
            return TrainerObservation.from_status(r.json())
        except ValueError:
            return TrainerObservation()

    def _post(self, route: str, wait_seconds: float) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            r = requests.post(f"{self.url}{route}", params={"timeout": f"{wait_seconds:g}"}, headers=headers,
                              timeout=wait_seconds + self.timeout)
        except requests.RequestException as exc:
            raise ControlError(f"trainer {self.url} did not answer: {exc}") from exc
        if r.status_code != 200:
            raise ControlError(f"POST {route}: HTTP {r.status_code}: {r.text[:300]}", r.status_code)
        return r.json()

    def checkpoint(self, wait_seconds: float = 300.0) -> dict[str, Any]:
        """``POST /checkpoint?timeout=<wait_seconds>``: blocks until the trainer wrote a checkpoint at its next step
        boundary and returns ``{step, path, time}``.

        ``wait_seconds``: how long the trainer waits for a step boundary (seconds); the HTTP request may take that
        plus the client's ``timeout``.

        Raises:
            ControlError: no answer (status 0), 401 (token), 409 (the trainer already ended), 500 (save failed),
                504 (no step boundary within the wait).
            ValueError: an answer with status 200 whose body is not JSON (``requests``' ``JSONDecodeError``).
        """
        return self._post("/checkpoint", wait_seconds)

    def stop(self, wait_seconds: float = 300.0) -> dict[str, Any]:
        """``POST /stop?timeout=<wait_seconds>``: the trainer checkpoints at its next step boundary and then exits
        cleanly (no step runs after the checkpoint); returns ``{step, path, time, stopping}`` once it is written.

        Raises:
            ControlError: as :meth:`checkpoint`.
        """
        return self._post("/stop", wait_seconds)


#: Most entries :attr:`CheckpointCalls.started` keeps (the oldest go first).
STARTED_KEEP = 256


class CheckpointCalls:
    """Background ``POST /checkpoint`` calls, one per key (the submission id). Thread-safe.

    ``start`` does nothing while a call for the key is in flight or has already succeeded; a failed call may be
    started again. ``get`` reports the state as a :class:`~daedalus_operator.plan.CheckpointCall`.

    Entries are kept until dropped: :meth:`forget` drops one key, :meth:`retain` every entry of one owner (a job's
    uid, given to :meth:`start`) that belongs to another attempt than the current one, so an operator that sees many
    jobs and restarts holds about one entry per live job. ``started`` keeps the last :data:`STARTED_KEEP` starts.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[str, CheckpointCall] = {}
        self._owners: dict[str, tuple[str, str]] = {}  # key -> (owner, attempt), for the keys started with an owner
        self._keys: dict[str, set[str]] = {}  # owner -> its keys (retain() looks at one job's entries only)
        self._dropping: set[str] = set()  # in-flight keys retain() dropped: removed when their call ends
        #: (key, time.monotonic()) of the latest starts, for diagnostics and tests; at most STARTED_KEEP.
        self.started: collections.deque[tuple[str, float]] = collections.deque(maxlen=STARTED_KEEP)

    def __len__(self) -> int:
        """Entries held (in flight, succeeded or failed), those :meth:`retain` marked and still in flight included."""
        with self._lock:
            return len(self._calls)

    def start(self, key: str, control: TrainerControl, wait_seconds: float, *, stop: bool = False,
              owner: str | None = None, attempt: str | None = None) -> bool:
        """Start a call (``POST /stop`` when ``stop``, else ``POST /checkpoint``, waiting up to ``wait_seconds``
        seconds for the trainer's step boundary, see :meth:`TrainerControl.checkpoint`) unless one is in flight or
        done; True when a new call was started. ``owner`` (the job's uid) and ``attempt`` (its submission id;
        default ``key``) are what :meth:`retain` matches; a call started without an owner is dropped only by
        :meth:`forget`."""
        with self._lock:
            cur = self._calls.get(key)
            if cur is not None and (cur.in_flight or cur.step is not None):
                return False
            placeholder = self._calls[key] = CheckpointCall(in_flight=True)
            self._unown(key)
            if owner is not None:
                self._owners[key] = (owner, attempt if attempt is not None else key)
                self._keys.setdefault(owner, set()).add(key)
            self.started.append((key, time.monotonic()))

        def run() -> None:
            try:
                doc = control.stop(wait_seconds) if stop else control.checkpoint(wait_seconds)
                result = CheckpointCall(step=int(doc["step"]), path=str(doc.get("path", "")))
            except ControlError as exc:
                result = CheckpointCall(error=str(exc), http_status=exc.status)
            except (KeyError, TypeError, ValueError) as exc:  # an answer without a usable {step, path}
                result = CheckpointCall(error=str(exc))
            with self._lock:
                if self._calls.get(key) is placeholder:  # else forgotten meanwhile (and maybe started again)
                    if key in self._dropping:  # retain() dropped it while in flight
                        self._drop(key)
                    else:
                        self._calls[key] = result
            log.info("checkpoint call %s: %s", key, result)

        threading.Thread(target=run, name=f"checkpoint-{key}", daemon=True).start()
        return True

    def get(self, key: str | None) -> CheckpointCall:
        """The call's state for ``key`` (an empty :class:`CheckpointCall` when none was made)."""
        with self._lock:
            return self._calls.get(key or "", CheckpointCall())

    def _unown(self, key: str) -> None:  # under self._lock
        who, _ = self._owners.pop(key, (None, None))
        if who is not None:
            keys = self._keys[who]
            keys.discard(key)
            if not keys:
                del self._keys[who]

    def _drop(self, key: str) -> None:  # under self._lock
        self._calls.pop(key, None)
        self._unown(key)
        self._dropping.discard(key)

    def forget(self, key: str) -> None:
        """Drop the record of ``key`` (the attempt is over). A call still in flight then records nothing when it
        ends (no entry kept for ever after a deletion whose trainer answered late)."""
        with self._lock:
            self._drop(key)

    def retain(self, owner: str, keep: str | None) -> None:
        """Drop every entry of ``owner`` (a job's uid) whose attempt is not ``keep`` (its current submission id;
        ``None``: the job is gone, drop them all). An entry whose call is in flight is marked instead: it still
        reads as in flight (so no second request goes to that trainer meanwhile) and is removed when its call ends.
        A marked entry of the attempt kept again is unmarked. Entries of other owners and those started without an
        owner are left alone."""
        with self._lock:
            for key in list(self._keys.get(owner, ())):
                _, attempt = self._owners[key]
                if keep is not None and attempt == keep:
                    self._dropping.discard(key)
                elif self._calls.get(key, CheckpointCall()).in_flight:
                    self._dropping.add(key)
                else:
                    self._drop(key)
