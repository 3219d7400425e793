"""Smoke tests of the real API-server tier: each checks one behaviour the operator's tests will rely on and that
kmock does not provide (uid/resourceVersion/generation, schema validation and pruning, status subresource,
409 on stale writes, owner-reference GC, RBAC)."""

from __future__ import annotations

import json
import time

import pytest
from controlplane import crd_for_1_20
from kubernetes import client
from kubernetes.client import ApiException

GROUP, VERSION, PLURAL = "ray.io", "v1", "rayclusters"


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    """Poll ``predicate()`` until it returns a truthy value (returned) or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def raycluster(name: str, **spec_extra) -> dict:
    """A minimal valid KubeRay v1 RayCluster (head group only)."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "RayCluster",
        "metadata": {"name": name},
        "spec": {
            "rayVersion": "2.60.0",
            "headGroupSpec": {
                "rayStartParams": {},
                "template": {"spec": {"containers": [{"name": "ray-head", "image": "rayproject/ray:2.60.0"}]}},
            },
            **spec_extra,
        },
    }


def test_crd_for_1_20_strips_only_unknown_schema_keywords_never_field_names():
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "things.example.com"},
        "spec": {
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "selectableFields": [{"jsonPath": ".spec.rule"}],
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "x-kubernetes-validations": [{"rule": "true"}],
                            "properties": {
                                # A *field* named like a newer keyword is data, not a keyword: it stays.
                                "x-kubernetes-validations": {"type": "string"},
                                "list": {
                                    "type": "array",
                                    "x-kubernetes-list-type": "map",
                                    "x-kubernetes-list-map-keys": ["name"],
                                    "items": {"type": "object", "x-kubernetes-validations": [], "required": ["name"]},
                                },
                                "either": {"anyOf": [{"type": "integer", "x-kubernetes-validations": []}]},
                                "map": {"type": "object", "additionalProperties": {"type": "string", "newKey": 1}},
                            },
                        }
                    },
                }
            ]
        },
    }
    out, removed = crd_for_1_20(crd)
    root = "spec.versions[0].schema.openAPIV3Schema"
    assert removed == [
        "spec.versions[0].selectableFields",
        f"{root}.x-kubernetes-validations",
        f"{root}.properties.list.items.x-kubernetes-validations",
        f"{root}.properties.either.anyOf[0].x-kubernetes-validations",
        f"{root}.properties.map.additionalProperties.newKey",
    ]
    schema = out["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert schema["properties"]["x-kubernetes-validations"] == {"type": "string"}
    assert schema["properties"]["list"]["x-kubernetes-list-map-keys"] == ["name"]
    assert "x-kubernetes-validations" in crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]  # input untouched
    with pytest.raises(ValueError, match="apiextensions.k8s.io/v1"):
        crd_for_1_20({"apiVersion": "apiextensions.k8s.io/v1beta1", "kind": "CustomResourceDefinition"})


def test_server_is_the_built_1_20_with_all_components_running(control_plane, kube_api):
    info = client.VersionApi(kube_api).get_code()
    assert info.git_version == control_plane.binaries.version
    assert (info.major, info.minor) == ("1", "20")
    assert control_plane.server.startswith("https://127.0.0.1:")
    assert control_plane.running() == {"etcd": True, "kube-apiserver": True, "kube-controller-manager": True}


def test_namespace_is_created_and_the_namespace_controller_finalizes_its_deletion(kube_api):
    core = client.CoreV1Api(kube_api)
    created = core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name="smoke-ns")))
    assert created.metadata.uid and created.status.phase == "Active"
    core.create_namespaced_config_map("smoke-ns", client.V1ConfigMap(metadata=client.V1ObjectMeta(name="c")))
    # The serviceaccount controller gives every new namespace its "default" ServiceAccount.
    wait_for(lambda: core.list_namespaced_service_account("smoke-ns").items, 15, "default ServiceAccount")
    core.delete_namespace("smoke-ns")
    assert core.read_namespace("smoke-ns").status.phase == "Terminating"

    def gone() -> bool:
        try:
            core.read_namespace("smoke-ns")
        except ApiException as err:
            return err.status == 404
        return False

    wait_for(gone, 30, "namespace smoke-ns to be finalized")


