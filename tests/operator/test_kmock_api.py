"""The honest kmock API server itself: the semantics the operator tests rely on must hold, or those tests prove
nothing. Real HTTP against a real server thread."""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests
from kmock_api import ApiError, KubeServer, label_selector_matches

RLTJ = "daedalus.dev/v1alpha1/rltrainingjobs"


@pytest.fixture()
def kube():
    with KubeServer() as server:
        yield server


def test_create_sets_identity_and_201(kube) -> None:
    c = kube.client()
    r = c.session.post(kube.url + c.path("v1/configmaps", "ns"), json={"metadata": {"name": "a"}, "data": {"k": "v"}})
    assert r.status_code == 201
    obj = r.json()
    meta = obj["metadata"]
    assert meta["namespace"] == "ns" and len(meta["uid"]) == 36 and meta["generation"] == 1
    assert meta["creationTimestamp"].endswith("Z") and int(meta["resourceVersion"]) > 0
    with pytest.raises(ApiError) as err:
        c.create("v1/configmaps", "ns", {"metadata": {"name": "a"}})
    assert err.value.status == 409 and "AlreadyExists" in str(err.value)
    gen = c.create("v1/events", "ns", {"metadata": {"generateName": "ev-"}, "reason": "X"})
    assert gen["metadata"]["name"].startswith("ev-") and len(gen["metadata"]["name"]) == 8
    with pytest.raises(ApiError) as err:
        c.create("v1/configmaps", "ns", {"metadata": {"name": "b", "namespace": "other"}})
    assert err.value.status == 400


def test_resource_version_generation_and_conflicts(kube) -> None:
    c = kube.client()
    job = c.create(RLTJ, "ns", {"metadata": {"name": "j"}, "spec": {"suspend": False}, "status": {"phase": "X"}})
    assert "status" not in job  # status is ignored on create with a status subresource
    rv1 = job["metadata"]["resourceVersion"]
    labelled = c.patch(RLTJ, "ns", "j", {"metadata": {"labels": {"a": "b"}}})
    assert labelled["metadata"]["generation"] == 1 and int(labelled["metadata"]["resourceVersion"]) > int(rv1)
    specced = c.patch(RLTJ, "ns", "j", {"spec": {"suspend": True}})
    assert specced["metadata"]["generation"] == 2
    same = c.patch(RLTJ, "ns", "j", {"spec": {"suspend": True}})
    assert same["metadata"]["resourceVersion"] == specced["metadata"]["resourceVersion"]  # no-op write
    # the status subresource: only status changes there, and the main resource cannot change status
    st = c.patch(RLTJ, "ns", "j", {"status": {"phase": "Running"}, "spec": {"suspend": False}}, status=True)
    assert st["status"] == {"phase": "Running"} and st["spec"]["suspend"] is True and st["metadata"]["generation"] == 2
    main = c.patch(RLTJ, "ns", "j", {"status": {"phase": "Hacked"}})
    assert main["status"] == {"phase": "Running"}
    # optimistic concurrency
    with pytest.raises(ApiError) as err:
        c.patch(RLTJ, "ns", "j", {"metadata": {"resourceVersion": rv1}, "status": {"phase": "Stale"}}, status=True)
    assert err.value.status == 409
    fresh = c.get(RLTJ, "ns", "j")
    assert [(x.name, x.subresource, x.sent, x.current) for x in kube.api.conflicts] == [
        ("j", "status", rv1, fresh["metadata"]["resourceVersion"])]  # recorded, for tests that count them
    ok = c.patch(RLTJ, "ns", "j", {"metadata": {"resourceVersion": fresh["metadata"]["resourceVersion"]},
                                   "status": {"phase": "Fresh"}}, status=True)
    assert ok["status"]["phase"] == "Fresh"
    # JSON patch with a failing test op: 422 (what kopf's finalizer patch expects)
    r = c.session.patch(kube.url + c.path(RLTJ, "ns", "j"), data=json.dumps(
        [{"op": "test", "path": "/metadata/resourceVersion", "value": rv1},
         {"op": "add", "path": "/metadata/finalizers", "value": ["x"]}]),
        headers={"Content-Type": "application/json-patch+json"})
    assert r.status_code == 422
    r = c.session.patch(kube.url + c.path(RLTJ, "ns", "j"), json={"spec": {}},
                        headers={"Content-Type": "application/strategic-merge-patch+json"})
    assert r.status_code == 415


