"""The trainer's HTTP endpoint (default port 9400): metrics, health, status and the operator's control calls.

Routes:

- ``GET /metrics``: Prometheus exposition of :class:`~daedalus_trainer.metrics.TrainerMetrics` (text 0.0.4, or
  OpenMetrics when the scraper asks for it in ``Accept``).
- ``GET /healthz``: ``200 ok`` while the server thread runs.
- ``GET /status``: JSON ``{step, totalSteps, phase, latestCheckpoint {step, path, time}, successRatio, rewardMean,
  adapterPath, attempt, resumedFrom, failureReason, checkpointRequested, stopRequested}`` (``time`` is RFC 3339 UTC,
  as in the CR status; ``resumedFrom`` is the step of the checkpoint this run resumed from, ``null`` on a fresh start;
  ``failureReason`` is why the run failed, ``"<ExceptionType>: <first line>"``, while ``phase`` is ``failed``, else
  ``null``; every field served is listed here, which a test checks against a running server).
- ``POST /checkpoint[?timeout=SECONDS]``: ask for a checkpoint at the next step boundary and wait (default 300 s)
  until it is written: ``200 {step, path, time}``. ``timeout=0`` returns ``202`` at once. When a held-out evaluation
  (``algorithm.evalIntervalSteps``) is due at that boundary, the checkpoint is written and answered before it; one
  that arrives while an evaluation runs is written and answered without waiting for its end (the loop looks every
  0.2 s).
- ``POST /stop[?timeout=SECONDS]``: ask the loop to checkpoint and exit cleanly; waits like ``/checkpoint`` and
  returns ``200 {step, path, time, stopping: true}`` once the final checkpoint is written (an evaluation due at that
  boundary is skipped, one in progress abandoned; the resumed run makes it up before its first step). The operator
  calls it before stopping the Ray job (DESIGN §3, HyperPod node replacement).

``POST`` routes require ``Authorization: Bearer <token>``; the token comes from ``DAEDALUS_CONTROL_TOKEN`` or the
file named by ``DAEDALUS_CONTROL_TOKEN_FILE`` (the operator's Secret), is compared in constant time
(:func:`hmac.compare_digest`), and is read per request (a replaced token file takes effect at once; the operator
passes the token in the environment, so a new one reaches the trainer with its next RayCluster). Responses: 401 without
or with a wrong token (with ``WWW-Authenticate: Bearer``), 503 when no token is configured, 504 when the wait times
out (the request stays pending and is still honoured), 409 when the trainer has already finished, stopped or failed
(also for a caller that was waiting when it did; a failure's message ends with its ``failureReason``), 500 when the
save failed.

Why the standard library's :class:`http.server.ThreadingHTTPServer` rather than aiohttp: the training loop is
synchronous torch code with no event loop to share, a blocking ``POST /checkpoint`` maps directly onto a thread
waiting on a :class:`threading.Condition`, the request rate is a scrape every few seconds plus rare control calls, and
it adds no dependency to the trainer image (prometheus-client's own ``start_http_server`` uses the same server).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hmac
import http.server
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, get_args
from urllib.parse import parse_qs, urlsplit

from prometheus_client.exposition import choose_encoder

from .metrics import TrainerMetrics

__all__ = [
    "DEFAULT_PORT",
    "DEFAULT_WAIT_SECONDS",
    "MAX_WAIT_SECONDS",
    "TOKEN_ENV",
    "TOKEN_FILE_ENV",
    "CheckpointResult",
    "ControlState",
    "Phase",
    "TrainerServer",
    "load_control_token",
]

log = logging.getLogger(__name__)

DEFAULT_PORT = 9400
TOKEN_ENV = "DAEDALUS_CONTROL_TOKEN"
TOKEN_FILE_ENV = "DAEDALUS_CONTROL_TOKEN_FILE"
DEFAULT_WAIT_SECONDS = 300.0
MAX_WAIT_SECONDS = 3600.0
#: Socket timeout of a control/metrics connection, seconds (a stalled request body, an idle keep-alive connection).
SOCKET_TIMEOUT_SECONDS = 30.0

Phase = Literal["starting", "sft", "training", "evaluating", "checkpointing", "finished", "stopped", "failed"]
"""Trainer phases in ``/status``. ``stopped``: left the loop on ``POST /stop`` after a checkpoint (the operator
resubmits with ``resume: latest``); ``finished``: all steps done; ``failed``: the loop raised."""
PHASES: tuple[str, ...] = get_args(Phase)
_TERMINAL = ("finished", "stopped", "failed")


def load_control_token(environ: Mapping[str, str] | None = None) -> str | None:
    """The control token: ``$DAEDALUS_CONTROL_TOKEN`` if set and non-empty, else the stripped content of the file
    named by ``$DAEDALUS_CONTROL_TOKEN_FILE``; ``None`` when neither gives a non-empty token.

    An unreadable token file is logged and treated as "not configured" (the control routes then answer 503).
    """
    env = os.environ if environ is None else environ
    token = env.get(TOKEN_ENV, "").strip()
    if token:
        return token
    path = env.get(TOKEN_FILE_ENV, "").strip()
    if not path:
        return None
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        log.warning("control token file %s (from %s) is unreadable: %s", path, TOKEN_FILE_ENV, e)
        return None
    return token or None


def _rfc3339(unix_seconds: float) -> str:
    return _dt.datetime.fromtimestamp(unix_seconds, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclasses.dataclass(frozen=True)
class CheckpointResult:
    """Outcome of a requested checkpoint handed to waiting HTTP callers: ``step``/``path``/``time`` (Unix seconds)
    on success, or ``error`` (a message) when the save failed (``ended`` False, HTTP 500) or the trainer finished or
    failed first (``ended`` True, HTTP 409)."""

    step: int | None = None
    path: str | None = None
    time: float | None = None
    error: str | None = None
    ended: bool = False


class ControlState:
    """Thread-safe state shared by the training loop and the HTTP server.

    The loop, at every step boundary::

        if control.stop_requested() or control.checkpoint_requested() or step % interval == 0:
            control.set_status(phase="checkpointing")
            try:
                info = manager.save(...)
            except CheckpointSaveError as e:
                control.checkpoint_failed(str(e)); raise
            control.checkpoint_done(info)
            if control.stop_requested():
                control.set_status(phase="stopped"); break
            control.set_status(phase="training")

    ``checkpoint_done`` answers every caller that asked before it (several concurrent requests coalesce into one
    checkpoint). A loop whose saves are asynchronous passes ``upto``, :meth:`request_seq` read when the save was
    queued: a request that arrived while an older save was still being written is then answered by the next save,
    not by that older one (which predates it). Entering a terminal phase (``finished``/``stopped``/``failed``) answers
    pending callers with an error (HTTP 409).
    """

    def __init__(self, *, total_steps: int = 0, attempt: int = 0) -> None:
        # Re-entrant: a signal handler (grpo.StopOnSignal) calls request_checkpoint on the main thread, which may be
        # holding this lock at that moment; a plain Lock would deadlock there.
        self._cond = threading.Condition(threading.RLock())
        self._checkpoint_requested = False
        self._stop_requested = False
        self._request_seq = 0  # number of requests so far
        self._answered_seq = 0  # requests up to this number have a result
        self._results: dict[int, CheckpointResult] = {}  # answered_seq at answer time -> result
        self._status: dict[str, Any] = {
            "step": 0,
            "totalSteps": total_steps,
            "phase": "starting",
            "latestCheckpoint": None,
            "successRatio": None,
            "rewardMean": None,
            "adapterPath": None,
            "attempt": attempt,
            "resumedFrom": None,
            "failureReason": None,
        }

    # -- for the training loop ---------------------------------------------------------------------------------------

    def checkpoint_requested(self) -> bool:
        """True while a checkpoint was requested over HTTP (or a stop, which implies one) and not yet written."""
        with self._cond:
            return self._checkpoint_requested or self._stop_requested

    def stop_requested(self) -> bool:
        """True once ``POST /stop`` was received: checkpoint, then leave the loop."""
        with self._cond:
            return self._stop_requested

    def unanswered(self) -> bool:
        """True while a checkpoint or stop request has no answer yet (unlike :meth:`checkpoint_requested`, which
        stays True after a stop's checkpoint was written)."""
        with self._cond:
            return self._answered_seq < self._request_seq

    def request_seq(self) -> int:
        """The number of checkpoint/stop requests received so far: read it when a save is queued and pass it as
        ``upto`` to :meth:`checkpoint_done` / :meth:`checkpoint_failed`."""
        with self._cond:
            return self._request_seq

    def checkpoint_done(self, info: Any, upto: int | None = None) -> None:
        """Report a written checkpoint (any object with ``step``, ``path``, ``time`` in Unix seconds, e.g.
        ``CheckpointInfo``): updates ``latestCheckpoint`` and answers the callers whose request it covers, every one
        so far or, with ``upto``, those up to that :meth:`request_seq`. The request flag is cleared once no request
        is left unanswered."""
        result = CheckpointResult(step=int(info.step), path=str(info.path), time=float(info.time))
        with self._cond:
            self._status["latestCheckpoint"] = {"step": result.step, "path": result.path,
                                                "time": _rfc3339(result.time)}
            self._answer_locked(result, upto)

    def checkpoint_failed(self, message: str, upto: int | None = None) -> None:
        """Report that a save failed: the callers it covers (as in :meth:`checkpoint_done`) get HTTP 500 with
        ``message``; the request flag is cleared once none is left (a caller may ask again)."""
        with self._cond:
            self._answer_locked(CheckpointResult(error=message), upto)

    def set_status(
        self,
        *,
        step: int | None = None,
        total_steps: int | None = None,
        phase: Phase | None = None,
        success_ratio: float | None = None,
        reward_mean: float | None = None,
        adapter_path: str | os.PathLike[str] | None = None,
        attempt: int | None = None,
        latest_checkpoint: Any | None = None,
        resumed_from: int | None = None,
        failure_reason: str | None = None,
    ) -> None:
        """Update the fields given (others keep their value). ``latest_checkpoint`` (an object with ``step``,
        ``path``, ``time``) sets ``latestCheckpoint`` without answering waiters (e.g. the checkpoint a run resumed
        from). ``failure_reason`` (only with ``phase="failed"``) says why, as ``failureReason``; any other phase
        clears it. Entering ``finished``, ``stopped`` or ``failed`` answers pending checkpoint callers with an error
        (HTTP 409) that ends with the failure reason, when there is one.

        Raises:
            ValueError: unknown ``phase``, a ratio outside [0, 1], or ``failure_reason`` without ``phase="failed"``.
        """
        if phase is not None and phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        if failure_reason is not None and phase != "failed":
            raise ValueError(f"failure_reason goes with phase='failed', got phase={phase!r}")
        if success_ratio is not None and not 0.0 <= success_ratio <= 1.0:
            raise ValueError(f"success_ratio must be in [0, 1], got {success_ratio}")
        with self._cond:
            for key, value in (("step", step), ("totalSteps", total_steps), ("phase", phase),
                               ("successRatio", success_ratio), ("rewardMean", reward_mean), ("attempt", attempt),
                               ("resumedFrom", resumed_from)):
                if value is not None:
                    self._status[key] = value
            if phase is not None:
                self._status["failureReason"] = failure_reason
            if adapter_path is not None:
                self._status["adapterPath"] = str(adapter_path)
            if latest_checkpoint is not None:
                self._status["latestCheckpoint"] = {"step": int(latest_checkpoint.step),
                                                    "path": str(latest_checkpoint.path),
                                                    "time": _rfc3339(float(latest_checkpoint.time))}
            if phase in _TERMINAL and self._answered_seq < self._request_seq:
                self._answer_locked(CheckpointResult(
                    error=f"trainer {phase} before the checkpoint was written{self._because_locked()}", ended=True))

    def _because_locked(self) -> str:
        """``": <failureReason>"`` while there is one, else ``""`` (the end of a 409 message)."""
        reason = self._status["failureReason"]
        return f": {reason}" if reason else ""

    def status(self) -> dict[str, Any]:
        """A JSON-ready snapshot for ``GET /status`` (its fields are listed in this module's docstring). NaN/inf
        ratios are reported as ``null``."""
        with self._cond:
            doc = dict(self._status)
            doc["checkpointRequested"] = self._checkpoint_requested or self._stop_requested
            doc["stopRequested"] = self._stop_requested
        for key in ("successRatio", "rewardMean"):
            if isinstance(doc[key], float) and not math.isfinite(doc[key]):
                doc[key] = None
        return doc

    # -- for the HTTP server -----------------------------------------------------------------------------------------

    def request_checkpoint(self, *, stop: bool = False) -> int:
        """Register a request (and a stop if ``stop``); returns a ticket for :meth:`wait`.

        Raises:
            RuntimeError: the trainer is already ``finished``, ``stopped`` or ``failed`` (the message ends with the
                failure reason, when there is one).
        """
        with self._cond:
            if self._status["phase"] in _TERMINAL:
                raise RuntimeError(f"trainer already {self._status['phase']}{self._because_locked()}")
            self._request_seq += 1
            if stop:
                self._stop_requested = True
            else:
                self._checkpoint_requested = True
            self._cond.notify_all()
            return self._request_seq

    def wait(self, ticket: int, timeout: float) -> CheckpointResult | None:
        """Block until the request ``ticket`` is answered, at most ``timeout`` seconds; ``None`` on timeout (the
        request stays pending)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._answered_seq < ticket:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)
            # The first answer given at or after this ticket (it covered every request up to its key).
            answered = [seq for seq in self._results if seq >= ticket]
            if not answered:  # pruned: only after 64 later answers; report as a failure rather than guess
                return CheckpointResult(error="checkpoint result no longer available")
            return self._results[min(answered)]

    def _answer_locked(self, result: CheckpointResult, upto: int | None = None) -> None:
        covered = self._request_seq if upto is None else min(int(upto), self._request_seq)
        if covered >= self._request_seq:
            self._checkpoint_requested = False
        if self._answered_seq < covered:
            self._answered_seq = covered
            self._results[self._answered_seq] = result
            # Keep only answers a waiter may still need (bounded memory under repeated requests).
            if len(self._results) > 64:
                for seq in sorted(self._results)[:-64]:
                    del self._results[seq]
        self._cond.notify_all()


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    server_version = "daedalus-trainer"
    #: Seconds a connection may sit silent mid-request or idle between keep-alive requests (socketserver sets it on
    #: the socket): a client that announces a body and never sends it cannot hold a handler thread for ever.
    timeout = SOCKET_TIMEOUT_SECONDS

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug("%s - %s", self.address_string(), format % args)

    # -- plumbing ----------------------------------------------------------------------------------------------------

    def _send(self, code: int, body: bytes, content_type: str, headers: Mapping[str, str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        if self.close_connection:
            self.send_header("Connection", "close")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, code: int, doc: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> None:
        self._send(code, (json.dumps(doc) + "\n").encode("utf-8"), "application/json", headers)

    def _drain_body(self) -> None:
        """Read and ignore a request body (the control routes take none) so the keep-alive connection stays in
        sync; close the connection instead when the length is bad or over 1 MiB."""
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if 0 <= length <= 1 << 20:
            if length:
                self.rfile.read(length)
        else:
            self.close_connection = True

    # -- routes ------------------------------------------------------------------------------------------------------

    def do_GET(self) -> None:  # noqa: N802 - stdlib naming
        path = urlsplit(self.path).path
        if path == "/metrics":
            encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
            self._send(200, encoder(self.server.metrics.registry), content_type)
        elif path == "/healthz":
            self._send(200, b"ok\n", "text/plain; charset=utf-8")
        elif path == "/status":
            self._json(200, self.server.control.status())
        elif path in ("/checkpoint", "/stop"):
            self._json(405, {"error": f"use POST {path}"}, {"Allow": "POST"})
        else:
            self._json(404, {"error": f"no route {path}", "routes": ["/metrics", "/healthz", "/status",
                                                                     "POST /checkpoint", "POST /stop"]})

    do_HEAD = do_GET

    def do_POST(self) -> None:  # noqa: N802 - stdlib naming
        url = urlsplit(self.path)
        if url.path not in ("/checkpoint", "/stop"):
            self.close_connection = True  # the body is never read
            if url.path in ("/metrics", "/healthz", "/status"):
                self._json(405, {"error": f"use GET {url.path}"}, {"Allow": "GET, HEAD"})
            else:
                self._json(404, {"error": f"no route {url.path}"})
            return
        self.close_connection = True  # until the caller is authorised: an unauthenticated body is never read
        if not self._authorised():
            return
        self.close_connection = False
        self._drain_body()
        try:
            timeout = self._timeout(url.query)
        except ValueError as e:
            self._json(400, {"error": str(e)})
            return
        stop = url.path == "/stop"
        control = self.server.control
        try:
            ticket = control.request_checkpoint(stop=stop)
        except RuntimeError as e:
            self._json(409, {"error": str(e), "latestCheckpoint": control.status()["latestCheckpoint"]})
            return
        log.info("%s requested over HTTP by %s (waiting up to %.0f s)", url.path[1:], self.address_string(), timeout)
        if timeout == 0:
            self._json(202, {"requested": True, "stopping": stop})
            return
        result = control.wait(ticket, timeout)
        if result is None:
            self._json(504, {"error": f"no checkpoint written within {timeout:g} s; the request stays pending",
                             "requested": True, "stopping": stop})
        elif result.error is not None:
            self._json(409 if result.ended else 500, {"error": result.error, "stopping": stop})
        else:
            assert result.time is not None
            self._json(200, {"step": result.step, "path": result.path, "time": _rfc3339(result.time),
                             "stopping": stop})

    # -- helpers -----------------------------------------------------------------------------------------------------

    def _authorised(self) -> bool:
        expected = self.server.token_source()
        if not expected:
            self._json(503, {"error": f"control token not configured (set {TOKEN_ENV} or {TOKEN_FILE_ENV})"})
            return False
        header = self.headers.get("Authorization", "")
        scheme, _, presented = header.partition(" ")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(presented.strip().encode(), expected.encode())
        if not ok:
            self._json(401, {"error": "missing or wrong bearer token"},
                       {"WWW-Authenticate": 'Bearer realm="daedalus-trainer"'})
        return ok

    @staticmethod
    def _timeout(query: str) -> float:
        values = parse_qs(query).get("timeout")
        if not values:
            return DEFAULT_WAIT_SECONDS
        try:
            timeout = float(values[-1])
        except ValueError:
            raise ValueError(f"timeout must be a number of seconds, got {values[-1]!r}") from None
        if not 0 <= timeout <= MAX_WAIT_SECONDS:
            raise ValueError(f"timeout must be between 0 and {MAX_WAIT_SECONDS:g} seconds, got {timeout:g}")
        return timeout


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    metrics: TrainerMetrics
    control: ControlState
    token_source: Callable[[], str | None]


class TrainerServer:
    """Serves the routes in the module docstring from a daemon thread of the trainer process.

    Args:
        metrics: the registry to expose on ``/metrics``.
        control: the state shared with the training loop.
        host: interface to bind; ``0.0.0.0`` on the Ray head so Prometheus and the operator can reach it (the
            job's NetworkPolicy restricts who may); ``127.0.0.1`` for a local run.
        port: TCP port (0 picks a free one; read :attr:`port` after :meth:`start`).
        token_source: returns the control token or ``None``; default :func:`load_control_token` (read per request).

    Use as a context manager or call :meth:`start` / :meth:`stop`. Raises ``OSError`` from :meth:`start` when the
    port is taken.
    """

    def __init__(
        self,
        metrics: TrainerMetrics,
        control: ControlState,
        *,
        host: str = "0.0.0.0",
        port: int = DEFAULT_PORT,
        token_source: Callable[[], str | None] = load_control_token,
    ) -> None:
        self.metrics = metrics
        self.control = control
        self.host = host
        self._requested_port = port
        self._token_source = token_source
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port (valid after :meth:`start`).

        Raises:
            RuntimeError: the server is not started (or was stopped).
        """
        if self._server is None:
            raise RuntimeError("server not started")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """``http://host:port`` of the running server (``127.0.0.1`` when bound to all interfaces)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> TrainerServer:
        """Bind and serve in a daemon thread. Returns ``self``.

        Raises:
            RuntimeError: the server is already started.
            OSError: the port is taken (or ``host`` cannot be bound).
        """
        if self._server is not None:
            raise RuntimeError("server already started")
        server = _Server((self.host, self._requested_port), _Handler)
        server.metrics = self.metrics
        server.control = self.control
        server.token_source = self._token_source
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="daedalus-trainer-http", daemon=True)
        self._thread.start()
        log.info("trainer endpoint listening on %s:%d", self.host, self.port)
        return self

    def stop(self) -> None:
        """Stop serving and close the socket (idempotent)."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = None
        self._thread = None

    def __enter__(self) -> TrainerServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