def test_kuberay_crd_installs_and_only_the_cel_rules_are_stripped(raycluster_crd, kube_api):
    crd, removed = raycluster_crd
    assert removed == [
        "spec.versions[0].schema.openAPIV3Schema.properties.spec.properties.gcsFaultToleranceOptions"
        ".properties.backend.x-kubernetes-validations",
        "spec.versions[0].schema.openAPIV3Schema.properties.spec.properties.managedBy.x-kubernetes-validations",
    ]
    stored = client.ApiextensionsV1Api(kube_api).read_custom_resource_definition("rayclusters.ray.io")
    assert [v.name for v in stored.spec.versions] == ["v1", "v1alpha1"]
    assert stored.status.accepted_names.kind == "RayCluster"
    assert {c.type: c.status for c in stored.status.conditions}["Established"] == "True"
    # The empty-string defaults (LocalObjectReference.name: "") were accepted, not stripped.
    assert '"default": ""' in json.dumps(crd) and "x-kubernetes-validations" not in json.dumps(crd)


def test_raycluster_round_trip_with_pruning_and_validation(kube_api, namespace):
    custom = client.CustomObjectsApi(kube_api)
    body = raycluster("rc")
    body["spec"]["notAKubeRayField"] = "dropped"
    pod = body["spec"]["headGroupSpec"]["template"]["spec"]
    pod["containers"][0]["workingDir"] = ""  # an empty string is a string (needs the kube-openapi #230 fix)
    pod["imagePullSecrets"] = [{}]  # the CRD defaults LocalObjectReference.name to ""
    created = custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)
    read = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "rc")
    assert read["metadata"]["uid"] == created["metadata"]["uid"]
    assert read["metadata"]["generation"] == 1
    assert read["metadata"]["namespace"] == namespace
    pod = read["spec"]["headGroupSpec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == "rayproject/ray:2.60.0"
    assert pod["containers"][0]["workingDir"] == ""
    assert pod["imagePullSecrets"] == [{"name": ""}]  # structural-schema defaulting
    assert "notAKubeRayField" not in read["spec"]  # structural-schema pruning

    bad = raycluster("rc-bad")
    bad["spec"]["headGroupSpec"]["template"]["spec"]["containers"] = "not-a-list"
    with pytest.raises(ApiException) as err:
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, bad)
    assert err.value.status == 422
    assert "containers" in err.value.body
    missing = raycluster("rc-missing")
    del missing["spec"]["headGroupSpec"]
    with pytest.raises(ApiException) as err:
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, missing)
    assert err.value.status == 422 and "headGroupSpec" in err.value.body


def test_status_subresource_is_separate_from_spec(kube_api, namespace):
    custom = client.CustomObjectsApi(kube_api)
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, raycluster("rc"))
    patched = custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, "rc", {"status": {"state": "ready", "readyWorkerReplicas": 0}}
    )
    assert patched["status"] == {"state": "ready", "readyWorkerReplicas": 0}
    assert patched["metadata"]["generation"] == 1  # status writes do not bump generation

    # Through the main endpoint a status change is ignored and a spec change bumps generation.
    after = custom.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "rc", {"spec": {"suspend": True}, "status": {"state": "failed"}}
    )
    assert after["spec"]["suspend"] is True
    assert after["status"]["state"] == "ready"
    assert after["metadata"]["generation"] == 2


def test_update_with_a_stale_resource_version_is_a_409_conflict(kube_api, namespace):
    custom = client.CustomObjectsApi(kube_api)
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, raycluster("rc"))
    first = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "rc")
    first["spec"]["suspend"] = True
    second = custom.replace_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "rc", first)
    assert int(second["metadata"]["resourceVersion"]) > int(first["metadata"]["resourceVersion"])
    first["spec"]["suspend"] = False  # still carries the old resourceVersion
    with pytest.raises(ApiException) as err:
        custom.replace_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "rc", first)
    assert err.value.status == 409
    assert custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "rc")["spec"]["suspend"] is True


