"""A thin, typed wrapper over the official Kubernetes client for the few calls the operator makes itself.

kopf owns the watches; the handlers create, patch and delete children and write the status through this module. It
goes through ``kubernetes.client.ApiClient`` so that every authentication mechanism of the official client works
(in-cluster service-account tokens with rotation, kubeconfig exec plugins such as ``aws eks get-token``), and speaks
raw JSON dicts (no generated models: KubeRay kinds are not in the client).

Resources are named ``group/version/plural`` (``v1/pods`` for the core group), as in :mod:`daedalus_operator.api`.
Patches are JSON merge patches (RFC 7386); a merge patch that carries ``metadata.resourceVersion`` is applied only if
the object still has that version (HTTP 409 otherwise).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import kubernetes
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

log = logging.getLogger(__name__)

RLTJ = "daedalus.dev/v1alpha1/rltrainingjobs"
RAYCLUSTERS = "ray.io/v1/rayclusters"
RAYSERVICES = "ray.io/v1/rayservices"
PODS = "v1/pods"
NODES = "v1/nodes"
CONFIGMAPS = "v1/configmaps"
SECRETS = "v1/secrets"
NETWORKPOLICIES = "networking.k8s.io/v1/networkpolicies"
PDBS = "policy/v1/poddisruptionbudgets"


class KubeError(RuntimeError):
    """An API call failed: ``status`` is the HTTP status (0: no answer), ``reason`` the Status reason, or with no
    answer the innermost cause (``Connection refused``, ``Name or service not known``, ``timed out``; see
    :func:`no_answer_reason`)."""

    def __init__(self, status: int, reason: str, message: str):
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message

    @property
    def not_found(self) -> bool:
        """The API answered 404 Not Found (the object, or its namespace or resource type, does not exist)."""
        return self.status == 404

    @property
    def conflict(self) -> bool:
        """The API answered 409 Conflict: a create of a name that exists, or a write guarded by a
        ``resourceVersion`` the object no longer has."""
        return self.status == 409


def no_answer_reason(exc: BaseException) -> str:
    """Why a request got no answer, in a few words: the innermost ``OSError``'s text (``Connection refused`` from
    urllib3's ``NewConnectionError`` raised while handling ``ConnectionRefusedError``), ``timed out`` for a read or
    connect timeout, else the exception's class name. Follows ``reason`` (urllib3's ``MaxRetryError``),
    ``__cause__`` and ``__context__``."""
    seen: set[int] = set()
    chain: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        nxt = getattr(e, "reason", None)
        e = nxt if isinstance(nxt, BaseException) else (e.__cause__ or e.__context__)
    for e in reversed(chain):
        if isinstance(e, OSError) and e.strerror:
            return e.strerror
    if any(isinstance(e, TimeoutError) or "timeout" in type(e).__name__.lower() for e in chain):
        return "timed out"
    return type(exc).__name__


def _api_error(status: int, reason: str, message: str, method: str, path: str) -> KubeError:
    """The :class:`KubeError` of an answer with an error status. A 404 whose body is not a Kubernetes ``Status``
    (``404 page not found``: the API server's mux, not a missing object, which gets a ``Status`` with reason
    ``NotFound``) means the resource type is not served: its CRD is not installed. That is said in words, with the
    resource and, for ``ray.io``, where KubeRay's CRDs come from."""
    message = message.strip()
    if status == 404 and message.startswith("404 page not found"):
        parts = path.split("?")[0].strip("/").split("/")  # apis/<group>/<version>/... or api/<version>/...
        group, rest = (parts[1], parts[3:]) if parts[0] == "apis" else ("core", parts[2:])
        if rest[:1] == ["namespaces"] and len(rest) > 2:
            rest = rest[2:]
        resource = rest[0] if rest else "?"
        hint = (" Install KubeRay (its CRDs and its operator) first: docs/deploy.md section 2" if group == "ray.io"
                else " Is its CRD installed?")
        message = f"{method} {path}: the API server does not serve {group} {resource}.{hint}"
    return KubeError(status, reason, message[:500])


def resource_path(key: str, namespace: str | None = None, name: str | None = None, sub: str | None = None) -> str:
    """URL path of a collection, an object or a subresource (``/api/v1/namespaces/ns/pods/p/status``)."""
    parts = key.split("/")
    base = f"/api/{parts[0]}" if len(parts) == 2 else f"/apis/{parts[0]}/{parts[1]}"
    path = base + (f"/namespaces/{namespace}" if namespace else "") + f"/{parts[-1]}"
    if name:
        path += f"/{name}"
    if sub:
        path += f"/{sub}"
    return path