def test_finalizers_and_owner_gc(kube) -> None:
    c = kube.client()
    owner = c.create(RLTJ, "ns", {"metadata": {"name": "j", "finalizers": ["daedalus.dev/finalizer"]}})
    ref = {"apiVersion": "daedalus.dev/v1alpha1", "kind": "RLTrainingJob", "name": "j",
           "uid": owner["metadata"]["uid"], "controller": True}
    c.create("v1/configmaps", "ns", {"metadata": {"name": "child", "ownerReferences": [ref]}})
    c.create("v1/configmaps", "ns", {"metadata": {"name": "other"}})
    marked = c.delete(RLTJ, "ns", "j")
    assert marked["metadata"]["deletionTimestamp"] and c.get(RLTJ, "ns", "j") is not None
    assert c.get("v1/configmaps", "ns", "child") is not None  # not yet: the owner still exists
    c.patch(RLTJ, "ns", "j", {"metadata": {"finalizers": None}})
    assert c.get(RLTJ, "ns", "j") is None
    assert c.get("v1/configmaps", "ns", "child") is None and c.get("v1/configmaps", "ns", "other") is not None
    assert c.delete("v1/configmaps", "ns", "child") is None  # 404


@pytest.mark.parametrize("selector,labels,ok", [
    ("a=b", {"a": "b"}, True), ("a==b", {"a": "c"}, False), ("a!=b", {}, True), ("a", {"a": ""}, True),
    ("!a", {"a": "x"}, False), ("a in (x, y),b", {"a": "y", "b": "1"}, True), ("a notin (x)", {"a": "x"}, False),
    ("a in (x)", {}, False),
])
def test_label_selectors(selector: str, labels: dict, ok: bool) -> None:
    assert label_selector_matches(selector, labels) is ok


def test_list_and_watch_with_selectors_and_resource_version(kube) -> None:
    c = kube.client()
    c.create("v1/pods", "ns", {"metadata": {"name": "p1", "labels": {"daedalus.dev/job": "j"}}})
    c.create("v1/pods", "ns", {"metadata": {"name": "p2"}})
    listing = c.session.get(kube.url + "/api/v1/pods", params={"labelSelector": "daedalus.dev/job"}).json()
    assert [p["metadata"]["name"] for p in listing["items"]] == ["p1"]
    since = listing["metadata"]["resourceVersion"]
    events: list[dict] = []

    def watch() -> None:
        with requests.get(kube.url + "/api/v1/pods", params={"watch": "true", "resourceVersion": since,
                                                               "labelSelector": "daedalus.dev/job=j",
                                                               "timeoutSeconds": "2"}, stream=True, timeout=10) as r:
            for line in r.iter_lines():
                if line:
                    events.append(json.loads(line))

    t = threading.Thread(target=watch)
    started = time.monotonic()
    t.start()
    time.sleep(0.3)
    c.patch("v1/pods", "ns", "p1", {"metadata": {"annotations": {"x": "1"}}})
    c.patch("v1/pods", "ns", "p2", {"metadata": {"annotations": {"x": "1"}}})  # filtered out by the selector
    c.create("v1/pods", "ns", {"metadata": {"name": "p3", "labels": {"daedalus.dev/job": "j"}}})
    t.join(10)
    assert 1.5 < time.monotonic() - started < 8  # the server ended the stream after timeoutSeconds
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("MODIFIED", "p1"), ("ADDED", "p3")]
    # replay from an older resourceVersion includes only later events
    replay = requests.get(kube.url + "/api/v1/pods", params={"watch": "true", "resourceVersion": since,
                                                              "timeoutSeconds": "1"}, timeout=10).text.splitlines()
    assert [json.loads(x)["object"]["metadata"]["name"] for x in replay] == ["p1", "p2", "p3"]


def test_fault_injection_happens_before_any_change(kube) -> None:
    c = kube.client()
    c.create(RLTJ, "ns", {"metadata": {"name": "j"}})
    fault = kube.api.fault("PATCH", "rltrainingjobs", subresource="status", status=500, times=1)
    with pytest.raises(ApiError) as err:
        c.patch(RLTJ, "ns", "j", {"status": {"phase": "Running"}}, status=True)
    assert err.value.status == 500 and fault.hits == 1
    assert "status" not in c.get(RLTJ, "ns", "j")
    assert c.patch(RLTJ, "ns", "j", {"status": {"phase": "Running"}}, status=True)["status"]["phase"] == "Running"


def test_discovery_lists_status_subresource(kube) -> None:
    doc = requests.get(kube.url + "/apis/daedalus.dev/v1alpha1", timeout=5).json()
    names = {r["name"]: r for r in doc["resources"]}
    assert "rltrainingjobs/status" in names and names["rltrainingjobs"]["namespaced"] is True
    core = requests.get(kube.url + "/api/v1", timeout=5).json()
    assert any(r["name"] == "nodes" and r["namespaced"] is False for r in core["resources"])
