"""kopf handlers: gather observations -> :func:`~daedalus_operator.plan.plan` -> write status -> execute actions.
Nothing else; every decision is in :mod:`daedalus_operator.plan`.

Registered by :func:`register` on an explicit registry (the timer interval is a command-line setting):

- ``@kopf.on.login``: in-cluster service account or kubeconfig (explicit, so the official client's import-time
  ``KUBECONFIG`` is never relied on).
- ``@kopf.on.startup``: kopf settings (our finalizer ``daedalus.dev/finalizer``, progress and diff-base storage in
  ``daedalus.dev/`` annotations - the status schema has no room for kopf's own fields, watch timeouts, events only
  for warnings from kopf itself).
- indexes of the job's pods, the nodes, and the job's RayClusters/RayServices (kept current by kopf's watches).
- ``@kopf.on.create`` / ``on.update`` (spec) / ``on.resume`` and a ``@kopf.timer`` every ``--poll-interval``: one
  reconcile of the job; a per-job lock keeps two of them from overlapping, and the job is read under it (kopf starts
  on.resume and the timer's first tick together at every operator start: the one that waited plans from the job as
  the other left it, not from a body made stale by the other's status write).
- ``@kopf.on.delete`` (the finalizer): a Running (or Checkpointing) job's trainer is first asked to checkpoint and
  stop (``POST /stop``, waited for at most :func:`deletion_checkpoint_bound` seconds: ``checkpointTimeoutSeconds``,
  at most three quarters of ``--deletion-timeout``; in-process for up to :data:`DELETION_WAIT_SECONDS` per call,
  then through ``kopf.TemporaryError`` retries, :func:`checkpoint_before_deletion`); then stop the Ray job, delete
  the children, and release after ``--deletion-timeout`` seconds whatever failed.
- ``@kopf.on.probe``: the liveness endpoint fails when the API server has not answered for ``--liveness-stale``
  seconds (:func:`liveness`: ``GET /version``; any HTTP answer, a 403 included, counts as an answer).

One reconcile: a fresh GET of the job (never a stale body), observations, the plan, the status written once when it
changed (a merge patch carrying the job's resourceVersion: a concurrent write makes it 409 and kopf's retry re-plans
from fresh state; nothing is executed; a 409 caused only by kopf's own finalizer or annotations written meanwhile is
sent again with the fresh resourceVersion, :func:`write_status`), then the actions. An action that fails is reported
in the ``Reconciling`` condition and retried by the next reconcile. ``EnsureChildren`` creates only what this process
has not created yet (:class:`Children`): one create per child and job, no 409 AlreadyExists while kopf's index catches
up.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import os
import threading
import time
import weakref
from typing import Any

import kopf
import pydantic
from daedalus_trainer import __version__
from daedalus_trainer.config import RLTrainingJobStatus, SpecError, parse_job

from daedalus_operator import api, kube, resources
from daedalus_operator.metrics import WAKE_REASONS, OperatorMetrics
from daedalus_operator.nodes import format_time, node_health, parse_time, read_cluster
from daedalus_operator.plan import (
    DeleteCluster,
    DeletePods,
    EnsureChildren,
    EnsureServing,
    JobView,
    Observed,
    Plan,
    RayJobObservation,
    RayJobState,
    RequestCheckpoint,
    StopJob,
    Submit,
    Timing,
    TrainerObservation,
    expected_pods,
    plan,
    quotes_log_tail,
)
from daedalus_operator.settings import OperatorSettings
from daedalus_operator.status import compute_status, merge_patch
from daedalus_operator.submit import CheckpointCalls, RayJobs, RayUnreachable, TrainerControl

log = logging.getLogger(__name__)

RLTJ = (api.GROUP, api.VERSION, api.PLURAL)
MAX_LOOPS = 5  # immediate re-plans within one reconcile (requeue_after == 0)


#: Seconds before a PodDisruptionBudget name found held by an object the job does not own is looked at again
#: (:func:`disruption_budget_once`): the budget is a safety net, so the job runs meanwhile, and the warning is not
#: repeated on every reconcile.
BUDGET_CONFLICT_RETRY_SECONDS = 60.0

#: Seconds a RayCluster this process created may be missing from the kopf index (the watch event not arrived yet)
#: before ``EnsureChildren`` creates it again (KubeRay's habit: an expectation of what was created, so a lagging cache
#: does not cause a second create).
INDEX_LAG_SECONDS = 30.0


@dataclasses.dataclass
class Children:
    """What this operator process knows exists of one job's children, so that ``EnsureChildren`` (decided on every
    reconcile that might need it) sends no create the server would answer 409 AlreadyExists.

    ``present``: child kinds (``group/version/plural``) created here or answered 409 (exist); ``config_digest``:
    SHA-256 of the ConfigMap data last written or confirmed; ``cluster_created``: ``time.monotonic()`` of this process's RayCluster
    create (``None`` when none is pending); ``cluster_seen``: the RayCluster has appeared in the kopf index since;
    ``budget``: the PodDisruptionBudget was made to exist (True) or not to (False) for ``checkpointOnDrain``
    (``None``: not yet looked at by this process, or its name is held by an object the job does not own);
    ``budget_conflict``: ``time.monotonic()`` when that name was last found so held.
    A RayCluster that was seen and is gone from the index again was deleted (suspend, a terminal phase, by hand):
    the whole record is dropped and every child is ensured again. Lost on an operator restart (then the creates are
    answered 409 once, as before).
    """

    present: set[str] = dataclasses.field(default_factory=set)
    config_digest: str | None = None
    cluster_created: float | None = None
    cluster_seen: bool = False
    budget: bool | None = None
    budget_conflict: float | None = None

    def note_cluster(self, exists: bool) -> None:
        """Account for the RayCluster as the kopf index shows it now."""
        if exists:
            self.cluster_seen = True
            self.cluster_created = None
            self.present.add(kube.RAYCLUSTERS)
        elif self.cluster_seen:  # seen, now gone: deleted; start over
            self.present.clear()
            self.config_digest = None
            self.budget = None
            self.cluster_seen = False
            self.cluster_created = None

    def cluster_pending(self, now: float) -> bool:
        """Created by this process moments ago and not in the index yet (within :data:`INDEX_LAG_SECONDS`); the
        caller confirms with a GET before skipping the create."""
        return self.cluster_created is not None and now - self.cluster_created < INDEX_LAG_SECONDS


#: Phases in which a job whose reconcile planned nothing may be looked at less often than ``poll_interval`` (the poll
#: budget, :class:`PollGate`): waiting on Kubernetes objects (which wake it at once when they change), training, or
#: ended. Never ``Checkpointing`` or ``Recovering``: a checkpoint call in flight and a recovery's timings are observed
#: only by looking. (``Pending`` always plans the children's creation, so it is never quiet either.)
QUIET_PHASES = frozenset({api.Phase.PROVISIONING, api.Phase.RUNNING, api.Phase.SUSPENDED, api.Phase.SUCCEEDED,
                          api.Phase.FAILED})

#: Default seconds between looks at a quiet job that is not ``Running`` when nothing it depends on changed
#: (:class:`PollGate`; ``--idle-resync``).
IDLE_RESYNC_SECONDS = OperatorSettings.idle_resync


@dataclasses.dataclass
class PollGate:
    """Whether the poll timer's next tick reconciles one job (``--poll-budget``).

    A job is *quiet* after a reconcile that changed nothing but its progress (:func:`is_quiet`). A quiet job is
    reconciled again when its interval is over, or at once when anything it depends on in Kubernetes changed
    since: its body (a ``resourceVersion`` other than the ones that reconcile read and wrote), or
    :func:`dependency_fingerprint` of its pods, their nodes, its RayCluster and RayService in kopf's indexes. A job that is not quiet is reconciled on
    every tick, as without a budget.

    The interval of a quiet ``Running`` job (*budgeted*) is the steady interval, ``max(poll_interval, budgeted jobs /
    poll_budget)``: a training job learns only by looking that its Ray job ended or failed. A quiet job in another
    phase (waiting for its RayCluster, suspended, ended) depends on nothing but Kubernetes objects, so it is looked at
    when they change and otherwise every ``idle`` seconds (``--idle-resync``, default :data:`IDLE_RESYNC_SECONDS`:
    a safety net), outside the budget: a thousand finished jobs do not slow the look at a running one.

    Attributes:
        quiet: see above.
        budgeted: quiet and ``Running``.
        fingerprint: :func:`dependency_fingerprint` when that reconcile started.
        versions: the job's ``resourceVersion`` values that reconcile read and wrote (its own status write is no
            change).
        at: ``time.monotonic()`` when that reconcile ended, in seconds.
    """

    quiet: bool = False
    budgeted: bool = False
    fingerprint: Any = None
    versions: frozenset = frozenset()
    at: float = 0.0

    def wake(self, version: str | None, fingerprint: Any, now: float, interval: float, tick: float,
             idle: float = IDLE_RESYNC_SECONDS) -> str | None:
        """Why a timer tick at ``now`` (monotonic seconds) should reconcile, or ``None`` when it should not:
        ``"active"`` (the job is not quiet), what changed (:meth:`changed`), or ``"interval"`` (its interval is over).
        ``interval``: the steady interval for quiet jobs (seconds); ``tick``: the timer's interval (seconds), half of
        which is tolerated as jitter so that a tick a few milliseconds early does not wait a whole extra tick;
        ``idle``: the resync interval of a quiet job that is not budgeted (seconds; never shorter than
        ``interval``)."""
        if not self.quiet:
            return "active"
        reason = self.changed(version, fingerprint)
        if reason is not None:
            return reason
        wait = interval if self.budgeted else max(interval, idle)
        return "interval" if now - self.at >= wait - tick / 2 else None

    def due(self, version: str | None, fingerprint: Any, now: float, interval: float, tick: float,
            idle: float = IDLE_RESYNC_SECONDS) -> bool:
        """Whether a timer tick at ``now`` should reconcile: :meth:`wake` is not ``None`` (same arguments, times in
        seconds)."""
        return self.wake(version, fingerprint, now, interval, tick, idle) is not None

    def changed(self, version: str | None, fingerprint: Any) -> str | None:
        """What the job depends on that changed since the reconcile that made this gate, the first difference found
        in the order of :data:`~daedalus_operator.metrics.WAKE_REASONS`: ``"job"`` (a ``resourceVersion`` that
        reconcile neither read nor wrote), ``"pods"``, ``"nodes"``, ``"raycluster"``, ``"rayservice"``
        (the parts of :func:`dependency_fingerprint`); ``None`` when nothing did."""
        if version not in self.versions:
            return "job"
        if fingerprint == self.fingerprint:
            return None
        old = self.fingerprint or (None,) * len(fingerprint)
        return next((reason for reason, now, then in zip(WAKE_REASONS[1:], fingerprint, old) if now != then), "pods")


def is_quiet(result: str, last: Plan, first_phase: str | None, status: dict[str, Any], poll: float,
             trainer: TrainerObservation | None) -> bool:
    """Whether a reconcile leaves its job quiet (:class:`PollGate`): it ended without error (``result`` ``ok`` or
    ``requeue``), planned no action and no event, asked to be looked at again no sooner than the next tick (``poll``
    seconds), and kept the job in the phase it had (``first_phase``), one of :data:`QUIET_PHASES`; the job's
    ``status`` (after the reconcile) has no recovery under way (``recovery``: until its first new step is seen) and
    counts down no grace period (``unreachableSince``: a dashboard that stopped answering is looked at every tick
    until it answers or its grace is over; nor the plan's ``in_grace``: a pod not Ready within ``--pod-ready-grace``,
    which leaves nothing in status); and a ``Running`` job's ``trainer`` (what ``/status`` said in that
    reconcile) answered for the current attempt with a step past the one it started from (its ``resumedFrom``, else
    the job's latest checkpoint): an attempt is looked at every tick until it has made a step, the time in which an
    image, a volume or the model path fails."""
    if not (result in ("ok", "requeue") and not last.actions and not last.events and not last.in_grace
            and (last.requeue_after is None or last.requeue_after >= poll)
            and last.phase in QUIET_PHASES and last.phase.value == first_phase
            and not status.get("unreachableSince") and not status.get("recovery")):
        return False
    if last.phase == api.Phase.RUNNING:
        if trainer is None or not trainer.answers_for(int(status.get("attempt") or 0)) or trainer.step is None:
            return False
        started = trainer.resumed_from
        if started is None:  # a trainer that does not say: the checkpoint the attempt resumed from, at the latest
            started = int((status.get("latestCheckpoint") or {}).get("step") or 0)
        return trainer.step > started
    return True


def _node_digest(node: dict[str, Any]) -> tuple:
    """What of a node the planner reads (:func:`~daedalus_operator.nodes.node_health`): labels (HyperPod's health
    label), taints, ``unschedulable``, deletion, and the condition statuses; not its heartbeat times."""
    meta, spec = node.get("metadata") or {}, node.get("spec") or {}
    conditions = ((node.get("status") or {}).get("conditions")) or []
    return (tuple(sorted((meta.get("labels") or {}).items())), bool(meta.get("deletionTimestamp")),
            bool(spec.get("unschedulable")),
            tuple((t.get("key"), t.get("value"), t.get("effect")) for t in (spec.get("taints") or [])),
            tuple(sorted((c.get("type"), c.get("status")) for c in conditions)))


def dependency_fingerprint(namespace: str, name: str, indexes: dict[str, Any]) -> tuple:
    """A hashable summary of what one job depends on in kopf's indexes: its pods (name, ``resourceVersion``), the
    nodes they run on (:func:`_node_digest`), its RayClusters and RayServices (``resourceVersion``). Equal summaries
    mean the planner would see the same Kubernetes objects.

    Raises:
        kopf.TemporaryError: an index kept changing while it was copied (:func:`_copy_retrying`).
    """
    key = (namespace, name)

    def versions(index_name: str) -> tuple:
        return tuple(sorted(((o.get("metadata") or {}).get("name") or "", (o.get("metadata") or {}).get(
            "resourceVersion") or "") for o in _store_values(indexes.get(index_name), key)))

    pods = _store_values(indexes.get("pods_by_job"), key)
    node_names = sorted({n for n in ((p.get("spec") or {}).get("nodeName") for p in pods) if n})
    nodes = tuple((n, tuple(_node_digest(v) for v in _store_values(indexes.get("nodes_by_name"), n)))
                  for n in node_names)
    pod_part = tuple(sorted(((p.get("metadata") or {}).get("name") or "",
                             (p.get("metadata") or {}).get("resourceVersion") or "") for p in pods))
    return pod_part, nodes, versions("clusters_by_job"), versions("services_by_job")


@dataclasses.dataclass
class Runtime:
    """Per-process runtime values (kopf ``memo``): API client, background checkpoint calls, metrics, locks."""

    settings: OperatorSettings
    metrics: OperatorMetrics
    kube: kube.KubeAPI | None = None
    calls: CheckpointCalls = dataclasses.field(default_factory=CheckpointCalls)
    # namespace/name -> the lock serialising its reconciles; an entry lives while a reconcile holds or waits for it
    locks: weakref.WeakValueDictionary[str, threading.Lock] = dataclasses.field(
        default_factory=weakref.WeakValueDictionary)
    ray: dict[str, RayJobs] = dataclasses.field(default_factory=dict)
    tokens: dict[str, str] = dataclasses.field(default_factory=dict)
    deleting: dict[str, float] = dataclasses.field(default_factory=dict)  # uid -> monotonic time first seen deleting
    # uid -> how the checkpoint before deletion ended (decided once per deletion; dropped when the finalizer releases)
    deletion_checkpoints: dict[str, "DeletionCheckpoint"] = dataclasses.field(default_factory=dict)
    made: dict[str, "Children"] = dataclasses.field(default_factory=dict)  # uid -> the children known to exist
    gates: dict[str, PollGate] = dataclasses.field(default_factory=dict)  # uid -> when the timer next reconciles
    budgeted: int = 0  # gates with budgeted=True
    pruned_at: float = 0.0  # time.monotonic() of the last pass over gates for stale ones
    last_api_ok: float = dataclasses.field(default_factory=time.monotonic)
    # uid -> the problem of the unreadable status last reported (:func:`read_status`), until the status is readable
    # again: one event per problem, however often kopf's own annotations change the job's resourceVersion meanwhile
    unreadable: dict[str, str] = dataclasses.field(default_factory=dict)
    guard: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def children(self, uid: str) -> "Children":
        """The record of job ``uid``'s children (created on first use)."""
        with self.guard:
            return self.made.setdefault(uid, Children())

    def lock_for(self, key: str) -> threading.Lock:
        """The lock that serialises the reconciles of job ``key`` (``namespace/name``: known before the job is read,
        so the read happens under the lock). Created on first use and kept while a caller holds a reference to it
        (the reconcile holding it, those waiting for it): two callers at once get the same lock, and an operator
        that saw many jobs come and go keeps no lock for each (the entry goes with the last reference)."""
        with self.guard:
            lock = self.locks.get(key)
            if lock is None:
                lock = self.locks[key] = threading.Lock()
            return lock

    def put_gate(self, uid: str, gate: PollGate | None) -> None:
        """Record (``None``: forget) job ``uid``'s :class:`PollGate`, keeping the count of budgeted ones."""
        with self.guard:
            old = self.gates.pop(uid, None)
            self.budgeted -= bool(old is not None and old.budgeted)
            if gate is not None:
                self.gates[uid] = gate
                self.budgeted += gate.budgeted

    def steady_interval(self) -> float:
        """Seconds between reconciles of a quiet ``Running`` job (:class:`PollGate`): ``poll_interval``, or the
        count of such jobs divided by ``poll_budget`` when that is longer (the budget is per second, for all of
        them). At most once a minute, gates no reconcile has refreshed for ``max(2 x idle_resync, 4 x the
        interval)`` are dropped: a job deleted while a tick's reconcile of it was under way (kopf runs the deletion
        handler alongside it) must not count for ever."""
        budget, poll = self.settings.poll_budget, self.settings.poll_interval
        now = time.monotonic()

        def interval() -> float:
            return max(poll, self.budgeted / budget) if budget > 0 else poll

        with self.guard:
            if now - self.pruned_at > 60.0:
                self.pruned_at = now
                horizon = max(2 * self.settings.idle_resync, 4 * interval())
                for uid in [u for u, g in self.gates.items() if now - g.at > horizon]:
                    self.budgeted -= self.gates.pop(uid).budgeted
            seconds = interval()
        self.metrics.steady_poll_seconds.set(seconds)
        return seconds

    def should_poll(self, body: dict[str, Any], indexes: dict[str, Any], logger: Any = None) -> bool:
        """Whether the poll timer's tick for the job ``body`` (kopf's latest copy) reconciles it now
        (:meth:`PollGate.wake`; always with ``poll_budget`` 0); a tick that does not is counted in
        ``daedalus_operator_poll_skips_total``. A quiet job woken because something it depends on changed is counted
        in ``daedalus_operator_poll_wakes_total`` by :meth:`PollGate.changed`, and ``logger`` (kopf's per-object
        logger; ``None``: this module's) says at debug level what changed.

        Raises:
            kopf.TemporaryError: an index kept changing while it was copied (:func:`_copy_retrying`).
        """
        if self.settings.poll_budget <= 0:
            return True
        meta = body.get("metadata") or {}
        with self.guard:
            gate = self.gates.get(meta.get("uid", ""))
        if gate is None or not gate.quiet:
            return True
        version = meta.get("resourceVersion")
        fingerprint = dependency_fingerprint(meta["namespace"], meta["name"], indexes)
        reason = gate.wake(version, fingerprint, time.monotonic(), self.steady_interval(),
                           self.settings.poll_interval, self.settings.idle_resync)
        if reason in WAKE_REASONS:
            self.metrics.poll_wakes.labels(reason=reason).inc()
            (logger or log).debug("quiet job woken: its %s changed since the last reconcile",
                                  "body" if reason == "job" else reason)
        elif reason is None:
            self.metrics.poll_skips.inc()
        return reason is not None

    def ray_jobs(self, url: str, token: str | None = None) -> RayJobs:
        """The :class:`RayJobs` client of the dashboard at ``url`` with the Ray token ``token`` (the job's Secret's,
        :func:`_token`), cached per URL (created on first use, and again when the token changed, with
        ``settings.request_timeout`` seconds per HTTP request)."""
        with self.guard:
            if url not in self.ray or self.ray[url].token != token:
                self.ray[url] = RayJobs(url, timeout=self.settings.request_timeout, token=token)
            return self.ray[url]


# ------------------------------------------------------------------------------------------------ reading the job
#: Event reason (Warning) for a job whose ``.status`` this operator cannot read (:func:`read_status`).
STATUS_UNREADABLE = "StatusUnreadable"


def read_status(doc: dict[str, Any] | None) -> tuple[RLTrainingJobStatus, str | None]:
    """A job's ``.status`` as this operator reads it, and ``None``; or, when it cannot (the first validation error
    against :class:`~daedalus_trainer.config.RLTrainingJobStatus`), an empty status and why, with the field path and
    the value. A status the CRD accepts but this version's model refuses comes from another version of the operator
    (e.g. a phase added by a newer one, whose CRD was applied, then the operator rolled back): :func:`reconcile` then
    acts on nothing, since a status read as empty would make a running job look new."""
    try:
        return RLTrainingJobStatus.model_validate(doc or {}), None
    except ValueError as exc:
        errors = exc.errors() if isinstance(exc, pydantic.ValidationError) else []
        if not errors:
            return RLTrainingJobStatus(), (str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        first = errors[0]
        where = ".".join(str(p) for p in ("status", *first["loc"]))
        value = repr(first.get("input"))
        return RLTrainingJobStatus(), (f"{where}: {first['msg']} "
                                       f"(it holds {value[:80] + '...' if len(value) > 80 else value})")


def job_view(body: dict[str, Any]) -> JobView:
    """Validate a job body into a :class:`JobView` (an invalid spec gives ``spec=None`` and the errors)."""
    meta = body.get("metadata") or {}
    manifest = {k: v for k, v in body.items() if k in ("apiVersion", "kind", "spec")}
    manifest["metadata"] = {"name": meta.get("name"), "namespace": meta.get("namespace")}
    spec, errors = None, ()
    try:
        spec = parse_job(manifest).spec
    except SpecError as exc:
        errors = tuple(exc.errors)
    status, status_error = read_status(body.get("status"))  # unreadable: empty, never crash the handler
    return JobView(name=meta["name"], namespace=meta["namespace"], uid=meta.get("uid", ""),
                   generation=int(meta.get("generation") or 1), spec=spec, status=status, spec_errors=errors,
                   status_error=status_error,
                   serving_lora_uri=(meta.get("annotations") or {}).get(resources.SERVING_LORA_URI_ANNOTATION))


def _copy_retrying(read: Any, catch: tuple[type[BaseException], ...]) -> Any:
    """``read()`` (a copy of a kopf index, which changes under us in kopf's event loop thread), retried up to 5 times
    10 ms apart while it raises one of ``catch``.

    Raises:
        kopf.TemporaryError: the copy kept failing. Never an empty answer: the planner would take every pod and node
            for lost and stop or restart a healthy job.
    """
    for _ in range(5):
        try:
            return read()
        except catch:
            time.sleep(0.01)
    raise kopf.TemporaryError("the kopf index kept changing while it was read; reconciling again", delay=1.0)


def _store_values(index: Any, key: Any) -> list[dict]:
    """Values of a kopf index key, copied (:func:`_copy_retrying`; ``RuntimeError``: changed size during iteration)."""
    if index is None:
        return []
    return _copy_retrying(lambda: [dict(v) for v in (index.get(key) or [])], (RuntimeError,))


def _all_values(index: Any) -> dict[Any, dict]:
    """One value per key of a kopf index, copied (:func:`_copy_retrying`; a store emptied between the test and the
    read raises ``StopIteration``)."""
    if index is None:
        return {}
    return _copy_retrying(lambda: {k: dict(next(iter(store))) for k, store in list(index.items()) if store},
                          (RuntimeError, StopIteration))


def gather(rt: Runtime, job: JobView, indexes: dict[str, Any]) -> Observed:
    """Everything the planner needs: RayCluster (index), pods and nodes (indexes), the Ray job and the trainer
    (HTTP), the background checkpoint call of the current attempt (those of the job's earlier attempts are dropped,
    :meth:`~daedalus_operator.submit.CheckpointCalls.retain`), the RayService (index).

    Raises:
        kopf.TemporaryError: a kopf index kept changing while it was copied (:func:`_copy_retrying`).
        ValueError: the job's ``status.attemptStartTime`` is not an RFC 3339 timestamp (:func:`parse_time`; the
            operator writes it, and the CRD's ``format: date-time`` refuses other values, so only a status stored
            before that CRD was installed).
    """
    key = (job.namespace, job.name)
    # The job's RayCluster: its name and an owner reference to this job. One left by an earlier job of the same name
    # (deleted and created again before the garbage collector removed it) carries the same label and name but is
    # not this job's: it is never submitted to; EnsureChildren's create then says what holds the name.
    clusters = [c for c in _store_values(indexes.get("clusters_by_job"), key)
                if (c.get("metadata") or {}).get("name") == api.raycluster_name(job.name) and owned_by(c, job.uid)]
    cluster = read_cluster(clusters[0] if clusters else None, control_port=rt.settings.control_port)
    st = job.status
    since = parse_time(st.attempt_start_time) if st.submission_id and st.phase in (
        api.Phase.RUNNING, api.Phase.CHECKPOINTING) else None
    pods = _store_values(indexes.get("pods_by_job"), key)
    nodes = _all_values(indexes.get("nodes_by_name"))
    hyperpod = job.spec.resilience.hyper_pod if job.spec else False
    drain = job.spec.resilience.checkpoint_on_drain if job.spec else False
    health = node_health(pods, nodes, hyperpod=hyperpod, drain=drain, since=since,
                         expected_pods=expected_pods(job, cluster))

    ray_job = RayJobObservation(RayJobState.NOT_FOUND)
    if st.submission_id:
        if cluster.dashboard_url and not cluster.deleting:
            jobs = rt.ray_jobs(cluster.dashboard_url, _token(rt, job))
            ray_job = jobs.status(st.submission_id)
            if ray_job.unauthorized:
                rt.tokens.pop(job.uid, None)  # the Secret may have been replaced: read the token again
            if (ray_job.state == RayJobState.FAILED and st.phase in (api.Phase.RUNNING, api.Phase.CHECKPOINTING)
                    and not quotes_log_tail(ray_job.message)):  # Ray's own message quotes the last lines already
                tail = jobs.logs(st.submission_id, 600).strip()
                if tail:
                    ray_job = RayJobObservation(ray_job.state, f"{ray_job.message}\n...{tail[-600:]}")
        else:
            ray_job = RayJobObservation(RayJobState.UNREACHABLE,
                                        "no RayCluster" if not cluster.exists else "no head address yet")
    # The entries of this job's earlier attempts are never read again (the planner reads the current one's only).
    rt.calls.retain(job.uid, st.submission_id)
    trainer = TrainerObservation()
    if ray_job.state.active and cluster.control_url:
        trainer = TrainerControl(cluster.control_url, timeout=rt.settings.request_timeout).status()
    serving = any(owned_by(sv, job.uid) for sv in _store_values(indexes.get("services_by_job"), key))
    return Observed(cluster=cluster, ray_job=ray_job, trainer=trainer, health=health,
                    checkpoint_call=rt.calls.get(st.submission_id), serving_exists=serving)


# ------------------------------------------------------------------------------------------------ executing actions
def _token(rt: Runtime, job: JobView) -> str | None:
    if job.uid in rt.tokens:
        return rt.tokens[job.uid]
    body = rt.kube.get(kube.SECRETS, job.namespace, api.secret_name(job.name))
    if body is None:
        return None
    try:
        token = resources.secret_token(body)
    except KeyError:
        return None
    rt.tokens[job.uid] = token
    return token


class ChildConflict(RuntimeError):
    """A child's name (``<job>-config``, ``<job>-control``, ``<job>-ray``) is taken by an object this job does not
    own; the operator neither changes nor uses it. The reconcile records the message in the ``Reconciling``
    condition and tries again at the next one (the object may be deleted meanwhile)."""


#: Kinds of child objects by API key, as messages name them.
CHILD_KINDS = {kube.CONFIGMAPS: "ConfigMap", kube.SECRETS: "Secret", kube.NETWORKPOLICIES: "NetworkPolicy",
               kube.PDBS: "PodDisruptionBudget", kube.RAYCLUSTERS: "RayCluster", kube.RAYSERVICES: "RayService"}


def owned_by(body: dict[str, Any] | None, uid: str) -> bool:
    """Whether ``body`` has an owner reference to the object with ``uid`` (every child this operator creates has a
    controller reference to its RLTrainingJob: :func:`resources.owner_reference`)."""
    refs = ((body or {}).get("metadata") or {}).get("ownerReferences") or []
    return any(r.get("uid") == uid for r in refs)


def check_child_owned(owner: dict[str, Any], key: str, body: dict[str, Any], allow_unowned: bool = False) -> None:
    """Refuse a child read back by :func:`read_back_own` (``body``; after a create answered 409, or before the
    finalizer deletes it; ``key``: its API, e.g. ``kube.CONFIGMAPS``) unless it is the job's own: an owner reference to the uid of ``owner`` (the job's
    :func:`resources.owner_reference`). With ``allow_unowned`` an object without a controller reference is taken
    too: the token Secret, which a user may replace by hand (docs/deploy.md). Objects made by this operator for
    the job always carry the reference, so the usual 409 (after an operator restart) passes; the caller's GET that
    read ``body`` is the one API call this adds.

    Raises:
        ChildConflict: the object belongs to an earlier RLTrainingJob of the same name (deleted and created again
            before Kubernetes' garbage collector removed its children: the message says the job waits), or to
            someone else (the message names its owners and what to do).
    """
    if owned_by(body, owner["uid"]):
        return
    meta = body.get("metadata") or {}
    refs = meta.get("ownerReferences") or []
    if allow_unowned and not any(r.get("controller") for r in refs):
        return
    what = f"{CHILD_KINDS.get(key, key)} {meta.get('namespace')}/{meta.get('name')}"
    job_name = owner["name"]
    earlier = next((r for r in refs if r.get("kind") == api.KIND and r.get("name") == job_name), None)
    if earlier is not None:
        raise ChildConflict(f"{what} belongs to an earlier RLTrainingJob {job_name} (uid {earlier.get('uid')}) that "
                            f"Kubernetes' garbage collector has not deleted yet; waiting for it to go")
    owners = ", ".join(f"{r.get('kind')} {r.get('name')}" for r in refs) or "no owner reference"
    raise ChildConflict(f"{what} exists and is not this job's ({owners}): the operator neither changes nor uses "
                        f"another object; delete or rename it, or give the job another name")


def read_back_own(k: kube.KubeAPI, key: str, namespace: str, name: str, owner: dict[str, Any],
                  allow_unowned: bool = False) -> dict[str, Any] | None:
    """GET the child ``key``/``namespace``/``name`` (one whose create was answered 409, or one about to be deleted)
    and return it if it is the job's (:func:`check_child_owned`; ``owner``: the job's owner reference), ``None``
    if it is gone.

    Raises:
        kube.KubeError: the GET failed.
        ChildConflict: the object is not the job's.
    """
    current = k.get(key, namespace, name)
    if current is not None:
        check_child_owned(owner, key, current, allow_unowned=allow_unowned)
    return current


def ensure_children(rt: Runtime, job: JobView, cluster_exists: bool = False) -> None:
    """Create what is missing (ConfigMap, NetworkPolicy, PodDisruptionBudget per :func:`disruption_budget_once`,
    Secret, RayCluster, in that order: the RayCluster's pods need the ConfigMap and the Secret); bring the
    ConfigMap's data and the NetworkPolicy's spec up to date (the latter by its digest annotation, once per operator
    process); never touch an existing Secret.

    Children this process already created (or was told exist) are not created again (:class:`Children`): only the
    first ``EnsureChildren`` of a job costs API calls, later ones (the index lagging behind the new RayCluster, the
    resubmission of an attempt) none unless the ConfigMap data changed or the RayCluster was deleted.
    ``cluster_exists``: the kopf index shows the job's RayCluster.

    A create answered 409 is read back and checked to be the job's own (:func:`check_child_owned`): an object of
    that name that someone else owns is neither changed nor used.

    Raises:
        kube.KubeError: an API call failed (a create other than with 409 Conflict, or a get or patch).
        ChildConflict: a child's name is taken by an object the job does not own.
        ValueError: the job's spec is invalid (nothing can be built).
    """
    k = rt.kube
    made = rt.children(job.uid)
    made.note_cluster(cluster_exists)
    cm = resources.build_config_map(job)
    digest = resources.spec_digest(cm["data"])
    if kube.CONFIGMAPS not in made.present or made.config_digest != digest:
        try:
            k.create(kube.CONFIGMAPS, job.namespace, cm)
        except kube.KubeError as e:
            if not e.conflict:
                raise
            current = read_back_own(k, kube.CONFIGMAPS, job.namespace, cm["metadata"]["name"],
                                    resources.owner_reference(job)) or {}
            if current.get("data") != cm["data"]:
                k.patch(kube.CONFIGMAPS, job.namespace, cm["metadata"]["name"], {"data": cm["data"]})
        made.present.add(kube.CONFIGMAPS)
        made.config_digest = digest
    network_policy_once(rt, job)
    try:  # a safety net, not needed to train: a refusal (RBAC, a quota, a policy webhook) must not stop the job
        disruption_budget_once(rt, job)
    except (kube.KubeError, ChildConflict) as e:
        log.warning(f"PodDisruptionBudget of {job.namespace}/{job.name}: {e}; will retry (a drain meanwhile evicts "
                    f"the job's pods without waiting for a checkpoint)")
    for key, build in ((kube.SECRETS, lambda: resources.build_secret(job)),
                       (kube.RAYCLUSTERS, lambda: resources.build_raycluster(job, rt.settings))):
        if key in made.present:
            continue
        if key == kube.RAYCLUSTERS and made.cluster_pending(time.monotonic()):
            # Created here moments ago and not in kopf's index yet: one GET tells "still there" (skip the create)
            # from "deleted before the index ever saw it" (create it again now, not after INDEX_LAG_SECONDS).
            if k.get(key, job.namespace, api.raycluster_name(job.name)) is not None:
                continue
        body = build()
        try:
            k.create(key, job.namespace, body)
            if key == kube.SECRETS:  # a new token: the head of the cluster created next starts with it
                rt.tokens[job.uid] = resources.secret_token(body)
        except kube.KubeError as e:
            if not e.conflict:
                raise
            # gone since: created at the next reconcile
            read_back_own(k, key, job.namespace, body["metadata"]["name"], resources.owner_reference(job),
                          allow_unowned=key == kube.SECRETS)
            if key == kube.SECRETS:  # exists, perhaps replaced since this process cached a token: read it again
                rt.tokens.pop(job.uid, None)
        if key == kube.RAYCLUSTERS:
            made.cluster_created = time.monotonic()  # present once the index shows it (note_cluster)
        else:
            made.present.add(key)


def network_policy_once(rt: Runtime, job: JobView) -> None:
    """:func:`ensure_network_policy` for ``job`` once per job and operator process (:class:`Children` records it)."""
    made = rt.children(job.uid)
    if kube.NETWORKPOLICIES not in made.present:
        ensure_network_policy(rt.kube, resources.build_network_policy(job, rt.settings))
        made.present.add(kube.NETWORKPOLICIES)


def disruption_budget_once(rt: Runtime, job: JobView) -> None:
    """Make the job's PodDisruptionBudget (:func:`resources.build_disruption_budget`) exist when
    ``spec.resilience.checkpointOnDrain`` is true and not exist when it is false, when that wish differs from what
    this process last made it (:attr:`Children.budget`); no call otherwise, so it can run on every reconcile and an
    edit of the field takes effect at once. The calls: a create (and after a 409 a GET: the budget found is checked
    to be the job's, :func:`check_child_owned`), or a delete (a GET first when this process has not made it, and a
    delete only of the job's own; another's is left alone and logged once). A name held by an object the job does
    not own while the job wants a budget raises :class:`ChildConflict`, and is looked at again after
    :data:`BUDGET_CONFLICT_RETRY_SECONDS`, not on every reconcile. An API server without
    policy/v1 (Kubernetes older than 1.21) answers the create 404: logged once per job and RayCluster, and the job
    runs without the budget (a drain then evicts its pods at once: an unplanned restart). ``DeleteCluster`` deletes
    the budget with the RayCluster (it holds no pod then) and forgets it here, as :meth:`Children.note_cluster` does
    when the RayCluster is seen gone. A budget deleted by hand while its RayCluster lives comes back with the next
    RayCluster or operator start.

    Raises:
        kube.KubeError: the create failed other than with 409 Conflict or 404, the GET failed, or the delete other
            than with 404.
        ChildConflict: the job wants a budget and one of that name exists that the job does not own; it is
            neither changed nor deleted.
        ValueError: the job's spec is invalid.
    """
    if job.spec is None:
        raise ValueError(f"RLTrainingJob {job.namespace}/{job.name} has an invalid spec; nothing can be built")
    made = rt.children(job.uid)
    want = job.spec.resilience.checkpoint_on_drain
    if made.budget == want:
        return
    now = time.monotonic()
    if made.budget_conflict is not None and now - made.budget_conflict < BUDGET_CONFLICT_RETRY_SECONDS:
        return  # a budget of that name the job does not own: looked at again after a while, not on every reconcile
    name = api.disruption_budget_name(job.name)
    owner = resources.owner_reference(job)
    try:
        if not want:
            if made.budget is None:  # not made by this process: one GET (as many calls as the DELETE it replaces)
                current = rt.kube.get(kube.PDBS, job.namespace, name)
                if current is not None and owned_by(current, job.uid):
                    rt.kube.delete(kube.PDBS, job.namespace, name)
                elif current is not None:  # not the job's, and the job wants none: nothing to do but say so once
                    log.info(f"PodDisruptionBudget {job.namespace}/{name} is not the job's; left alone")
            else:
                rt.kube.delete(kube.PDBS, job.namespace, name)
        else:
            try:
                rt.kube.create(kube.PDBS, job.namespace, resources.build_disruption_budget(job))
            except kube.KubeError as e:
                if e.not_found:
                    log.warning(f"PodDisruptionBudget {job.namespace}/{name} not created: this API server does not "
                                f"serve policy/v1 ({e}); a drain will evict the job's pods without waiting for a "
                                f"checkpoint")
                elif not e.conflict:
                    raise
                else:  # gone since: made.budget is True, made again with the next cluster
                    read_back_own(rt.kube, kube.PDBS, job.namespace, name, owner)
    except ChildConflict:
        made.budget_conflict = now
        raise
    made.budget = want
    made.budget_conflict = None


def ensure_network_policy(k: kube.KubeAPI, body: dict[str, Any]) -> None:
    """Create the job's NetworkPolicy; when it exists with another spec digest (written from other operator settings:
    ``--metrics-namespace``, ``--operator-namespace``, the operator's pod labels), patch its spec and digest.

    Raises:
        kube.KubeError: an API call failed (the create other than with 409 Conflict, or the get or patch).
        ChildConflict: a NetworkPolicy of that name exists that the job does not own (not patched).
    """
    meta = body["metadata"]
    try:
        k.create(kube.NETWORKPOLICIES, meta["namespace"], body)
        return
    except kube.KubeError as e:
        if not e.conflict:
            raise
    current = read_back_own(k, kube.NETWORKPOLICIES, meta["namespace"], meta["name"], meta["ownerReferences"][0]) or {}
    digest = meta["annotations"][api.SPEC_DIGEST_ANNOTATION]
    if ((current.get("metadata") or {}).get("annotations") or {}).get(api.SPEC_DIGEST_ANNOTATION) != digest:
        k.patch(kube.NETWORKPOLICIES, meta["namespace"], meta["name"],
                {"metadata": {"annotations": {api.SPEC_DIGEST_ANNOTATION: digest}}, "spec": body["spec"]})


def execute(rt: Runtime, job: JobView, observed: Observed, action: Any, logger: Any) -> None:
    """Carry out one action. Raises on failure (the caller records it).

    Raises:
        RayUnreachable: no head address yet, or the Ray dashboard did not answer (``Submit``, ``StopJob``,
            ``RequestCheckpoint``).
        kube.KubeError: a Kubernetes API call failed (``EnsureChildren``, ``DeleteCluster``, ``DeletePods``,
            ``EnsureServing``, reading the token Secret for ``RequestCheckpoint``).
        RuntimeError: Ray refused a submission or a stop for another reason (the message says why).
        ChildConflict: (a ``RuntimeError``) a child's name is held by an object the job does not own
            (``EnsureChildren``, ``EnsureServing``: :func:`check_child_owned`).
        ValueError: the job's spec is invalid, or its serving LoRA URI is not an object-store URI.
        TypeError: ``action`` is not one of the :data:`~daedalus_operator.plan.Action` types (never for a plan's).
    """
    k = rt.kube
    c = observed.cluster
    if isinstance(action, EnsureChildren):
        ensure_children(rt, job, cluster_exists=c.exists)
    elif isinstance(action, DeleteCluster):
        k.delete(kube.RAYCLUSTERS, job.namespace, api.raycluster_name(job.name))
        made = rt.children(job.uid)
        made.present.discard(kube.RAYCLUSTERS)
        made.cluster_created = None
        # the budget holds no pod without the cluster (suspended, ended, recreated): gone with it, made again by the
        # EnsureChildren of the next cluster. Only one this process made or found to be the job's is deleted
        # (another process's stays, harmless without pods, until that EnsureChildren reads it back, or the job goes).
        if made.budget:
            k.delete(kube.PDBS, job.namespace, api.disruption_budget_name(job.name))
        made.budget = None
    elif isinstance(action, Submit):
        if not c.dashboard_url:
            raise RayUnreachable("no head address to submit to")
        env = {api.ENV_PORT: str(rt.settings.control_port),
               api.ENV_ATTEMPT: str(action.attempt), api.ENV_JOB: job.name, api.ENV_NAMESPACE: job.namespace,
               api.ENV_SUBMISSION_ID: action.submission_id}
        result = rt.ray_jobs(c.dashboard_url, _token(rt, job)).submit(
            action.submission_id, rt.settings.render_entrypoint(), env_vars=env,
            metadata={"daedalus.dev/job": job.name, "daedalus.dev/namespace": job.namespace,
                      "daedalus.dev/attempt": str(action.attempt)})
        logger.info(f"Ray job {action.submission_id} {'submitted' if result.created else 'was already submitted'}")
    elif isinstance(action, RequestCheckpoint):
        previous = rt.calls.get(action.submission_id)
        if previous.error and previous.http_status == 401:
            rt.tokens.pop(job.uid, None)  # the Secret was replaced: read the token again
        if not c.control_url:
            raise RayUnreachable("no head address for the checkpoint request")
        control = TrainerControl(c.control_url, token=_token(rt, job), timeout=rt.settings.request_timeout)
        wait = float(job.spec.resilience.checkpoint_timeout_seconds) if job.spec else 300.0
        if rt.calls.start(action.submission_id, control, wait, stop=action.stop, owner=job.uid):
            logger.info(f"{'stop after a checkpoint' if action.stop else 'checkpoint'} requested from the trainer of "
                        f"{action.submission_id} (step >= {action.target_step})")
    elif isinstance(action, StopJob):
        if c.dashboard_url:
            stopped = rt.ray_jobs(c.dashboard_url, _token(rt, job)).stop(action.submission_id)
            if stopped:
                logger.info(f"Ray job {action.submission_id} asked to stop")
    elif isinstance(action, DeletePods):
        for name in action.names:
            k.delete(kube.PODS, job.namespace, name)
        logger.info(f"deleted pods on nodes that must not run them: {', '.join(action.names)}")
    elif isinstance(action, EnsureServing):
        body = resources.build_rayservice(job, job.serving_lora_uri or "")
        try:
            k.create(kube.RAYSERVICES, job.namespace, body)
        except kube.KubeError as e:
            if not e.conflict:
                raise
            # ours with the index lagging, or another's: ChildConflict then
            read_back_own(k, kube.RAYSERVICES, job.namespace, body["metadata"]["name"], resources.owner_reference(job))
    else:  # pragma: no cover - the Action union is closed
        raise TypeError(f"unknown action {action!r}")


# ------------------------------------------------------------------------------------------------ one reconcile
#: Prefix of kopf's own annotations on a job (set at startup): progress storage (``<prefix>/reconcile`` while a
#: handler is retried, ``<prefix>/touch-dummy``) and the diff-base (``<prefix>/last-handled-configuration``).
KOPF_ANNOTATION_PREFIX = "kopf.daedalus.dev"


def bookkeeping_only(planned: dict[str, Any], fresh: dict[str, Any]) -> bool:
    """Whether the job went from ``planned`` (the body a reconcile planned from) to ``fresh`` (read again after its
    status write was answered 409 Conflict) by kopf's own bookkeeping alone: a new ``resourceVersion`` and changes
    only in ``metadata.managedFields``, ``metadata.finalizers`` (kopf adds ours right after a job's creation) and
    annotations under :data:`KOPF_ANNOTATION_PREFIX`. Nothing a reconcile reads (spec, status, generation, other
    annotations, ``deletionTimestamp``) changed, so the status it planned is still the one to write."""

    def strip(body: dict[str, Any]) -> dict[str, Any]:
        meta = {k: v for k, v in (body.get("metadata") or {}).items()
                if k not in ("resourceVersion", "managedFields", "finalizers", "annotations")}
        notes = {k: v for k, v in ((body.get("metadata") or {}).get("annotations") or {}).items()
                 if not k.startswith(KOPF_ANNOTATION_PREFIX + "/")}
        return {**body, "metadata": {**meta, **({"annotations": notes} if notes else {})}}

    planned_rv = (planned.get("metadata") or {}).get("resourceVersion")
    return (fresh.get("metadata") or {}).get("resourceVersion") != planned_rv and strip(planned) == strip(fresh)


def write_status(rt: Runtime, namespace: str, name: str, body: dict[str, Any], patch: dict[str, Any],
                 logger: Any) -> dict[str, Any]:
    """Write the status merge ``patch`` planned from ``body``, guarded by ``body``'s ``resourceVersion``; returns the
    job as written.

    A 409 Conflict is answered by one GET: when kopf's own bookkeeping is all that changed since ``body``
    (:func:`bookkeeping_only`: its finalizer, progress or diff-base annotations, written by kopf on the job between
    this reconcile's read and its write), the same patch is sent again, guarded by the fresh ``resourceVersion``; the
    status on the server is then the one planned from, so nothing newer is overwritten. Any other change (another
    writer's status, the spec, an annotation of anyone else) is re-planned from fresh state by kopf's retry.

    Raises:
        kopf.TemporaryError: the write failed (a 409 not explained by kopf's bookkeeping, a second 409, or an API
            error).
    """
    def send(version: str) -> dict[str, Any]:
        return rt.kube.patch(kube.RLTJ, namespace, name, {"metadata": {"resourceVersion": version}, "status": patch},
                             status=True)

    try:
        return send(body["metadata"]["resourceVersion"])
    except kube.KubeError as e:
        failure = e
    if failure.conflict:
        try:
            fresh = rt.kube.get(kube.RLTJ, namespace, name)
        except kube.KubeError:
            fresh = None
        if fresh is not None and bookkeeping_only(body, fresh):
            logger.debug(f"status write answered 409 after kopf's own write on the job (resourceVersion "
                         f"{body['metadata']['resourceVersion']} -> {fresh['metadata']['resourceVersion']}); "
                         f"sent again")
            try:
                return send(fresh["metadata"]["resourceVersion"])
            except kube.KubeError as e:
                failure = e
    raise kopf.TemporaryError(f"status write failed ({failure}); re-planning from fresh state", delay=1.0)


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def reconcile(rt: Runtime, namespace: str, name: str, indexes: dict[str, Any], logger: Any,
              *, wait_for_lock: bool = True) -> Plan | None:
    """Reconcile one job (see the module docstring). Returns the last plan (``None`` when skipped: the job is gone
    or another reconcile of it is running). ``wait_for_lock``: wait up to 30 s for another reconcile of the same
    job to finish, then skip (False: skip at once, as the poll timer does).

    Raises:
        kopf.TemporaryError: reading the job or another API call failed, or the status write failed (conflict or
            API error); kopf retries.
        ValueError: a time in the job's status is not an RFC 3339 timestamp (a status edited by hand before the CRD
            had ``format: date-time``; :func:`gather`).
    """
    started = time.monotonic()
    # The lock first, then the GET: a reconcile that waited here for another one of the same job (kopf starts
    # on.resume and the timer's first tick together at every operator start, on.create and the timer at a job's
    # creation) plans from the job as that one left it. A body read before the wait was stale by the other's status
    # write, so its guarded write was answered 409 (and kopf's retry of the handler then wrote its progress
    # annotations, racing the next reconcile's write).
    lock = rt.lock_for(f"{namespace}/{name}")
    if not lock.acquire(timeout=30.0 if wait_for_lock else 0.0):
        return None
    try:
        try:
            body = rt.kube.get(kube.RLTJ, namespace, name)
        except kube.KubeError as e:
            rt.metrics.reconciles.labels(result="error").inc()
            rt.metrics.reconcile_seconds.observe(time.monotonic() - started)
            raise kopf.TemporaryError(f"API error reading the job: {e}", delay=2.0) from None
        rt.last_api_ok = time.monotonic()
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return None
        return _reconcile_locked(rt, namespace, name, body, indexes, logger, started)
    finally:
        lock.release()


def _reconcile_locked(rt: Runtime, namespace: str, name: str, body: dict[str, Any], indexes: dict[str, Any],
                      logger: Any, started: float) -> Plan | None:
    """:func:`reconcile` once it holds the job's lock and has read ``body`` (fresh, not being deleted); ``started``:
    ``time.monotonic()`` when the reconcile began, for its latency metric.

    Raises:
        kopf.TemporaryError: as :func:`reconcile`.
    """
    result = "ok"
    last: Plan | None = None
    uid = body["metadata"].get("uid", f"{namespace}/{name}")
    versions = {body["metadata"].get("resourceVersion")}
    first_phase = (body.get("status") or {}).get("phase")
    quiet = False
    trainer: TrainerObservation | None = None
    try:
        fingerprint = dependency_fingerprint(namespace, name, indexes)
        for loop in range(MAX_LOOPS):
            if loop:
                body = rt.kube.get(kube.RLTJ, namespace, name)
                if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
                    break
            job = job_view(body)
            if job.status_error is not None:
                result = "error"
                _report_unreadable_status(rt, body, job.status_error, logger)
                return None
            if job.uid in rt.unreadable:  # rare: no shared lock taken on every reconcile of every job
                with rt.guard:
                    rt.unreadable.pop(job.uid, None)
            observed = gather(rt, job, indexes)
            trainer = observed.trainer
            rt.children(job.uid).note_cluster(observed.cluster.exists)
            now = _utcnow()
            timing = Timing(poll=rt.settings.poll_interval, unreachable_grace=rt.settings.unreachable_grace,
                            pod_ready_grace=rt.settings.pod_ready_grace)
            last = plan(job, observed, now, timing)
            logger.debug(f"observed cluster ready={observed.cluster.ready} head={observed.cluster.head_host} "
                         f"pods={observed.health.pods}/{observed.health.ready_pods} ray={observed.ray_job.state.value} "
                         f"trainer={observed.trainer.step if observed.trainer.reachable else '-'} -> "
                         f"{last.phase.value} {[type(a).__name__ for a in last.actions]}")
            old = body.get("status") or {}
            new = compute_status(old, observed, last, None, job=job, now=now)
            patch = merge_patch(old, new)
            if patch:
                body = write_status(rt, namespace, name, body, patch, logger)
            for ev in last.events:
                kopf.event(body, type=ev.type.value, reason=ev.reason, message=ev.message[:1024])
            if observed.cluster.exists and job.spec is not None:
                # First look at a live job in this process: bring its NetworkPolicy up to date with this process's
                # settings now, not only when the next EnsureChildren runs (one 409 per job and operator start).
                try:
                    network_policy_once(rt, job)
                except (kube.KubeError, ChildConflict) as e:
                    logger.warning(f"NetworkPolicy of {namespace}/{name}: {e}; will retry")
                if not observed.cluster.deleting:  # follows an edit of spec.resilience.checkpointOnDrain at once
                    try:
                        disruption_budget_once(rt, job)
                    except (kube.KubeError, ChildConflict) as e:
                        logger.warning(f"PodDisruptionBudget of {namespace}/{name}: {e}; will retry")
            error = None
            for action in last.actions:
                try:
                    execute(rt, job, observed, action, logger)
                except (kube.KubeError, RayUnreachable, RuntimeError, ValueError) as e:
                    error = f"{type(action).__name__}: {e}"
                    logger.warning(f"{error}; will retry")
                    break
            if last.restart_reason:
                rt.metrics.count_restart(namespace, name, last.restart_reason)
            if last.recovered is not None:
                rt.metrics.recovery_seconds.observe(last.recovered.seconds)
            if error:
                result = "error"
                errored = compute_status(new, observed, last, error, job=job, now=now)
                epatch = merge_patch(new, errored)
                if epatch:
                    # Guarded like the first write (``body`` is the job as that one left it): a status another
                    # writer changed meanwhile stands; the next reconcile reports the failure again.
                    try:
                        body = write_status(rt, namespace, name, body, epatch, logger)
                    except kopf.TemporaryError as e:
                        logger.info(f"the failure was not recorded in the status: {e}")
                break
            if last.requeue_after is None:
                break
            result = "requeue"
            if last.requeue_after > 0:
                break
        if last is not None:
            st = body.get("status") or {} if body else {}
            rt.metrics.observe_job(namespace, name, st.get("phase") or last.phase.value, int(st.get("restarts") or 0))
            if body:
                versions.add((body.get("metadata") or {}).get("resourceVersion"))
            quiet = is_quiet(result, last, first_phase, st, rt.settings.poll_interval, trainer)
            rt.put_gate(uid, PollGate(quiet=quiet, budgeted=quiet and last.phase == api.Phase.RUNNING,
                                      fingerprint=fingerprint, versions=frozenset(versions), at=time.monotonic()))
        return last
    except kopf.TemporaryError:
        result = "error"
        raise
    except kube.KubeError as e:
        result = "error"
        raise kopf.TemporaryError(f"API error: {e}", delay=2.0) from None
    finally:
        if not quiet:  # an error, a requeue, or a job that left the loop early: look again on the next tick
            with rt.guard:
                gate = rt.gates.get(uid)
            if gate is not None and gate.quiet:
                rt.put_gate(uid, dataclasses.replace(gate, quiet=False, budgeted=False))
        rt.metrics.reconciles.labels(result=result).inc()
        rt.metrics.reconcile_seconds.observe(time.monotonic() - started)


def _report_unreadable_status(rt: Runtime, body: dict[str, Any], why: str, logger: Any) -> None:
    """Say once per problem (a Warning event on the job and an error in the log) that the reconcile leaves the job
    alone because this operator cannot read its status (``why``, from :func:`read_status`). Once per problem, not per
    ``resourceVersion``: kopf's retry bookkeeping in the job's annotations (a status write answered 409 because the
    status was just replaced) gives it a new one with the same unreadable status. A reconcile that reads the status
    again forgets the problem, so its return is reported anew."""
    uid = (body.get("metadata") or {}).get("uid", "")
    with rt.guard:
        if rt.unreadable.get(uid) == why:
            return
        rt.unreadable[uid] = why
    message = (f"this operator (daedalus {__version__}) cannot read the job's status, so it leaves the job, its "
               f"RayCluster and its Ray job as they are: {why}. Run the operator version that wrote it (a newer "
               "one?), or set the field it names to a value this version knows (docs/deploy.md)")
    logger.error(message)
    kopf.event(body, type="Warning", reason=STATUS_UNREADABLE, message=message[:1024])


# ------------------------------------------------------------------------------------------------ deletion
#: Phases in which a trainer runs and answers on its control port: deleting such a job first asks it for a checkpoint
#: (:func:`checkpoint_before_deletion`). Every other phase (Pending, Provisioning, Recovering, Suspended, Succeeded,
#: Failed) has no trainer to ask, or nothing left to save.
CHECKPOINT_ON_DELETE_PHASES = frozenset({api.Phase.RUNNING.value, api.Phase.CHECKPOINTING.value})

#: Seconds between the finalizer's looks at the checkpoint it is waiting for (the ``kopf.TemporaryError`` delay; the
#: call itself runs in the background, :class:`~daedalus_operator.submit.CheckpointCalls`).
DELETION_POLL_SECONDS = 1.0

#: Event reasons of the checkpoint before deletion: written (Normal), or why none was (Warning).
CHECKPOINTED_BEFORE_DELETION = "CheckpointedBeforeDeletion"
NO_CHECKPOINT_BEFORE_DELETION = "NoCheckpointBeforeDeletion"


@dataclasses.dataclass(frozen=True)
class DeletionFields:
    """The three status fields the finalizer reads (:func:`deletion_fields`).

    Attributes:
        phase: a :class:`~daedalus_operator.api.Phase` value (``"Pending"`` when the status has none: a job never
            reconciled); ``None`` when unreadable (see ``problem``).
        submission_id: ``status.submissionId``, ``None`` when absent or unreadable.
        submission_confirmed: ``status.submissionConfirmed`` when it is a boolean, else ``False`` (the finalizer then
            asks the Ray dashboard whether the job runs before waiting for its trainer).
        problem: why a field the checkpoint decision needs could not be read (the phase, or a ``submissionId`` that
            is there but not a string), with the value; ``None`` when both were read.
    """

    phase: str | None
    submission_id: str | None
    submission_confirmed: bool
    problem: str | None = None


def _held(value: Any) -> str:
    text = repr(value)
    return text[:80] + "..." if len(text) > 80 else text


def deletion_fields(status: Any) -> DeletionFields:
    """``phase``, ``submissionId`` and ``submissionConfirmed`` of a job's ``.status`` (``status``: the raw value, a
    mapping or ``None``), each read on its own: a status whose *other* fields this operator cannot read (a value of
    another operator version; :func:`read_status` refuses the whole of it) still tells the finalizer whether a
    trainer runs. A phase that is not one of :class:`~daedalus_operator.api.Phase` (a newer version's, or not a
    string) and, in a phase whose trainer runs (:data:`CHECKPOINT_ON_DELETE_PHASES`), a ``submissionId`` that is not
    a string are reported in ``problem``; a missing phase is ``Pending``.
    Never raises."""
    if status is None:
        status = {}
    if not isinstance(status, dict):
        return DeletionFields(None, None, False, f"status is not an object (it holds {_held(status)})")
    problems = []
    raw_phase = status.get("phase")
    if raw_phase is None or raw_phase == "":
        phase: str | None = api.Phase.PENDING.value
    elif isinstance(raw_phase, str) and raw_phase in {p.value for p in api.Phase}:
        phase = raw_phase
    else:
        phase = None
        problems.append(f"status.phase is not a phase this operator (daedalus {__version__}) knows "
                        f"(it holds {_held(raw_phase)})")
    raw_sid = status.get("submissionId")
    sid = raw_sid if isinstance(raw_sid, str) and raw_sid else None
    if raw_sid is not None and not isinstance(raw_sid, str) and (phase is None or phase in CHECKPOINT_ON_DELETE_PHASES):
        problems.append(f"status.submissionId is not a string (it holds {_held(raw_sid)})")
    confirmed = status.get("submissionConfirmed")
    return DeletionFields(phase, sid, confirmed if isinstance(confirmed, bool) else False,
                          "; ".join(problems) or None)


def deletion_checkpoint_key(submission_id: str) -> str:
    """The :class:`~daedalus_operator.submit.CheckpointCalls` key of the checkpoint asked for before deleting the
    attempt ``submission_id``: apart from the planner's call (keyed by the submission id alone), whose earlier
    success must not pass for this one."""
    return f"{submission_id}/deletion"


@dataclasses.dataclass(frozen=True)
class DeletionCheckpoint:
    """How the checkpoint step of a deletion ended. ``step``/``path``: the checkpoint the trainer wrote (``None``: none
    was); ``reason``/``message``: the event (``reason`` ``None``: a log line only, for a job without a running
    trainer); ``warning``: the event is a Warning."""

    message: str
    step: int | None = None
    path: str | None = None
    reason: str | None = None
    warning: bool = False


def checkpoint_before_deletion(rt: Runtime, body: dict[str, Any], cluster: Any, cluster_error: str | None,
                               waited: float) -> DeletionCheckpoint:
    """Ask the running trainer of a job being deleted to checkpoint and stop before its Ray job is stopped, bounded.

    The job's checkpoints live in ``<checkpoint.path>/<namespace>/<name>`` (:func:`api.checkpoint_root`) and every
    attempt starts with ``--resume latest``, so a job created again under the same name (``kubectl delete`` then
    ``apply``, Argo CD's replace) resumes from the checkpoint written here instead of the last periodic one.

    The status is read field by field (:func:`deletion_fields`): other fields this operator cannot read do not stop
    the checkpoint; a phase it cannot read (a newer version's, or not a string) gives no checkpoint, at once, with a
    Warning ``NoCheckpointBeforeDeletion`` that names the value: whether a trainer runs is unknown, and the deletion
    must not be held by a status the operator cannot mend.

    Only a job whose status phase is in :data:`CHECKPOINT_ON_DELETE_PHASES`, with a submission id, whose RayCluster
    exists and is not being deleted, whose Ray job has not ended, and whose submission was confirmed (or the dashboard
    reports it running) is asked: ``POST /stop`` (the job's token)
    through :class:`~daedalus_operator.submit.CheckpointCalls` under :func:`deletion_checkpoint_key`, in the
    background; each later call of this function (kopf retries the finalizer) reads the call's state. ``/stop``
    rather than ``/checkpoint``: the trainer exits right after the checkpoint, so no step runs between it and the Ray
    job's stop (measured with the stand-in trainer at 0.3 s per step: ``/checkpoint`` lost the 2 steps run until the
    finalizer's next look; ``/stop`` none). A failure that asking again may mend
    (:attr:`~daedalus_operator.plan.CheckpointCall.retryable`: no answer, 401 with the token read again) is asked
    again, unless the Ray job has meanwhile ended. The wait ends at :func:`deletion_checkpoint_bound` seconds of
    ``waited``; the trainer is told that much as its ``?timeout=``.

    Args:
        rt: the runtime (settings, calls, tokens, the Kubernetes client for the token Secret).
        body: the job being deleted.
        cluster: its RayCluster as :func:`~daedalus_operator.nodes.read_cluster` read it (nothing when unknown).
        cluster_error: why reading the RayCluster failed (``None``: it was read).
        waited: seconds since the deletion was first seen (``deletionTimestamp`` or this process, the later).

    Returns:
        The outcome, once there is one: the checkpoint written, or why none was.

    Raises:
        kopf.TemporaryError: still waiting (the call in flight, a retry started, the RayCluster or the token Secret not
            readable yet) and the bound not reached; ``delay`` at most :data:`DELETION_POLL_SECONDS`.
    """
    fields = deletion_fields(body.get("status"))
    if fields.problem is not None:
        return DeletionCheckpoint(f"no checkpoint before deletion: {fields.problem}, so whether a trainer runs is "
                                  "unknown; the deletion goes on without one, and steps since the latest checkpoint "
                                  "may be lost", reason=NO_CHECKPOINT_BEFORE_DELETION, warning=True)
    phase, sid = fields.phase, fields.submission_id
    if phase not in CHECKPOINT_ON_DELETE_PHASES or not sid:
        return DeletionCheckpoint(f"no checkpoint before deletion: the job is {phase}, no trainer runs")
    job = job_view(body)
    limit = float(job.spec.resilience.checkpoint_timeout_seconds) if job.spec else 300.0
    bound = deletion_checkpoint_bound(limit, rt.settings.deletion_timeout)
    left = bound - waited
    key = deletion_checkpoint_key(sid)

    def wait(why: str) -> kopf.TemporaryError:
        return kopf.TemporaryError(f"{why}; the Ray job is stopped after the checkpoint, at the latest {bound:g} s "
                                   "after the deletion", delay=min(DELETION_POLL_SECONDS, max(0.2, left)))

    def none(why: str) -> DeletionCheckpoint:
        return DeletionCheckpoint(f"no checkpoint before deletion of attempt {sid}: {why}; steps since the latest "
                                  f"checkpoint are lost", reason=NO_CHECKPOINT_BEFORE_DELETION, warning=True)

    if cluster_error is not None:
        if left > 0:
            raise wait(f"reading the RayCluster to ask the trainer for a checkpoint: {cluster_error}")
        return none(f"the RayCluster could not be read within {bound:g} s ({cluster_error})")
    if not cluster.exists or cluster.deleting:
        return none("its RayCluster is " + ("already being deleted (a foreground cascading deletion deletes it with "
                                            "the job)" if cluster.exists else "gone"))
    if not cluster.control_url:
        return none("its RayCluster has no head address")
    call = rt.calls.get(key)
    if call.step is not None:
        return DeletionCheckpoint(f"checkpoint at step {call.step} written before deletion of attempt {sid} "
                                  f"({call.path}); the job resumes from it if created again under this name",
                                  step=call.step, path=call.path, reason=CHECKPOINTED_BEFORE_DELETION)
    if call.in_flight:
        if left > 0:
            raise wait(f"waiting for the trainer's checkpoint before stopping Ray job {sid}")
        return none(f"the trainer wrote no checkpoint within {bound:g} s")
    if call.error is not None and not call.retryable:
        if call.http_status == 409:  # the trainer had already ended: nothing runs that a checkpoint could save
            return DeletionCheckpoint(f"no checkpoint before deletion of attempt {sid}: the trainer had already ended "
                                      f"({call.error}); its latest checkpoint stands",
                                      reason=NO_CHECKPOINT_BEFORE_DELETION)
        return none(f"the trainer answered {call.error}")
    if left <= 0:
        return none(f"no answer from the trainer within {bound:g} s" + (f" ({call.error})" if call.error else ""))
    # Before every request, the first and each retry: is there a trainer to ask at all? (One that died after the first
    # request answers each retry with a refused connection, retryable, until the bound.)
    ray_job = rt.ray_jobs(cluster.dashboard_url, _token(rt, job)).status(sid) if cluster.dashboard_url else None
    if ray_job is not None and (ray_job.state.ended or ray_job.state == RayJobState.NOT_FOUND):
        if call.error is None:
            return DeletionCheckpoint(f"no checkpoint before deletion: Ray job {sid} is "
                                      f"{ray_job.state.value.lower()}, no trainer runs")
        return none(f"Ray job {sid} ended ({ray_job.state.value.lower()}) while the trainer was asked ({call.error})")
    if call.error is None:
        # A submission never confirmed (its dashboard did not answer) that the dashboard does not now report running
        # has no trainer known to run: not waited for, else a dead head would hold the deletion for the whole bound.
        if not fields.submission_confirmed and not (ray_job is not None and ray_job.state.active):
            return none("its submission was never confirmed running and the Ray dashboard does not report it "
                        "running" + (f" ({ray_job.message})" if ray_job is not None and ray_job.message else ""))
    if call.http_status == 401:
        rt.tokens.pop(job.uid, None)  # the Secret was replaced: read the token again
    try:
        token = _token(rt, job)
    except kube.KubeError as e:
        raise wait(f"reading the control token for the checkpoint before deletion: {e}") from None
    control = TrainerControl(cluster.control_url, token=token, timeout=rt.settings.request_timeout)
    rt.calls.start(key, control, left, stop=True, owner=job.uid, attempt=sid)
    raise wait(f"checkpoint requested from the trainer of {sid} before stopping it"
               + (f" (again, after: {call.error})" if call.error else ""))


#: Share of ``--deletion-timeout`` kept for stopping the Ray job and deleting the children (and their retries) after
#: the checkpoint before deletion: that waits at most the rest (:func:`deletion_checkpoint_bound`).
DELETION_CLEANUP_SHARE = 0.25

#: Seconds one finalizer call waits in-process for the checkpoint before deletion before handing back to kopf with a
#: ``kopf.TemporaryError``: kopf logs each of those at ERROR and posts it as an Error event, so the usual checkpoint
#: (seconds) posts none and a frozen trainer one per this many seconds; a kopf worker thread is held meanwhile.
DELETION_WAIT_SECONDS = 10.0


def deletion_checkpoint_bound(checkpoint_timeout: float, deletion_timeout: float) -> float:
    """Seconds from the deletion that the checkpoint before deletion may take: ``checkpointTimeoutSeconds``, at most
    ``(1 - DELETION_CLEANUP_SHARE) * deletion_timeout`` (90 s of the default 120 s), so the Ray job stop and the child
    deletes keep time for their retries before the finalizer is released."""
    return min(float(checkpoint_timeout), (1.0 - DELETION_CLEANUP_SHARE) * deletion_timeout)


def finalize(rt: Runtime, body: dict[str, Any], logger: Any) -> None:
    """Checkpoint a running trainer (:func:`checkpoint_before_deletion`), stop the Ray job, delete every child (an
    object holding a child's name that the job does not own, :func:`check_child_owned`, is left alone); give
    up (and let kopf release the finalizer) after ``deletion_timeout`` seconds from ``deletionTimestamp``. The job's
    records in this process are dropped: its token, poll gate, children and the Ray client of its RayCluster's
    dashboard on every pass, its checkpoint calls (of every attempt; one in flight when it ends), unreadable-status
    record and metrics series on release.

    The checkpoint's outcome is logged, and for a job whose trainer was running posted as an event
    (``CheckpointedBeforeDeletion`` with the step, or Warning ``NoCheckpointBeforeDeletion`` with the reason), once
    per deletion.

    Raises:
        kopf.TemporaryError: waiting for the checkpoint, or something failed, and the deadline has not passed yet.
    """
    meta = body.get("metadata") or {}
    namespace, name = meta["namespace"], meta["name"]
    uid = meta.get("uid", f"{namespace}/{name}")
    # deletionTimestamp has one-second resolution; the first time this process saw the deletion bounds it from the
    # other side (after an operator restart the wait is at most one more deletion_timeout).
    started = parse_time(meta.get("deletionTimestamp")) or _utcnow()
    with rt.guard:
        first_seen = rt.deleting.setdefault(uid, time.monotonic())

    def elapsed() -> float:
        return min((_utcnow() - started).total_seconds(), time.monotonic() - first_seen)

    waited = elapsed()
    problems: list[str] = []
    sid = deletion_fields(body.get("status")).submission_id
    cluster_error = None
    try:
        cluster_body = rt.kube.get(kube.RAYCLUSTERS, namespace, api.raycluster_name(name)) if rt.kube else None
    except kube.KubeError as e:  # within the deadline like every other failure here (kopf alone retries for ever)
        cluster_error = f"get raycluster/{api.raycluster_name(name)}: {e}"
        problems.append(cluster_error)
        cluster_body = None  # unknown: no Ray job stop; the deletes below are still tried
    job_uid = meta.get("uid", "")
    foreign_cluster = cluster_body is not None and not owned_by(cluster_body, job_uid)
    if foreign_cluster:  # the name is held by another object (handlers.ChildConflict): neither asked nor deleted
        cluster_body = None
    cluster = read_cluster(cluster_body, control_port=rt.settings.control_port)
    with rt.guard:
        decided = uid in rt.deletion_checkpoints
    if not decided:
        # Waited for here, in steps of the call's delay, for up to DELETION_WAIT_SECONDS: each TemporaryError handed
        # to kopf becomes an ERROR log line and an Error event on the job.
        slice_end = time.monotonic() + DELETION_WAIT_SECONDS
        while True:
            try:
                outcome = checkpoint_before_deletion(rt, body, cluster, cluster_error, waited)
                break
            except kopf.TemporaryError as e:
                if cluster_error is not None or time.monotonic() + (e.delay or 0.0) > slice_end:
                    raise
                time.sleep(e.delay or 0.0)
                waited = elapsed()
        with rt.guard:
            rt.deletion_checkpoints[uid] = outcome
        (logger.warning if outcome.warning else logger.info)(outcome.message)
        if outcome.reason:
            kopf.event(body, type="Warning" if outcome.warning else "Normal", reason=outcome.reason,
                       message=outcome.message[:1024])
    if sid and cluster.dashboard_url and not cluster.deleting:
        try:
            rt.ray_jobs(cluster.dashboard_url, _token(rt, job_view(body))).stop(sid)
        except (RayUnreachable, RuntimeError) as e:
            problems.append(f"stop {sid}: {e}")
    if cluster.dashboard_url:  # this job's Ray client (its RayCluster goes now; a retry of this handler makes another)
        with rt.guard:
            rt.ray.pop(cluster.dashboard_url, None)
    owner = {"kind": api.KIND, "name": name, "uid": job_uid}
    for key, child in ((kube.RAYSERVICES, api.rayservice_name(name)), (kube.RAYCLUSTERS, api.raycluster_name(name)),
                       (kube.NETWORKPOLICIES, api.network_policy_name(name)),
                       (kube.PDBS, api.disruption_budget_name(name)),
                       (kube.CONFIGMAPS, api.config_map_name(name)), (kube.SECRETS, api.secret_name(name))):
        if key == kube.RAYCLUSTERS and (foreign_cluster or cluster_error is not None):
            continue  # another's, or its owner unknown (the GET failed: in problems, so retried; else the GC's)
        if key != kube.RAYCLUSTERS:  # read back first (the RayCluster was, above): only the job's own is deleted
            try:
                if read_back_own(rt.kube, key, namespace, child, owner, allow_unowned=key == kube.SECRETS) is None:
                    continue
            except kube.KubeError as e:
                problems.append(f"get {key.split('/')[-1]}/{child}: {e}")
                continue
            except ChildConflict as e:
                logger.info(f"not deleted: {e}")
                continue
        try:
            rt.kube.delete(key, namespace, child)
        except kube.KubeError as e:
            problems.append(f"delete {key.split('/')[-1]}/{child}: {e}")
    if sid:
        rt.calls.forget(sid)
    rt.tokens.pop(meta.get("uid", ""), None)
    rt.put_gate(meta.get("uid", ""), None)
    with rt.guard:
        rt.made.pop(meta.get("uid", ""), None)
    if problems and waited < rt.settings.deletion_timeout:
        raise kopf.TemporaryError("; ".join(problems), delay=min(2.0, max(0.2, rt.settings.deletion_timeout - waited)))
    with rt.guard:
        rt.deleting.pop(uid, None)
        rt.deletion_checkpoints.pop(uid, None)
        rt.unreadable.pop(meta.get("uid", ""), None)
    rt.calls.retain(meta.get("uid", ""), None)  # every attempt's entries (a call in flight: when it ends)
    if problems:
        logger.warning(f"releasing the finalizer after {waited:.0f} s despite: {'; '.join(problems)}")
    rt.metrics.forget_job(namespace, name)


# ------------------------------------------------------------------------------------------------ registration
def register(registry: kopf.OperatorRegistry, rt: Runtime) -> None:
    """Register every handler of the operator on ``registry`` with the runtime ``rt``."""
    s = rt.settings

    @kopf.on.login(id="login", registry=registry)
    def login(**kwargs: Any) -> Any:
        if s.kubeconfig is None and _in_cluster():
            return kopf.login_with_service_account(**kwargs)
        return login_with_kubeconfig_file(s.kubeconfig)

    @kopf.on.startup(id="startup", registry=registry)
    def startup(settings: kopf.OperatorSettings, logger: Any, **_: Any) -> None:
        settings.persistence.finalizer = api.FINALIZER
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=KOPF_ANNOTATION_PREFIX)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=KOPF_ANNOTATION_PREFIX, key="last-handled-configuration")
        settings.posting.level = logging.WARNING
        settings.execution.max_workers = max(4, s.max_workers)
        settings.background.cancellation_polling = TIMER_EXIT_POLL_SECONDS
        if s.watch_timeout:
            settings.watching.server_timeout = int(s.watch_timeout)  # the API server parses an integer
            settings.watching.client_timeout = s.watch_timeout + 30
            settings.watching.inactivity_timeout = s.watch_timeout + 10
        if rt.kube is None:
            rt.kube = kube.KubeAPI(kube.api_client_from_environment(s.kubeconfig), timeout=s.request_timeout * 2)
        logger.info(f"daedalus operator: poll {s.poll_interval} s, control port {s.control_port}, "
                    f"entrypoint {s.render_entrypoint()!r}")

    @kopf.index("pods", labels={api.JOB_LABEL: kopf.PRESENT}, id="pods_by_job", registry=registry)
    def pods_by_job(namespace: str, labels: dict, body: Any, **_: Any) -> dict:
        return {(namespace, labels[api.JOB_LABEL]): dict(body)}

    @kopf.index("nodes", id="nodes_by_name", registry=registry)
    def nodes_by_name(name: str, body: Any, **_: Any) -> dict:
        return {name: dict(body)}

    @kopf.index(api.RAY_GROUP, api.RAY_VERSION, api.RAYCLUSTER_PLURAL, labels={api.JOB_LABEL: kopf.PRESENT},
                id="clusters_by_job", registry=registry)
    def clusters_by_job(namespace: str, labels: dict, body: Any, **_: Any) -> dict:
        return {(namespace, labels[api.JOB_LABEL]): dict(body)}

    @kopf.index(api.RAY_GROUP, api.RAY_VERSION, api.RAYSERVICE_PLURAL, labels={api.JOB_LABEL: kopf.PRESENT},
                id="services_by_job", registry=registry)
    def services_by_job(namespace: str, labels: dict, body: Any, **_: Any) -> dict:
        return {(namespace, labels[api.JOB_LABEL]): dict(body)}

    def _indexes(kw: dict[str, Any]) -> dict[str, Any]:
        return {k: kw.get(k) for k in ("pods_by_job", "nodes_by_name", "clusters_by_job", "services_by_job")}

    @kopf.on.resume(*RLTJ, id="reconcile", registry=registry)
    @kopf.on.create(*RLTJ, id="reconcile", registry=registry)
    @kopf.on.update(*RLTJ, field="spec", id="reconcile", registry=registry)
    def on_change(namespace: str, name: str, logger: Any, **kw: Any) -> None:
        reconcile(rt, namespace, name, _indexes(kw), logger)

    @kopf.timer(*RLTJ, interval=s.poll_interval, id="poll", registry=registry)
    def poll(namespace: str, name: str, body: Any, logger: Any, **kw: Any) -> None:
        indexes = _indexes(kw)
        if rt.should_poll(dict(body), indexes, logger):
            reconcile(rt, namespace, name, indexes, logger, wait_for_lock=False)

    @kopf.on.delete(*RLTJ, id="finalize", registry=registry)
    def on_delete(body: Any, logger: Any, **_: Any) -> None:
        finalize(rt, dict(body), logger)

    @kopf.on.probe(id="api", registry=registry)
    def probe_api(**_: Any) -> str:
        return liveness(rt)


#: How often kopf checks whether the poll timer of a deleted job has stopped, before it releases the finalizer
#: (``settings.background.cancellation_polling``, 60 s by default). The timer's reconcile runs in a worker thread, so
#: a deletion that lands while one runs cannot stop it at once; with the default, that ``kubectl delete`` took a
#: minute more than the finalizer (measured in the cluster tier: the job still there 40 s after the delete).
TIMER_EXIT_POLL_SECONDS = 1.0

#: Seconds the liveness check waits for ``GET /version``: well inside the probe's own timeout (the chart's
#: ``probes.liveness.timeoutSeconds``, 5), so a server that drops packets makes the check answer "degraded" in time
#: rather than time the probe out (three timed-out probes restart the pod after ~60 s, before ``--liveness-stale``).
LIVENESS_API_TIMEOUT = 2.0


def liveness(rt: Runtime) -> str:
    """The liveness probe's check: can this process reach the API server? ``GET /version`` within
    :data:`LIVENESS_API_TIMEOUT` seconds; any HTTP answer counts, a 401/403 included (the server answered: a restart
    would not help, and a namespaced operator may not be allowed much cluster-wide). Only no answer for
    ``liveness_stale`` seconds fails the probe; before that the check answers "degraded".

    Raises:
        kopf.PermanentError: no answer from the API server for longer than ``settings.liveness_stale``.
    """
    try:
        rt.kube.version(timeout=min(LIVENESS_API_TIMEOUT, rt.kube.timeout))
    except kube.KubeError as e:
        if not e.status:  # no HTTP answer: connection refused, timeout, TLS failure
            age = time.monotonic() - rt.last_api_ok
            if age > rt.settings.liveness_stale:
                raise kopf.PermanentError(f"the API server has not answered for {age:.0f} s: {e}") from None
            return f"degraded ({age:.0f} s since the last answer)"
    rt.last_api_ok = time.monotonic()
    return "ok"


