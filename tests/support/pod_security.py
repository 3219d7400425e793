"""The Pod Security Standards' checks, as a test oracle for the pods the operator's RayClusters and RayServices make.

Source: kubernetes.io/docs/concepts/security/pod-security-standards (the "latest" policy version, Kubernetes 1.30-1.34),
whose controls the Pod Security admission controller enforces per namespace (``pod-security.kubernetes.io/enforce``).
The test tier's kube-apiserver 1.20 has no Pod Security admission (it came in 1.23), so these checks are written out
here, one per control, each returning the message of a violation; a pod meets a level when its list is empty. Not
written out: the baseline AppArmor and SELinux controls (annotations and ``seLinuxOptions`` that no pod here sets).

:func:`kuberay_pod_spec` adds to a pod template what KubeRay itself adds before it creates the pod and that these
checks see: the ``wait-gcs-ready`` init container of a worker (KubeRay copies the Ray container's securityContext,
env and volume mounts into it; ray-operator/controllers/ray/common/pod.go, ``DefaultWorkerPodTemplate``) and the
``/dev/shm`` emptyDir (``addEmptyDir`` in ``BuildPod``).
"""

from __future__ import annotations

import copy
from typing import Any, Iterator

#: Baseline "Capabilities": what a container may add.
BASELINE_CAPABILITIES = frozenset({"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                                   "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"})
#: Baseline "Sysctls": the safe set.
SAFE_SYSCTLS = frozenset({"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                          "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                          "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                          "net.ipv4.tcp_keepalive_probes"})
#: Restricted "Volume Types": the only volume sources allowed.
RESTRICTED_VOLUMES = frozenset({"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                                "projected", "secret"})


def _containers(pod: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        for container in pod.get(kind) or []:
            yield f"{kind[:-1]} {container['name']}", container


def baseline_violations(pod: dict[str, Any]) -> list[str]:
    """Violations of the baseline level by pod spec ``pod`` (a ``core/v1`` PodSpec as a dict)."""
    out = []
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            out.append(f"Host Namespaces: {field} is true")
    pod_sc = pod.get("securityContext") or {}
    if (pod_sc.get("windowsOptions") or {}).get("hostProcess"):
        out.append("HostProcess: pod windowsOptions.hostProcess is true")
    for volume in pod.get("volumes") or []:
        if "hostPath" in volume:
            out.append(f"HostPath Volumes: volume {volume['name']}")
    if (pod_sc.get("seccompProfile") or {}).get("type") == "Unconfined":
        out.append("Seccomp: pod profile Unconfined")
    for sysctl in pod_sc.get("sysctls") or []:
        if sysctl["name"] not in SAFE_SYSCTLS:
            out.append(f"Sysctls: {sysctl['name']} is not in the safe set")
    for where, container in _containers(pod):
        sc = container.get("securityContext") or {}
        if sc.get("privileged"):
            out.append(f"Privileged Containers: {where}")
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"HostProcess: {where}")
        added = set((sc.get("capabilities") or {}).get("add") or []) - BASELINE_CAPABILITIES
        if added:
            out.append(f"Capabilities: {where} adds {sorted(added)}")
        for port in container.get("ports") or []:
            if port.get("hostPort"):
                out.append(f"Host Ports: {where} hostPort {port['hostPort']}")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"/proc Mount Type: {where} {sc['procMount']}")
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            out.append(f"Seccomp: {where} profile Unconfined")
    return out


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """Violations of the restricted level (which includes baseline) by pod spec ``pod``."""
    out = baseline_violations(pod)
    for volume in pod.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"Volume Types: volume {volume['name']} is {sorted(kinds)}")
    pod_sc = pod.get("securityContext") or {}
    if pod_sc.get("runAsUser") == 0:
        out.append("Running as Non-root user: pod runAsUser 0")
    if pod_sc.get("runAsNonRoot") is False:  # refused even when every container sets true (Pod Security admission)
        out.append("Running as Non-root: pod runAsNonRoot is false")
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type")
    for where, container in _containers(pod):
        sc = container.get("securityContext") or {}
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"Privilege Escalation: {where} does not set allowPrivilegeEscalation false")
        non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
        if non_root is not True:
            out.append(f"Running as Non-root: {where} runAsNonRoot is not true (pod or container)")
        if sc.get("runAsUser") == 0:
            out.append(f"Running as Non-root user: {where} runAsUser 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type", pod_seccomp)
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"Seccomp: {where} has no RuntimeDefault or Localhost profile (pod or container)")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"Capabilities: {where} does not drop ALL")
        added = set(caps.get("add") or []) - {"NET_BIND_SERVICE"}
        if added:
            out.append(f"Capabilities: {where} adds {sorted(added)} (restricted allows only NET_BIND_SERVICE)")
    return out


def kuberay_pod_spec(template_spec: dict[str, Any], *, worker: bool) -> dict[str, Any]:
    """The pod spec KubeRay makes from a head or worker group's ``template.spec``, as far as the checks above see it:
    a worker gets the ``wait-gcs-ready`` init container (image, securityContext, env and volume mounts of the Ray
    container, the first one; fixed resources 200m / 256Mi), and a pod without a ``/dev/shm`` mount gets KubeRay's
    in-memory ``shared-mem`` emptyDir there. Returns a new dict; ``template_spec`` is not changed."""
    pod = copy.deepcopy(template_spec)
    ray = pod["containers"][0]
    if worker:
        init = {"name": "wait-gcs-ready", "image": ray["image"], "imagePullPolicy": ray.get("imagePullPolicy"),
                "command": ["/bin/bash", "-lc", "--"], "args": ["ray health-check"],
                "resources": {"limits": {"cpu": "200m", "memory": "256Mi"},
                              "requests": {"cpu": "200m", "memory": "256Mi"}}}
        for field in ("securityContext", "env", "volumeMounts"):  # Go's DeepCopy: an absent field stays absent
            if field in ray:
                init[field] = copy.deepcopy(ray[field])
        pod["initContainers"] = [*(pod.get("initContainers") or []), init]
    if not any(m["mountPath"] == "/dev/shm" for m in ray.get("volumeMounts") or []):
        pod["volumes"] = [*(pod.get("volumes") or []), {"name": "shared-mem", "emptyDir": {"medium": "Memory"}}]
        ray["volumeMounts"] = [*(ray.get("volumeMounts") or []), {"name": "shared-mem", "mountPath": "/dev/shm"}]
    return pod