def test_garbage_collector_deletes_a_configmap_owned_by_a_deleted_raycluster(kube_api, namespace):
    custom = client.CustomObjectsApi(kube_api)
    core = client.CoreV1Api(kube_api)
    owner = custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, raycluster("owner"))
    reference = client.V1OwnerReference(
        api_version=f"{GROUP}/{VERSION}", kind="RayCluster", name="owner", uid=owner["metadata"]["uid"],
        controller=True, block_owner_deletion=True,
    )  # fmt: skip
    core.create_namespaced_config_map(
        namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="child", owner_references=[reference]))
    )
    core.create_namespaced_config_map(namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="bystander")))
    custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "owner")

    def child_gone() -> bool:
        try:
            core.read_namespaced_config_map("child", namespace)
        except ApiException as err:
            return err.status == 404
        return False

    wait_for(child_gone, 60, "the garbage collector to delete the owned ConfigMap")
    assert core.read_namespaced_config_map("bystander", namespace).metadata.name == "bystander"


def test_rbac_denies_a_service_account_without_a_role_and_allows_it_after_a_binding(control_plane, kube_api, namespace):
    core = client.CoreV1Api(kube_api)
    core.create_namespaced_service_account(namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="sa")))
    kubeconfig = control_plane.service_account_kubeconfig(namespace, "sa")
    with control_plane.api_client(kubeconfig) as sa_api:
        sa_core = client.CoreV1Api(sa_api)
        with pytest.raises(ApiException) as err:
            sa_core.list_namespaced_pod(namespace)
        assert err.value.status == 403  # authenticated (not 401) but not authorized
        assert f"system:serviceaccount:{namespace}:sa" in err.value.body

        rbac = client.RbacAuthorizationV1Api(kube_api)
        rbac.create_namespaced_role(
            namespace,
            client.V1Role(
                metadata=client.V1ObjectMeta(name="pod-reader"),
                rules=[client.V1PolicyRule(api_groups=[""], resources=["pods"], verbs=["list"])],
            ),
        )
        rbac.create_namespaced_role_binding(
            namespace,
            client.V1RoleBinding(
                metadata=client.V1ObjectMeta(name="sa-reads-pods"),
                role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="Role", name="pod-reader"),
                subjects=[client.RbacV1Subject(kind="ServiceAccount", name="sa", namespace=namespace)],
            ),
        )

        def allowed() -> bool:
            try:
                return sa_core.list_namespaced_pod(namespace).items == []
            except ApiException as exc:
                if exc.status != 403:
                    raise
                return False

        wait_for(allowed, 15, "the RoleBinding to take effect")
        with pytest.raises(ApiException) as err:
            sa_core.list_namespaced_pod("default")  # the Role is namespaced: other namespaces stay closed
        assert err.value.status == 403


def test_a_resource_type_the_server_does_not_serve_is_named_in_the_error(kube_api, namespace):
    """The real API server answers a request for a resource type it does not serve (a missing CRD: KubeRay not
    installed) with a bare "404 page not found", not a Status: the operator's error names the resource and says what
    to install, where it had quoted that text (and its newline) in the Reconciling condition."""
    from daedalus_operator.kube import KubeAPI, KubeError

    api = KubeAPI(kube_api)
    body = {"apiVersion": "ray.io/v1", "kind": "RayNothing", "metadata": {"name": "x"}}
    with pytest.raises(KubeError) as info:
        api.create("ray.io/v1/raynothings", namespace, body)
    assert info.value.status == 404 and info.value.not_found
    assert info.value.message == (
        f"POST /apis/ray.io/v1/namespaces/{namespace}/raynothings: the API server does not serve ray.io raynothings. "
        "Install KubeRay (its CRDs and its operator) first: docs/deploy.md section 2")
    assert api.get("ray.io/v1/raynothings", namespace, "x") is None  # a get still reads as "no such object"
    # a missing object of a served type keeps the server's own Status message
    with pytest.raises(KubeError) as info:
        api.create("v1/configmaps", "no-such-namespace", {"metadata": {"name": "x"}})
    assert info.value.status == 404 and info.value.message == 'namespaces "no-such-namespace" not found'
