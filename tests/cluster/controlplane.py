"""A real Kubernetes control plane on loopback for the API-server test tier.

`ControlPlane` starts, in one temporary directory:

- etcd (Debian ``etcd-server`` 3.4) on two free loopback ports, data on tmpfs when ``/dev/shm`` exists;
- kube-apiserver 1.20 (built by ``scripts/build-kube.sh``) on ``https://127.0.0.1:<free port>`` with
  ``--authorization-mode=RBAC``, client-certificate authentication (an own CA made with ``cryptography``),
  and a service-account issuer with an RSA signing key (TokenRequest works; tokens are verified with the
  public key);
- kube-controller-manager 1.20 with only the ``garbagecollector``, ``namespace``, ``serviceaccount-token``,
  ``serviceaccount`` and ``disruption`` controllers (owner-reference GC, namespace deletion, default ServiceAccounts
  and their legacy token Secrets, PodDisruptionBudget status, which the Eviction API decides by). There is no scheduler and no kubelet: pods stay Pending, and tests write status
  themselves.

It waits until ``/readyz`` answers ``ok`` and the controller manager has created the ``default`` ServiceAccount
of the ``default`` namespace, writes an admin kubeconfig (user ``daedalus-admin`` in group ``system:masters``) and
can mint a kubeconfig for any ServiceAccount (TokenRequest API). ``stop()`` terminates the three processes
(SIGTERM, then SIGKILL after a grace period) and removes the directory.

Binaries: ``$DAEDALUS_KUBE_BIN`` (a folder) or ``${DAEDALUS_CACHE:-~/.cache/daedalus}/kube-<version>/bin``
(version ``$DAEDALUS_KUBE_VERSION``, default 1.20.2) with its ``stamp``; ``etcd`` from ``$DAEDALUS_ETCD`` or
``PATH``. When any is missing, `find_binaries` raises `ControlPlaneUnavailable` whose message says why
(including the build script's own reason from ``kube-<version>.unavailable`` when the build was impossible).

Flags follow the kube-apiserver / kube-controller-manager 1.20 command-line references
(https://v1-20.docs.kubernetes.io/docs/reference/command-line-tools-reference/).
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import ipaddress
import os
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID
from ray_head import free_port  # a server port outside the ephemeral range (tests/support is on sys.path)

DEFAULT_KUBE_VERSION = "1.20.2"
#: The controllers the tests rely on (kube-controller-manager ``--controllers``).
CONTROLLERS = ("garbagecollector", "namespace", "serviceaccount-token", "serviceaccount", "disruption")
#: Issuer written into service-account tokens (``--service-account-issuer``); also the only API audience.
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc"
ADMIN_USER = "daedalus-admin"
#: kube-apiserver's audit policy: one ``Metadata`` event (who, verb, resource, namespace, response code) per request
#: of a ServiceAccount, written when the response is complete; nothing for other users (the admin, the controller
#: manager). ``ControlPlane.audit_events`` reads them: the only record of a 403 that a client swallowed, since
#: kube-apiserver 1.20 does not count requests refused by the authorizer in ``apiserver_request_total``.
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived", "ResponseStarted"],
    "rules": [{"level": "Metadata", "userGroups": ["system:serviceaccounts"]}, {"level": "None"}],
}


class ControlPlaneUnavailable(RuntimeError):
    """The binaries are not on this machine; the message says why and how to get them."""


class ControlPlaneError(RuntimeError):
    """A component failed to start or to become ready; the message carries the tail of its log."""


@dataclasses.dataclass(frozen=True)
class Binaries:
    """Paths of the three executables, the apiserver's version (``v1.20.2``, from ``--version``) and the build
    stamp (``key=value`` lines written by ``scripts/build-kube.sh``; empty with ``$DAEDALUS_KUBE_BIN``)."""

    kube_apiserver: Path
    kube_controller_manager: Path
    etcd: Path
    version: str
    stamp: dict[str, str]


def cache_dir() -> Path:
    """``$DAEDALUS_CACHE`` or ``~/.cache/daedalus`` (where ``scripts/build-kube.sh`` installs)."""
    return Path(os.environ.get("DAEDALUS_CACHE") or Path.home() / ".cache" / "daedalus")


def find_binaries() -> Binaries:
    """Locate kube-apiserver, kube-controller-manager and etcd.

    Raises:
        ControlPlaneUnavailable: a binary or the build stamp is missing; the message names the path looked at,
            the build script's recorded reason if it gave up, and the command that builds the binaries.
    """
    version = os.environ.get("DAEDALUS_KUBE_VERSION", DEFAULT_KUBE_VERSION)
    explicit = os.environ.get("DAEDALUS_KUBE_BIN")
    bin_dir = Path(explicit) if explicit else cache_dir() / f"kube-{version}" / "bin"
    stamp_path = bin_dir.parent / "stamp"
    hint = "run `bash scripts/build-kube.sh` (or `make system-deps`; about 6 min on 2 idle cores)"
    missing = [
        name for name in ("kube-apiserver", "kube-controller-manager") if not os.access(bin_dir / name, os.X_OK)
    ]
    if missing:
        reason = f"{', '.join(missing)} not found in {bin_dir}"
        reason_file = cache_dir() / f"kube-{version}.unavailable"
        if reason_file.is_file():
            reason += f"; the build was impossible: {reason_file.read_text().strip()}"
        raise ControlPlaneUnavailable(f"{reason}; {hint}")
    if not explicit and not stamp_path.is_file():
        raise ControlPlaneUnavailable(f"{stamp_path} missing (interrupted build?); {hint}")
    etcd = os.environ.get("DAEDALUS_ETCD") or shutil.which("etcd")
    if not etcd:
        raise ControlPlaneUnavailable("etcd not found on PATH; `apt-get install etcd-server` (build-kube.sh does)")
    stamp: dict[str, str] = {}
    if stamp_path.is_file():
        for line in stamp_path.read_text().splitlines():
            key, sep, value = line.partition("=")
            if sep:
                stamp[key] = value
    try:
        reported = subprocess.run(
            [str(bin_dir / "kube-apiserver"), "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout.split()
    except (OSError, subprocess.SubprocessError) as err:
        raise ControlPlaneUnavailable(f"{bin_dir / 'kube-apiserver'} does not run: {err}; {hint}") from err
    version = reported[-1] if reported else "unknown"
    return Binaries(bin_dir / "kube-apiserver", bin_dir / "kube-controller-manager", Path(etcd), version, stamp)


# --------------------------------------------------------------------------------------------------- PKI
def _rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _write_key(path: Path, key: rsa.RSAPrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)


def _cert(
    subject: x509.Name,
    key: rsa.RSAPrivateKey,
    issuer: x509.Name,
    issuer_key: rsa.RSAPrivateKey,
    *,
    ca: bool = False,
    server: bool = False,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )
    else:
        usage = x509.ExtendedKeyUsageOID.SERVER_AUTH if server else x509.ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False).add_extension(
            x509.KeyUsage(True, False, True, False, False, False, False, False, False), critical=True
        )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    return builder.sign(issuer_key, hashes.SHA256())


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attrs)


@dataclasses.dataclass(frozen=True)
class _Credential:
    cert: Path
    key: Path


class _Pki:
    """A throwaway CA, the apiserver's serving certificate, client certificates and the SA signing key.

    Kubernetes maps a client certificate's CN to the user name and each O to a group
    (https://kubernetes.io/docs/reference/access-authn-authz/authentication/#x509-client-certs).
    """

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self._ca_key = _rsa_key()
        self._ca_name = _name("daedalus-test-ca")
        ca_cert = _cert(self._ca_name, self._ca_key, self._ca_name, self._ca_key, ca=True)
        self.ca = root / "ca.crt"
        self.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
        self.serving = self._issue("apiserver", _name("kube-apiserver"), server=True)
        self.admin = self._issue("admin", _name(ADMIN_USER, "system:masters"))
        self.controller_manager = self._issue("controller-manager", _name("system:kube-controller-manager"))
        sa_key = _rsa_key()
        self.sa_key = root / "sa.key"
        _write_key(self.sa_key, sa_key)
        self.sa_pub = root / "sa.pub"
        self.sa_pub.write_bytes(
            sa_key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )

    def _issue(self, stem: str, subject: x509.Name, *, server: bool = False) -> _Credential:
        key = _rsa_key()
        cert = _cert(subject, key, self._ca_name, self._ca_key, server=server)
        cred = _Credential(self.root / f"{stem}.crt", self.root / f"{stem}.key")
        cred.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(cred.key, key)
        return cred


def _kubeconfig(server: str, ca: Path, user: str, user_entry: dict, namespace: str = "default") -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "daedalus-test", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": user_entry}],
        "contexts": [{"name": user, "context": {"cluster": "daedalus-test", "user": user, "namespace": namespace}}],
        "current-context": user,
    }


# ---------------------------------------------------------------------------------------------- control plane
class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager on loopback; see the module docstring.

    Use as a context manager or call `start` / `stop`. After `start`: `server` (``https://127.0.0.1:<port>``),
    `kubeconfig` (admin, ``system:masters``), `ca_file`, `startup_seconds` (wall time of `start`) and
    `startup_phases` (seconds per phase: pki, etcd, kube-apiserver, crds, kube-controller-manager). ServiceAccounts'
    requests are audited (`AUDIT_POLICY`, `audit_events`).

    Args:
        binaries: from `find_binaries` (default: looked up at construction).
        workdir: parent of the temporary directory (default: the system temp dir); logs are in
            ``<dir>/logs/{etcd,kube-apiserver,kube-controller-manager}.log`` until `stop`.
        keep: keep the directory after `stop` (for debugging).
        crds: CustomResourceDefinitions (dicts) installed before the controller manager starts. The garbage
            collector discovers resource types at start and then only every 30 s (kube-controller-manager 1.20
            runs ``garbageCollector.Sync(..., 30*time.Second, ...)``), so owner-reference GC for a CRD installed
            later can lag by up to ~30 s; CRDs given here are collected at once.
    """

    def __init__(
        self,
        binaries: Binaries | None = None,
        workdir: str | Path | None = None,
        keep: bool = False,
        crds: Sequence[dict] = (),
    ):
        self.binaries = binaries or find_binaries()
        self._crds = list(crds)
        self._parent = Path(workdir) if workdir else None
        self._keep = keep
        self.dir: Path | None = None
        self.server = ""
        self.kubeconfig: Path | None = None
        self.ca_file: Path | None = None
        self.startup_seconds = 0.0
        self.startup_phases: dict[str, float] = {}  # seconds per start-up phase, in order
        self._procs: dict[str, subprocess.Popen] = {}
        self._logs: dict[str, Path] = {}
        self._etcd_data: Path | None = None

    # -- lifecycle
    def __enter__(self) -> "ControlPlane":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 90.0) -> None:
        """Start the three components and wait until the API is ready and the controllers work.

        Args:
            timeout: seconds for the whole start-up.

        Raises:
            ControlPlaneError: a process exited or did not become ready in time (message: its log tail).
        """
        began = time.monotonic()
        deadline = began + timeout
        atexit.register(self.stop)  # no orphaned servers if the interpreter exits without calling stop()
        self.dir = Path(tempfile.mkdtemp(prefix="daedalus-kube-", dir=self._parent))
        (self.dir / "logs").mkdir()
        mark = time.monotonic()

        def phase(name: str) -> None:
            nonlocal mark
            now = time.monotonic()
            self.startup_phases[name] = now - mark
            mark = now

        try:
            pki = _Pki(self.dir / "pki")
            self.ca_file = pki.ca
            phase("pki")
            etcd_url = self._start_etcd(deadline)
            phase("etcd")
            port = free_port()
            self.server = f"https://127.0.0.1:{port}"
            self._start_apiserver(pki, etcd_url, port)
            self.kubeconfig = self.dir / "admin.kubeconfig"
            self._write_kubeconfig(
                self.kubeconfig,
                ADMIN_USER,
                {"client-certificate": str(pki.admin.cert), "client-key": str(pki.admin.key)},
            )
            self._wait_ready(pki, deadline)
            phase("kube-apiserver")
            self.install_crds(self._crds, timeout=max(1.0, deadline - time.monotonic()))
            phase("crds")
            kcm_config = self.dir / "controller-manager.kubeconfig"
            self._write_kubeconfig(
                kcm_config,
                "system:kube-controller-manager",
                {"client-certificate": str(pki.controller_manager.cert), "client-key": str(pki.controller_manager.key)},
            )
            self._start_controller_manager(pki, kcm_config)
            self.wait_default_service_account("default", deadline)
            phase("kube-controller-manager")
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - began

    def stop(self, grace: float = 10.0) -> None:
        """Stop the controller manager, the apiserver and etcd (in that order) and remove the directory.

        Each gets SIGTERM and ``grace`` seconds, then SIGKILL. Safe to call twice.
        """
        atexit.unregister(self.stop)
        for name in ("kube-controller-manager", "kube-apiserver", "etcd"):
            proc = self._procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(grace)
        if self._etcd_data and not self._keep:
            shutil.rmtree(self._etcd_data, ignore_errors=True)
        if self.dir and not self._keep:
            shutil.rmtree(self.dir, ignore_errors=True)

    def running(self) -> dict[str, bool]:
        """Component name -> whether its process is still alive."""
        return {name: proc.poll() is None for name, proc in self._procs.items()}

    # -- clients and credentials
    def api_client(self, kubeconfig: Path | None = None):
        """A `kubernetes.client.ApiClient` for ``kubeconfig`` (default: the admin one). Close it after use."""
        from kubernetes import client, config

        configuration = client.Configuration()
        config.load_kube_config(config_file=str(kubeconfig or self.kubeconfig), client_configuration=configuration)
        return client.ApiClient(configuration)

    def install_crds(self, crds: Sequence[dict], timeout: float = 30.0) -> None:
        """Create CustomResourceDefinitions and wait until each is ``Established``.

        Args:
            crds: apiextensions.k8s.io/v1 CRDs as dicts (see `crd_for_1_20` for CRDs newer than 1.20).
            timeout: seconds for all of them together.

        Raises:
            kubernetes.client.ApiException: the server rejected a CRD (e.g. 422 with the invalid schema paths).
            ControlPlaneError: a CRD was not Established in time.
        """
        from kubernetes import client

        deadline = time.monotonic() + timeout
        with self.api_client() as api:
            ext = client.ApiextensionsV1Api(api)
            for crd in crds:
                ext.create_custom_resource_definition(crd)
            for crd in crds:
                name = crd["metadata"]["name"]
                while True:
                    conditions = ext.read_custom_resource_definition(name).status.conditions or []
                    if any(c.type == "Established" and c.status == "True" for c in conditions):
                        break
                    if time.monotonic() > deadline:
                        raise ControlPlaneError(f"CRD {name} not Established within {timeout:.0f} s: {conditions}")
                    time.sleep(0.1)

    def service_account_kubeconfig(self, namespace: str, name: str, expiration_seconds: int = 3600) -> Path:
        """Write a kubeconfig that authenticates as ServiceAccount ``namespace/name`` and return its path.

        The token comes from the TokenRequest API (``POST .../serviceaccounts/<name>/token``), bound to the
        audience ``SERVICE_ACCOUNT_ISSUER`` and valid for ``expiration_seconds`` (the API's minimum is 600).
        The ServiceAccount must exist.

        Raises:
            kubernetes.client.ApiException: 404 when the ServiceAccount does not exist.
        """
        from kubernetes import client

        with self.api_client() as api:
            spec = client.V1TokenRequestSpec(audiences=[SERVICE_ACCOUNT_ISSUER], expiration_seconds=expiration_seconds)
            request = client.AuthenticationV1TokenRequest(spec=spec)
            answer = client.CoreV1Api(api).create_namespaced_service_account_token(name, namespace, request)
        user = f"system:serviceaccount:{namespace}:{name}"
        path = self.dir / f"sa-{namespace}-{name}.kubeconfig"
        self._write_kubeconfig(path, user, {"token": answer.status.token}, namespace=namespace)
        return path

    def audit_events(self, user: str | None = None) -> list[dict]:
        """kube-apiserver's audit events so far (`AUDIT_POLICY`: ServiceAccounts' requests, each once its response
        is complete), oldest first; only those of ``user`` (e.g. ``system:serviceaccount:NS:NAME``) when given.

        Each is an ``audit.k8s.io/v1`` Event: ``verb``, ``user.username``, ``objectRef`` (resource, namespace,
        apiGroup, subresource, name), ``responseStatus.code`` (403: refused by the authorizer). The server writes
        the ResponseComplete event after its handler returns (``WithAudit``'s deferred ``processAuditEvent``), so a
        request already counted in ``apiserver_request_total`` (inside the handler) may reach the log a moment
        later: a caller that compares the two waits for the log.
        """
        import json

        path = self.dir / "logs" / "audit.log"
        if not path.exists():
            return []
        events = []
        for line in path.read_text(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except ValueError:  # a line being written
                continue
            if user is None or event.get("user", {}).get("username") == user:
                events.append(event)
        return events

    def log_tail(self, component: str, lines: int = 30) -> str:
        """The last ``lines`` lines of a component's log ("etcd", "kube-apiserver", "kube-controller-manager")."""
        path = self._logs.get(component)
        if not path or not path.exists():
            return "(no log)"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    # -- internals
    def _write_kubeconfig(self, path: Path, user: str, entry: dict, namespace: str = "default") -> None:
        path.write_text(yaml.safe_dump(_kubeconfig(self.server, self.ca_file, user, entry, namespace)))
        path.chmod(0o600)

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = self.dir / "logs" / f"{name}.log"
        self._logs[name] = log
        with log.open("wb") as out:
            proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        self._procs[name] = proc
        return proc

    def _check_alive(self, name: str) -> None:
        proc = self._procs[name]
        if proc.poll() is not None:
            raise ControlPlaneError(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")

    def _start_etcd(self, deadline: float) -> str:
        shm = Path("/dev/shm")
        self._etcd_data = Path(tempfile.mkdtemp(prefix="daedalus-etcd-", dir=shm if shm.is_dir() else self.dir))
        client_url = f"http://127.0.0.1:{free_port()}"
        peer_url = f"http://127.0.0.1:{free_port()}"
        self._spawn(
            "etcd",
            [
                str(self.binaries.etcd),
                "--name=daedalus",
                f"--data-dir={self._etcd_data}",
                f"--listen-client-urls={client_url}",
                f"--advertise-client-urls={client_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=daedalus={peer_url}",
                "--initial-cluster-state=new",
                "--logger=zap",
                "--log-level=warn",
            ],
        )
        while time.monotonic() < deadline:
            self._check_alive("etcd")
            try:
                with urllib.request.urlopen(f"{client_url}/health", timeout=2) as answer:
                    if b'"health":"true"' in answer.read():
                        return client_url
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise ControlPlaneError(f"etcd not healthy in time:\n{self.log_tail('etcd')}")

    def _start_apiserver(self, pki: _Pki, etcd_url: str, port: int) -> None:
        policy = self.dir / "audit-policy.yaml"
        policy.write_text(yaml.safe_dump(AUDIT_POLICY))
        self._spawn(
            "kube-apiserver",
            [
                str(self.binaries.kube_apiserver),
                f"--etcd-servers={etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={port}",
                "--insecure-port=0",
                f"--cert-dir={self.dir / 'apiserver-certs'}",
                f"--tls-cert-file={pki.serving.cert}",
                f"--tls-private-key-file={pki.serving.key}",
                f"--client-ca-file={pki.ca}",
                "--authorization-mode=RBAC",
                f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
                f"--api-audiences={SERVICE_ACCOUNT_ISSUER}",
                f"--service-account-key-file={pki.sa_pub}",
                f"--service-account-signing-key-file={pki.sa_key}",
                # Only an address range to allocate Service ClusterIPs from; nothing is routed there.
                "--service-cluster-ip-range=10.96.0.0/24",
                "--endpoint-reconciler-type=none",
                "--profiling=false",
                f"--audit-policy-file={policy}",
                f"--audit-log-path={self.dir / 'logs' / 'audit.log'}",
                "--audit-log-format=json",
                "--audit-log-mode=blocking",
                "--v=1",
            ],
        )

    def _wait_ready(self, pki: _Pki, deadline: float) -> None:
        context = ssl.create_default_context(cafile=str(pki.ca))
        context.load_cert_chain(str(pki.admin.cert), str(pki.admin.key))
        last = ""
        while time.monotonic() < deadline:
            self._check_alive("kube-apiserver")
            try:
                with urllib.request.urlopen(f"{self.server}/readyz", timeout=2, context=context) as answer:
                    body = answer.read().decode()
                    if answer.status == 200 and body.strip() == "ok":
                        return
                    last = body
            except urllib.error.HTTPError as err:
                last = err.read().decode(errors="replace")
            except (urllib.error.URLError, OSError) as err:
                last = str(err)
            time.sleep(0.2)
        raise ControlPlaneError(
            f"kube-apiserver not ready in time (last /readyz: {last[-500:]}):\n{self.log_tail('kube-apiserver')}"
        )

    def _start_controller_manager(self, pki: _Pki, kcm_config: Path) -> None:
        self._spawn(
            "kube-controller-manager",
            [
                str(self.binaries.kube_controller_manager),
                f"--kubeconfig={kcm_config}",
                f"--controllers={','.join(CONTROLLERS)}",
                f"--service-account-private-key-file={pki.sa_key}",
                f"--root-ca-file={pki.ca}",
                # Each controller acts as its own ServiceAccount bound to its bootstrap ClusterRole
                # (system:controller:namespace-controller, ...), as kubeadm runs it; the kcm's own user
                # system:kube-controller-manager may only mint those credentials.
                "--use-service-account-credentials=true",
                "--leader-elect=false",
                "--secure-port=0",
                "--port=0",
                "--concurrent-gc-syncs=5",
                "--v=1",
            ],
        )

    def wait_default_service_account(self, namespace: str, deadline: float) -> None:
        """Wait until the serviceaccount controller made ``<namespace>/default`` and the token controller its Secret.

        Pods (and their server-side dry runs) in a namespace are refused with "500: No API token found for service
        account default" until then: a fresh namespace is usable a few hundred milliseconds after it is created.

        Args:
            namespace: the namespace to wait for.
            deadline: ``time.monotonic()`` value after which to give up.

        Raises:
            ControlPlaneError: the deadline passed (with the controller manager's log tail).
        """
        from kubernetes import client

        with self.api_client() as api:
            core = client.CoreV1Api(api)
            while time.monotonic() < deadline:
                self._check_alive("kube-controller-manager")
                try:
                    account = core.read_namespaced_service_account("default", namespace)
                    if account.secrets:
                        return
                except client.ApiException as err:
                    if err.status != 404:
                        raise
                time.sleep(0.2)
        raise ControlPlaneError(
            f"kube-controller-manager did not create {namespace}/default and its token in time:\n"
            + self.log_tail("kube-controller-manager")
        )


# ------------------------------------------------------------------------------------------- CRDs for 1.20
#: Every key of ``JSONSchemaProps`` in apiextensions.k8s.io/v1 as of Kubernetes 1.20
#: (k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1/types_jsonschema.go at v1.20.2). Later releases
#: added ``x-kubernetes-validations`` (CEL, 1.23 alpha / 1.25 beta), which 1.20 would drop without a word.
SCHEMA_KEYS_1_20 = frozenset(
    {
        "id", "$schema", "$ref", "description", "type", "format", "title", "default", "maximum",
        "exclusiveMaximum", "minimum", "exclusiveMinimum", "maxLength", "minLength", "pattern", "maxItems",
        "minItems", "uniqueItems", "multipleOf", "enum", "maxProperties", "minProperties", "required", "items",
        "allOf", "oneOf", "anyOf", "not", "properties", "additionalProperties", "patternProperties",
        "dependencies", "additionalItems", "definitions", "externalDocs", "example", "nullable",
        "x-kubernetes-preserve-unknown-fields", "x-kubernetes-embedded-resource", "x-kubernetes-int-or-string",
        "x-kubernetes-list-map-keys", "x-kubernetes-list-type", "x-kubernetes-map-type",
    }
)  # fmt: skip
#: ``CustomResourceDefinitionVersion`` keys in 1.20; ``selectableFields`` (1.30) is newer.
VERSION_KEYS_1_20 = frozenset(
    {"name", "served", "storage", "deprecated", "deprecationWarning", "schema", "subresources",
     "additionalPrinterColumns"}
)  # fmt: skip


def crd_for_1_20(crd: dict) -> tuple[dict, list[str]]:
    """Copy an apiextensions.k8s.io/v1 CRD with the keys kube-apiserver 1.20 does not know removed.

    Kubernetes 1.20 decodes a CRD leniently and silently drops unknown fields, so a newer CRD (KubeRay v1.7.0
    carries two CEL ``x-kubernetes-validations`` rules) installs but loses those rules. This helper makes the
    loss explicit: it returns the stripped copy and the JSON paths of every removed key, so a test can assert
    exactly what the old server will not enforce. Schemas are walked through ``properties``,
    ``patternProperties``, ``definitions``, ``dependencies``, ``items``, ``additionalProperties``,
    ``additionalItems``, ``allOf``/``anyOf``/``oneOf`` and ``not``.

    Args:
        crd: a CustomResourceDefinition as a dict (``apiVersion: apiextensions.k8s.io/v1``).

    Returns:
        ``(stripped_crd, removed_paths)``; the input is not modified.

    Raises:
        ValueError: the CRD is not ``apiextensions.k8s.io/v1`` (v1beta1 has a different layout).
    """
    import copy

    if crd.get("apiVersion") != "apiextensions.k8s.io/v1" or crd.get("kind") != "CustomResourceDefinition":
        raise ValueError(f"expected an apiextensions.k8s.io/v1 CustomResourceDefinition, got "
                         f"{crd.get('apiVersion')}/{crd.get('kind')}")
    out = copy.deepcopy(crd)
    removed: list[str] = []

    def schema(node: object, path: str) -> None:
        if not isinstance(node, dict):  # booleans for additionalProperties/additionalItems
            return
        for key in [k for k in node if k not in SCHEMA_KEYS_1_20]:
            del node[key]
            removed.append(f"{path}.{key}")
        for key in ("properties", "patternProperties", "definitions"):
            for name, child in (node.get(key) or {}).items():
                schema(child, f"{path}.{key}.{name}")
        for name, child in (node.get("dependencies") or {}).items():
            schema(child, f"{path}.dependencies.{name}")  # a list of names is left alone
        for key in ("items", "additionalProperties", "additionalItems", "not"):
            child = node.get(key)
            if isinstance(child, list):
                for i, item in enumerate(child):
                    schema(item, f"{path}.{key}[{i}]")
            else:
                schema(child, f"{path}.{key}")
        for key in ("allOf", "anyOf", "oneOf"):
            for i, child in enumerate(node.get(key) or []):
                schema(child, f"{path}.{key}[{i}]")

    for i, version in enumerate(out["spec"]["versions"]):
        base = f"spec.versions[{i}]"
        for key in [k for k in version if k not in VERSION_KEYS_1_20]:
            del version[key]
            removed.append(f"{base}.{key}")
        root = (version.get("schema") or {}).get("openAPIV3Schema")
        if root is not None:
            schema(root, f"{base}.schema.openAPIV3Schema")
    return out, removed
