"""An honest in-memory Kubernetes API for operator tests: kmock's scaffold plus the semantics kopf and our operator rely
on, served over real HTTP from its own thread.

kmock 0.8 (by kopf's author) serves discovery, errors and a request log over a real aiohttp server, but its emulator
lacks what a controller depends on (docs/engineering-notes.md, "Kubernetes API for tests"). :class:`HonestKubernetes` is a
:class:`kmock.KubernetesScaffold` that keeps objects itself and fills those gaps:

- ``metadata.uid``, ``creationTimestamp``, ``namespace`` written into the object, ``generateName``;
- a global ``resourceVersion`` incremented on every write; a merge patch or PUT carrying a stale
  ``metadata.resourceVersion`` gets **409 Conflict** (each one recorded in :attr:`HonestKubernetes.conflicts`); a
  JSON patch whose ``test`` op fails gets **422** (what kopf's finalizer patch expects);
- ``metadata.generation`` starting at 1 and incremented only when something outside ``metadata`` and ``status``
  changes;
- **201** on create, **409 AlreadyExists** for a duplicate name, **404** for unknown objects, **415** for a
  strategic-merge patch on a custom resource;
- a separate **status subresource** for kinds declared with it: writes to ``/status`` change only ``status``, writes
  to the main resource never change ``status``, ``status`` is dropped on create (as the API server does for CRDs);
- finalizers: DELETE sets ``deletionTimestamp`` while finalizers remain; removing the last one deletes the object;
- **label selectors** (``=``, ``==``, ``!=``, ``in``, ``notin``, exists, ``!`` not exists) and ``metadata.name`` /
  ``metadata.namespace`` field selectors on LIST and WATCH;
- WATCH from a ``resourceVersion`` (replaying the event log after it; 410 Gone when it is older than the log),
  ``timeoutSeconds`` (the server ends the stream), live events afterwards;
- owner-reference garbage collection in the background policy (dependents of a deleted object are deleted);
- fault injection: :meth:`HonestKubernetes.fault` makes the next N matching requests fail with a status (or wait)
  *before* any state changes, as a real failed request would.

Not emulated: schema validation/pruning/defaulting (tests validate manifests against the real schemas instead),
admission, server-side apply, strategic-merge list semantics on built-ins (treated as a JSON merge patch), RBAC.

:class:`KubeServer` runs it on a loopback port in a thread and writes a kubeconfig; :class:`KubeClient` is a small
synchronous client for tests and the fake KubeRay.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import datetime as dt
import json
import random
import re
import string
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
import requests
import yaml
from kmock._internal import apps, enums, rendering

# ------------------------------------------------------------------------------------------------ resources
#: (group/version/plural) -> (kind, namespaced, has status subresource)
DEFAULT_RESOURCES: dict[str, tuple[str, bool, bool]] = {
    "daedalus.dev/v1alpha1/rltrainingjobs": ("RLTrainingJob", True, True),
    "ray.io/v1/rayclusters": ("RayCluster", True, True),
    "ray.io/v1/rayservices": ("RayService", True, True),
    "v1/pods": ("Pod", True, True),
    "v1/nodes": ("Node", False, True),
    "v1/configmaps": ("ConfigMap", True, False),
    "v1/secrets": ("Secret", True, False),
    "v1/events": ("Event", True, False),
    "v1/namespaces": ("Namespace", False, True),
    "v1/services": ("Service", True, True),
    "events.k8s.io/v1/events": ("Event", True, False),
    "networking.k8s.io/v1/networkpolicies": ("NetworkPolicy", True, False),
    "policy/v1/poddisruptionbudgets": ("PodDisruptionBudget", True, False),
    "kopf.dev/v1/kopfpeerings": ("KopfPeering", True, False),
    "kopf.dev/v1/clusterkopfpeerings": ("ClusterKopfPeering", False, False),
    "coordination.k8s.io/v1/leases": ("Lease", True, False),
}

BUILTIN_GROUPS = {"", "events.k8s.io", "networking.k8s.io", "coordination.k8s.io", "policy"}


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _key(resource: Any) -> str:
    group = resource.group or ""
    return f"{group + '/' if group else ''}{resource.version}/{resource.plural}"


class KubernetesError(Exception):
    """An API error answered as a ``Status`` object."""

    def __init__(self, code: int, reason: str, message: str):
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


# ------------------------------------------------------------------------------------------------ selectors
_REQ = re.compile(r"^\s*(?P<key>[^\s!=<>,()]+)\s*(?P<op>==|=|!=|in\b|notin\b)?\s*(?P<val>\(.*\)|[^,]*)?\s*$")


def _split_selector(selector: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in selector:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return parts


def label_selector_matches(selector: str | None, labels: dict[str, str]) -> bool:
    """Kubernetes label selector semantics (https://kubernetes.io/docs/concepts/overview/working-with-objects/labels/).

    Raises:
        KubernetesError: 400 for a selector it cannot parse.
    """
    if not selector:
        return True
    for req in _split_selector(selector):
        req = req.strip()
        if req.startswith("!"):
            if req[1:].strip() in labels:
                return False
            continue
        m = _REQ.match(req)
        if not m:
            raise KubernetesError(400, "BadRequest", f"unable to parse requirement: {req!r}")
        key, op, val = m.group("key"), (m.group("op") or "").strip(), (m.group("val") or "").strip()
        if not op:
            if key not in labels:
                return False
        elif op in ("=", "=="):
            if labels.get(key) != val:
                return False
        elif op == "!=":
            if labels.get(key) == val:
                return False
        elif op in ("in", "notin"):
            values = {v.strip() for v in val.strip("()").split(",") if v.strip()}
            if (labels.get(key) in values) != (op == "in") or (op == "in" and key not in labels):
                return False
    return True


def field_selector_matches(selector: str | None, obj: dict[str, Any]) -> bool:
    """``metadata.name`` and ``metadata.namespace`` field selectors (``=``, ``==``, ``!=``)."""
    if not selector:
        return True
    meta = obj.get("metadata") or {}
    for req in selector.split(","):
        m = re.match(r"^\s*([\w.]+)\s*(==|=|!=)\s*(.*?)\s*$", req)
        if not m or m.group(1) not in ("metadata.name", "metadata.namespace"):
            raise KubernetesError(400, "BadRequest", f"field label not supported: {req!r}")
        value = meta.get(m.group(1).split(".")[1])
        if (value == m.group(3)) != (m.group(2) != "!="):
            return False
    return True


# ------------------------------------------------------------------------------------------------ merge patch
def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


@dataclasses.dataclass
class Fault:
    """Make the next ``times`` requests matching (method, resource plural, subresource, name) fail with ``status``
    (or, with ``delay``, answer late)."""

    method: str
    plural: str | None = None
    subresource: str | None = None
    name: str | None = None
    status: int = 500
    times: int = 1
    delay: float = 0.0
    hits: int = 0

    def matches(self, method: str, plural: str | None, subresource: str | None, name: str | None) -> bool:
        return (self.times > 0 and self.method.upper() == method.upper()
                and (self.plural is None or self.plural == plural)
                and (self.subresource == subresource or self.subresource == "*")
                and (self.name is None or self.name == name))


@dataclasses.dataclass(frozen=True)
class Conflict:
    """A write refused with 409 Conflict because its ``metadata.resourceVersion`` (``sent``) was not the object's
    (``current``); ``key`` is ``group/version/plural``, ``subresource`` ``"status"`` or ``None``."""

    key: str
    namespace: str | None
    name: str
    subresource: str | None
    sent: str
    current: str


@attrs.define(kw_only=True)
class HonestKubernetes(kmock.KubernetesScaffold):
    """The stateful API server (see the module docstring). Declare extra resources with :meth:`declare`."""

    _store: dict[tuple[str, str | None, str], dict] = attrs.field(factory=dict, init=False)
    _info: dict[str, tuple[str, bool, bool]] = attrs.field(factory=dict, init=False)
    _rv: int = attrs.field(default=0, init=False)
    _log: list[tuple[int, str, dict]] = attrs.field(factory=list, init=False)
    _cond: asyncio.Condition | None = attrs.field(default=None, init=False)
    _faults: list[Fault] = attrs.field(factory=list, init=False)
    _lock: threading.RLock = attrs.field(factory=threading.RLock, init=False)
    #: Every write refused with 409 Conflict for a stale ``metadata.resourceVersion``, in order (not injected faults).
    conflicts: list[Conflict] = attrs.field(factory=list, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for key, (kind, namespaced, status) in DEFAULT_RESOURCES.items():
            self.declare(key, kind, namespaced=namespaced, status=status)

    # -- configuration (thread-safe) --------------------------------------------------------------------------
    def declare(self, key: str, kind: str, *, namespaced: bool = True, status: bool = True) -> None:
        """Serve ``group/version/plural`` (``v1/pods`` for the core group) in discovery and the store."""
        self._info[key] = (kind, namespaced, status)
        parts = key.split("/")
        plural = parts[-1]
        self.resources[key] = kmock.ResourceInfo(
            kind=kind, namespaced=namespaced, singular=kind.lower(),
            verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
            subresources={"status"} if status else set())
        _ = plural

    def fault(self, method: str, plural: str | None = None, *, subresource: str | None = None,
              name: str | None = None, status: int = 500, times: int = 1, delay: float = 0.0) -> Fault:
        """Fail (or delay) the next ``times`` matching requests before they change anything; returns the
        :class:`Fault` (its ``hits`` counts the requests it caught)."""
        f = Fault(method, plural, subresource, name, status, times, delay)
        with self._lock:
            self._faults.append(f)
        return f

    def snapshot(self, key: str, namespace: str | None, name: str) -> dict | None:
        """A deep copy of a stored object (``None`` if absent), for assertions."""
        with self._lock:
            obj = self._store.get((key, namespace, name))
            return copy.deepcopy(obj) if obj is not None else None

    def objects(self, key: str, namespace: str | None = None) -> list[dict]:
        """Deep copies of all stored objects of a resource (optionally one namespace)."""
        with self._lock:
            return [copy.deepcopy(o) for (k, ns, _), o in self._store.items()
                    if k == key and (namespace is None or ns == namespace)]

    @property
    def resource_version(self) -> int:
        return self._rv

    # -- request routing ---------------------------------------------------------------------------------------
    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        res = request.resource
        if res is None or res.plural is None or res.version is None:
            return await apps.RawHandler._handle(self, request)  # discovery & friends from the scaffold
        key = _key(res)
        if key not in self._info:
            return self._status(404, "NotFound", f"the server could not find the requested resource ({key})")
        try:
            await self._inject_faults(request)
            method = request.method.value if hasattr(request.method, "value") else str(request.method)
            if request.action == enums.action.WATCH:
                return await self._watch(request, key)
            if request.action == enums.action.LIST:
                return self._json(200, self._list(request, key))
            if request.action == enums.action.FETCH:
                return self._json(200, self._fetch(request, key))
            if request.action == enums.action.CREATE:
                obj = await self._create(request, key)
                return self._json(201, obj)
            if request.action == enums.action.UPDATE:
                return self._json(200, await self._patch(request, key))
            if method == "PUT" and request.name:
                return self._json(200, await self._replace(request, key))
            if request.action == enums.action.DELETE:
                return self._json(200, await self._delete(key, request.namespace, request.name, request.data))
            return self._status(405, "MethodNotAllowed", f"{method} is not supported here")
        except KubernetesError as e:
            return self._status(e.code, e.reason, e.message)

    async def _inject_faults(self, request: rendering.Request) -> None:
        method = request.method.value if hasattr(request.method, "value") else str(request.method)
        with self._lock:
            hit = next((f for f in self._faults if f.matches(method, request.resource.plural, request.subresource,
                                                              request.name)), None)
            if hit is not None:
                hit.times -= 1
                hit.hits += 1
        if hit is None:
            return
        if hit.delay:
            await asyncio.sleep(hit.delay)
        if hit.status >= 400:
            raise KubernetesError(hit.status, {409: "Conflict", 500: "InternalError", 503: "ServiceUnavailable",
                                               504: "Timeout"}.get(hit.status, "Fault"),
                                  f"injected fault: {method} {request.url.path} -> {hit.status}")

    # -- helpers -----------------------------------------------------------------------------------------------
    def _json(self, code: int, doc: Any) -> aiohttp.web.Response:
        return aiohttp.web.json_response(doc, status=code)

    def _status(self, code: int, reason: str, message: str) -> aiohttp.web.Response:
        return self._json(code, {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
                                 "code": code, "reason": reason, "message": message})

    def _ns(self, key: str, namespace: str | None) -> str | None:
        return namespace if self._info[key][1] else None

    def _get(self, key: str, namespace: str | None, name: str | None) -> dict:
        obj = self._store.get((key, self._ns(key, namespace), name or ""))
        if obj is None:
            raise KubernetesError(404, "NotFound", f'{key.split("/")[-1]} "{name}" not found')
        return obj

    async def _emit(self, key: str, etype: str, obj: dict) -> None:
        self._log.append((self._rv, key, {"type": etype, "object": copy.deepcopy(obj)}))
        if self._cond is None:
            self._cond = asyncio.Condition()
        async with self._cond:
            self._cond.notify_all()

    def _bump(self, obj: dict) -> None:
        self._rv += 1
        obj.setdefault("metadata", {})["resourceVersion"] = str(self._rv)

    @staticmethod
    def _spec_part(obj: dict) -> dict:
        return {k: v for k, v in obj.items() if k not in ("metadata", "status")}

    # -- verbs ---------------------------------------------------------------------------------------------------
    def _list(self, request: rendering.Request, key: str) -> dict:
        params = request.params
        with self._lock:
            items = [copy.deepcopy(o) for (k, ns, _), o in sorted(self._store.items(), key=lambda kv: kv[0][1:] and
                                                                  (kv[0][1] or "", kv[0][2]))
                     if k == key and (request.namespace is None or ns == request.namespace)
                     and label_selector_matches(params.get("labelSelector"),
                                                (o.get("metadata") or {}).get("labels") or {})
                     and field_selector_matches(params.get("fieldSelector"), o)]
            rv = str(self._rv)
        kind = self._info[key][0]
        return {"apiVersion": key.rsplit("/", 1)[0], "kind": f"{kind}List", "metadata": {"resourceVersion": rv},
                "items": items}

    def _fetch(self, request: rendering.Request, key: str) -> dict:
        with self._lock:
            obj = self._get(key, request.namespace, request.name)
            if request.subresource not in (None, "status"):
                raise KubernetesError(404, "NotFound", f"subresource {request.subresource} not found")
            return copy.deepcopy(obj)

    async def _create(self, request: rendering.Request, key: str) -> dict:
        body = request.data
        if not isinstance(body, dict):
            raise KubernetesError(400, "BadRequest", "the body must be a JSON object")
        kind, namespaced, has_status = self._info[key]
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if namespaced:
            if request.namespace is None:
                raise KubernetesError(400, "BadRequest", "a namespaced object needs a namespace in the URL")
            if meta.get("namespace") not in (None, request.namespace):
                raise KubernetesError(400, "BadRequest", "the namespace of the object does not match the URL")
            meta["namespace"] = request.namespace
        else:
            meta.pop("namespace", None)
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise KubernetesError(422, "Invalid", "metadata.name or metadata.generateName is required")
            meta["name"] = meta["generateName"] + "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
        obj.setdefault("apiVersion", key.rsplit("/", 1)[0])
        obj.setdefault("kind", kind)
        with self._lock:
            skey = (key, self._ns(key, request.namespace), meta["name"])
            if skey in self._store:
                raise KubernetesError(409, "AlreadyExists", f'{key.split("/")[-1]} "{meta["name"]}" already exists')
            for field in ("uid", "resourceVersion", "deletionTimestamp", "creationTimestamp", "generation"):
                meta.pop(field, None)
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = _now()
            meta["generation"] = 1
            if has_status and key not in ("v1/nodes", "v1/pods", "v1/namespaces", "v1/services"):
                obj.pop("status", None)  # CRDs with a status subresource ignore status on create
            self._bump(obj)
            self._store[skey] = obj
            result = copy.deepcopy(obj)
        await self._emit(key, "ADDED", obj)
        return result

    def _check_rv(self, current: dict, proposed_meta: dict | None, key: str, subresource: str | None) -> None:
        rv = (proposed_meta or {}).get("resourceVersion")
        if rv is not None and str(rv) != current["metadata"]["resourceVersion"]:
            meta = current["metadata"]
            self.conflicts.append(Conflict(key, meta.get("namespace"), meta["name"], subresource, str(rv),
                                           meta["resourceVersion"]))
            raise KubernetesError(409, "Conflict", "Operation cannot be fulfilled: the object has been modified; "
                                  "please apply your changes to the latest version and try again")

    async def _apply_update(self, key: str, skey: tuple, current: dict, new: dict, subresource: str | None) -> dict:
        _, _, has_status = self._info[key]
        new = copy.deepcopy(new)
        if has_status:
            if subresource == "status":
                # only status changes through /status
                kept = {k: v for k, v in current.items() if k != "status"}
                new = dict(kept, **({"status": new["status"]} if "status" in new else {}))
            else:
                if "status" in current:
                    new["status"] = copy.deepcopy(current["status"])
                else:
                    new.pop("status", None)
        meta = new.setdefault("metadata", {})
        for field in ("uid", "name", "namespace", "creationTimestamp", "generation", "resourceVersion"):
            if field in current["metadata"]:
                meta[field] = current["metadata"][field]
            else:
                meta.pop(field, None)
        if current["metadata"].get("deletionTimestamp"):
            meta["deletionTimestamp"] = current["metadata"]["deletionTimestamp"]
        if new == current:
            return copy.deepcopy(current)  # a no-op write changes nothing, not even resourceVersion
        if self._spec_part(new) != self._spec_part(current):
            meta["generation"] = int(current["metadata"].get("generation", 1)) + 1
        self._bump(new)
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            del self._store[skey]
            await self._emit(key, "DELETED", new)
            await self._collect_garbage(new)
            return copy.deepcopy(new)
        self._store[skey] = new
        await self._emit(key, "MODIFIED", new)
        return copy.deepcopy(new)

    async def _patch(self, request: rendering.Request, key: str) -> dict:
        ctype = (request.headers.get("Content-Type") or "").split(";")[0].strip()
        body = request.data
        group = key.split("/")[0] if key.count("/") == 2 else ""
        with self._lock:
            skey = (key, self._ns(key, request.namespace), request.name or "")
            current = self._get(key, request.namespace, request.name)
            if ctype == "application/json-patch+json":
                if not isinstance(body, list):
                    raise KubernetesError(400, "BadRequest", "a JSON patch must be a list of operations")
                try:
                    new = jsonpatch.apply_patch(copy.deepcopy(current), body)
                except jsonpatch.JsonPatchTestFailed as e:
                    raise KubernetesError(422, "Invalid", f"the JSON patch test failed: {e}") from None
                except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
                    raise KubernetesError(422, "Invalid", f"the JSON patch cannot be applied: {e}") from None
            elif ctype in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
                if ctype.startswith("application/strategic") and group not in BUILTIN_GROUPS:
                    raise KubernetesError(415, "UnsupportedMediaType",
                                          "strategic merge patch is not supported for custom resources")
                if not isinstance(body, dict):
                    raise KubernetesError(400, "BadRequest", "a merge patch must be a JSON object")
                self._check_rv(current, body.get("metadata"), key, request.subresource)
                new = merge_patch(current, body)
            else:
                raise KubernetesError(415, "UnsupportedMediaType", f"unsupported patch type {ctype!r}")
            result = None
        # the await points below happen outside the thread lock but inside the single event-loop thread
        result = await self._apply_update(key, skey, current, new, request.subresource)
        return result

    async def _replace(self, request: rendering.Request, key: str) -> dict:
        body = request.data
        if not isinstance(body, dict):
            raise KubernetesError(400, "BadRequest", "the body must be a JSON object")
        with self._lock:
            skey = (key, self._ns(key, request.namespace), request.name or "")
            current = self._get(key, request.namespace, request.name)
            self._check_rv(current, body.get("metadata"), key, request.subresource)
        return await self._apply_update(key, skey, current, body, request.subresource)

    async def _delete(self, key: str, namespace: str | None, name: str | None, options: Any) -> dict:
        with self._lock:
            skey = (key, self._ns(key, namespace), name or "")
            current = self._get(key, namespace, name)
            pre = (options or {}).get("preconditions") if isinstance(options, dict) else None
            if pre and pre.get("uid") not in (None, current["metadata"]["uid"]):
                raise KubernetesError(409, "Conflict", "precondition failed: UID mismatch")
            if pre and pre.get("resourceVersion") not in (None, current["metadata"]["resourceVersion"]):
                raise KubernetesError(409, "Conflict", "precondition failed: resourceVersion mismatch")
            if current["metadata"].get("finalizers"):
                if current["metadata"].get("deletionTimestamp"):
                    return copy.deepcopy(current)
                new = copy.deepcopy(current)
                new["metadata"]["deletionTimestamp"] = _now()
                new["metadata"]["deletionGracePeriodSeconds"] = 0
                self._bump(new)
                self._store[skey] = new
                deleted = False
            else:
                new = copy.deepcopy(current)
                self._bump(new)
                del self._store[skey]
                deleted = True
        await self._emit(key, "DELETED" if deleted else "MODIFIED", new)
        if deleted:
            await self._collect_garbage(new)
        return copy.deepcopy(new)

    async def _collect_garbage(self, owner: dict) -> None:
        """Background cascading deletion: delete every object listing ``owner``'s uid in its ownerReferences."""
        uid = owner["metadata"].get("uid")
        with self._lock:
            dependents = [(k, ns, n) for (k, ns, n), o in self._store.items()
                          if any(r.get("uid") == uid for r in (o.get("metadata") or {}).get("ownerReferences") or [])]
        for k, ns, n in dependents:
            try:
                await self._delete(k, ns, n, None)
            except KubernetesError:
                pass

    async def _watch(self, request: rendering.Request, key: str) -> aiohttp.web.StreamResponse:
        params = request.params
        selector, fields = params.get("labelSelector"), params.get("fieldSelector")
        timeout = float(params["timeoutSeconds"]) if params.get("timeoutSeconds") else None
        since = params.get("resourceVersion")
        if self._cond is None:
            self._cond = asyncio.Condition()

        def visible(event: dict) -> bool:
            obj = event["object"]
            meta = obj.get("metadata") or {}
            return ((request.namespace is None or meta.get("namespace") == request.namespace)
                    and (request.name is None or meta.get("name") == request.name)
                    and label_selector_matches(selector, meta.get("labels") or {})
                    and field_selector_matches(fields, obj))

        with self._lock:
            if since not in (None, "", "0"):
                since_rv = int(since)
                oldest = self._log[0][0] if self._log else self._rv
                if since_rv < oldest - 1 and self._log:
                    initial = [{"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "code": 410,
                                                            "reason": "Expired", "message": "too old resource version"}}]
                    cursor = len(self._log)
                    gone = True
                else:
                    initial = []
                    cursor = next((i for i, (rv, _, _) in enumerate(self._log) if rv > since_rv), len(self._log))
                    gone = False
            else:
                initial = [{"type": "ADDED", "object": copy.deepcopy(o)} for (k, ns, _), o in self._store.items()
                           if k == key]
                cursor = len(self._log)
                gone = False
        response = aiohttp.web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        await response.prepare(request._raw_request)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            for event in initial:
                if event["type"] == "ERROR" or visible(event):
                    await response.write(json.dumps(event).encode() + b"\n")
            if gone:
                await response.write_eof()
                return response
            while True:
                while cursor < len(self._log):
                    _, k, event = self._log[cursor]
                    cursor += 1
                    if k == key and visible(event):
                        await response.write(json.dumps(event).encode() + b"\n")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                async with self._cond:
                    try:
                        await asyncio.wait_for(self._cond.wait_for(lambda: cursor < len(self._log)),
                                               timeout=remaining if remaining is not None else 30.0)
                    except asyncio.TimeoutError:
                        pass
            await response.write_eof()
        except (ConnectionResetError, ConnectionError, asyncio.CancelledError, RuntimeError):
            pass
        return response