def login_with_kubeconfig_file(path: str | None) -> kopf.ConnectionInfo:
    """kopf credentials from a kubeconfig (``path``, else ``$KUBECONFIG`` read now, else ``~/.kube/config``) through
    the official client's loader, so exec plugins (``aws eks get-token``) and client certificates work.

    Raises:
        kopf.LoginError: the kubeconfig cannot be loaded.
    """
    import kubernetes

    cfg = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_kube_config(config_file=path or os.environ.get("KUBECONFIG") or None,
                                           client_configuration=cfg)
    except (kubernetes.config.ConfigException, OSError) as exc:
        raise kopf.LoginError(f"cannot load the kubeconfig {path or '(default)'}: {exc}") from exc
    header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix("authorization")
    parts = header.split(" ", 1) if header else []
    scheme, token = ((None, None) if not parts else (None, parts[0]) if len(parts) == 1 else (parts[0], parts[1]))
    return kopf.ConnectionInfo(server=cfg.host, ca_path=cfg.ssl_ca_cert, insecure=not cfg.verify_ssl,
                               username=cfg.username or None, password=cfg.password or None, scheme=scheme,
                               token=token, certificate_path=cfg.cert_file, private_key_path=cfg.key_file)


def _in_cluster() -> bool:
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))


def now_rfc3339() -> str:
    """Current time as RFC 3339 (for messages)."""
    return format_time(_utcnow())