def api_client_from_environment(kubeconfig: str | None = None) -> ApiClient:
    """In a pod (``KUBERNETES_SERVICE_HOST`` set and no explicit kubeconfig): the service account; otherwise the
    kubeconfig (``kubeconfig``, ``$KUBECONFIG`` or ``~/.kube/config``)."""
    cfg = kubernetes.client.Configuration()
    kubeconfig = kubeconfig or os.environ.get("KUBECONFIG")
    if os.environ.get("KUBERNETES_SERVICE_HOST") and not kubeconfig:
        kubernetes.config.load_incluster_config(client_configuration=cfg)
    else:
        kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    # No HTTP-level retries (urllib3 would retry a timed-out GET three times, quadrupling the wait): the reconcile is
    # retried as a whole by kopf, from fresh state.
    cfg.retries = False
    return ApiClient(cfg)


class KubeAPI:
    """JSON calls over an :class:`ApiClient`; every call has a timeout (``timeout`` seconds)."""

    def __init__(self, client: ApiClient, timeout: float = 10.0):
        self.client = client
        self.timeout = timeout

    def _call(self, method: str, path: str, *, body: Any = None, query: dict[str, str] | None = None,
              content_type: str = "application/json", timeout: float | None = None) -> Any:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        try:
            m, url, hdrs, payload, post = self.client.param_serialize(
                method, path, query_params=list((query or {}).items()), header_params=headers, body=body,
                auth_settings=["BearerToken"])
            resp = self.client.call_api(m, url, hdrs, payload, post, _request_timeout=timeout or self.timeout)
            resp.read()
        except ApiException as exc:
            raise _api_error(exc.status or 0, exc.reason or "Error", str(exc.body or exc), method, path) from None
        except Exception as exc:  # urllib3 connection/timeout errors
            raise KubeError(0, no_answer_reason(exc), str(exc)) from None
        text = resp.data.decode() if resp.data else ""
        try:
            doc = json.loads(text) if text else None
        except ValueError:
            doc = None
        if resp.status >= 400:
            reason = (doc or {}).get("reason", "") if isinstance(doc, dict) else ""
            message = (doc or {}).get("message", text) if isinstance(doc, dict) else text
            raise _api_error(resp.status, reason or "Error", message, method, path)
        return doc

    def version(self, timeout: float | None = None) -> dict:
        """``GET /version`` (readable by every authenticated client under the default RBAC: system:discovery), within
        ``timeout`` seconds (default: this client's).

        Raises:
            KubeError: the call failed (``status`` 0: no answer).
        """
        return self._call("GET", "/version", timeout=timeout) or {}

    def api_groups(self) -> dict:
        """``GET /apis``: the API groups (an ``APIGroupList``), kopf's first request at start; readable by every
        authenticated client under the default RBAC (system:discovery).

        Raises:
            KubeError: the call failed (``status`` 0: no answer).
        """
        return self._call("GET", "/apis") or {}

    def get(self, key: str, namespace: str | None, name: str) -> dict | None:
        """The object, or ``None`` when it does not exist.

        Raises:
            KubeError: the call failed other than with 404 Not Found (``status`` 0: no answer).
        """
        try:
            return self._call("GET", resource_path(key, namespace, name))
        except KubeError as e:
            if e.not_found:
                return None
            raise

    def list(self, key: str, namespace: str | None = None, selector: str | None = None,
             limit: int | None = None) -> list[dict]:
        """Objects of a resource (one namespace or all), optionally by label selector.

        Raises:
            KubeError: the call failed (``status`` 0: no answer).
        """
        query: dict[str, str] = {}
        if selector:
            query["labelSelector"] = selector
        if limit:
            query["limit"] = str(limit)
        return self._call("GET", resource_path(key, namespace), query=query)["items"]

    def create(self, key: str, namespace: str | None, body: dict) -> dict:
        """Create; raises :class:`KubeError` (409 when it already exists)."""
        return self._call("POST", resource_path(key, namespace), body=body)

    def patch(self, key: str, namespace: str | None, name: str, patch: dict, *, status: bool = False) -> dict:
        """JSON merge patch of the object (or its ``/status``).

        Raises:
            KubeError: the call failed (404 when the object does not exist, 409 when a ``metadata.resourceVersion``
                in ``patch`` is stale; ``status`` 0: no answer).
        """
        return self._call("PATCH", resource_path(key, namespace, name, "status" if status else None), body=patch,
                          content_type="application/merge-patch+json")

    def delete(self, key: str, namespace: str | None, name: str) -> bool:
        """Delete with background propagation; False when it did not exist.

        Raises:
            KubeError: the call failed other than with 404 Not Found (``status`` 0: no answer).
        """
        try:
            self._call("DELETE", resource_path(key, namespace, name),
                       body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"})
            return True
        except KubeError as e:
            if e.not_found:
                return False
            raise