# ------------------------------------------------------------------------------------------------ server in a thread
class KubeServer:
    """Runs :class:`HonestKubernetes` on ``127.0.0.1:<free port>`` in a background thread.

    Usage::

        with KubeServer() as kube:
            kube.write_kubeconfig(path)
            client = kube.client()
    """

    def __init__(self) -> None:
        self.api: HonestKubernetes | None = None
        self.url: str = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None

    def start(self) -> "KubeServer":
        self._thread = threading.Thread(target=self._run, name="kmock-api", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the kmock API server did not start")
        if self._error:
            raise RuntimeError(f"the kmock API server failed: {self._error!r}")
        return self

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._serve())
        except BaseException as e:  # noqa: BLE001 - reported to start()
            self._error = e
            self._ready.set()
        finally:
            loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with HonestKubernetes() as api, kmock.Server(api) as server:
            self.api = api
            self.url = f"http://127.0.0.1:{server.port}"
            self._ready.set()
            await self._stop.wait()

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(10)

    def __enter__(self) -> "KubeServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def write_kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        """A kubeconfig for this server (token auth with a dummy token; kmock does not authenticate)."""
        doc = {
            "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
            "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
            "users": [{"name": "kmock", "user": {"token": "kmock-token"}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock", "namespace": namespace}}],
        }
        path.write_text(yaml.safe_dump(doc))
        return path

    def client(self) -> "KubeClient":
        return KubeClient(self.url)


# ------------------------------------------------------------------------------------------------ a small sync client
class ApiError(RuntimeError):
    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status


class KubeClient:
    """Synchronous JSON client for tests and the fake KubeRay (paths built from ``group/version/plural`` keys)."""

    def __init__(self, url: str, timeout: float = 10.0):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.session = requests.Session()

    @staticmethod
    def path(key: str, namespace: str | None = None, name: str | None = None, sub: str | None = None) -> str:
        parts = key.split("/")
        base = f"/api/{parts[0]}" if len(parts) == 2 else f"/apis/{parts[0]}/{parts[1]}"
        plural = parts[-1]
        p = base + (f"/namespaces/{namespace}" if namespace else "") + f"/{plural}"
        if name:
            p += f"/{name}"
        if sub:
            p += f"/{sub}"
        return p

    def _req(self, method: str, path: str, **kw: Any) -> Any:
        r = self.session.request(method, self.url + path, timeout=self.timeout, **kw)
        if r.status_code >= 400:
            raise ApiError(r.status_code, r.text)
        return r.json()

    def get(self, key: str, namespace: str | None, name: str) -> dict | None:
        try:
            return self._req("GET", self.path(key, namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def list(self, key: str, namespace: str | None = None, selector: str | None = None) -> list[dict]:
        params = {"labelSelector": selector} if selector else {}
        return self._req("GET", self.path(key, namespace), params=params)["items"]

    def create(self, key: str, namespace: str | None, body: dict) -> dict:
        return self._req("POST", self.path(key, namespace), json=body)

    def patch(self, key: str, namespace: str | None, name: str, patch: dict, status: bool = False) -> dict:
        return self._req("PATCH", self.path(key, namespace, name, "status" if status else None), json=patch,
                         headers={"Content-Type": "application/merge-patch+json"})

    def delete(self, key: str, namespace: str | None, name: str) -> dict | None:
        try:
            return self._req("DELETE", self.path(key, namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise
