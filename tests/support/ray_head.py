"""A real local Ray head for a test session: ``ray start --head --block`` in its own process group.

Why these choices (docs/engineering-notes.md, "A real local Ray head for tests"):

- every port is picked free (several engineers share the machine): GCS outside Ray's default worker port range
  10002-19999 (``ray start`` refuses it otherwise), dashboard, dashboard agent, runtime-env agent, client server,
  metrics export, node and object manager;
- a private ``--temp-dir`` so the head's ``ray_current_cluster`` file never makes someone else's ``ray.init()``
  attach to this cluster;
- the virtualenv's ``bin`` first on ``PATH`` so a job entrypoint ``python -m ...`` runs with the project installed;
- ``RAY_AUTH_MODE=disabled``: Ray 2.60 enables token authentication whenever ``~/.ray/auth_token`` exists, and that
  file is shared by everyone on the machine;
- stopped by signalling its own process group (never ``ray stop``, which would kill every Ray on the machine).
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path


#: Where a Ray head's own ports are picked: below Linux's ephemeral range (``ip_local_port_range``, 32768-60999 by
#: default) and above Ray's worker ports (10002-19999 by default; for these heads 100 ports from 30000-30990, so
#: up to 31089: Ray refuses a head port inside its own worker range). A port picked free
#: in the ephemeral range can be handed out again before the head binds it: the head's own gRPC servers, the other
#: test worker's Ray and every outgoing connection take ephemeral ports during the seconds ``ray start`` takes. Once
#: the dashboard's port went to a gRPC server that way, and the readiness poll read HTTP/2 bytes (BadStatusLine).
HEAD_PORTS = (31100, 32767)


def _bound_socket(lo: int, hi: int) -> socket.socket:
    """A socket bound on every address to a port in [lo, hi] picked at random (the caller closes it).

    Raises:
        RuntimeError: no free port found in 200 tries."""
    for _ in range(200):
        s = socket.socket()
        try:
            s.bind(("", random.randint(lo, hi)))
        except OSError:
            s.close()
            continue
        return s
    raise RuntimeError(f"no free port in [{lo}, {hi}]")


def distinct_free_ports(n: int, lo: int = HEAD_PORTS[0], hi: int = HEAD_PORTS[1]) -> list[int]:
    """``n`` different TCP ports in [lo, hi] free on every address right now: each stays bound until all are chosen,
    so two calls of :func:`free_port` cannot hand out the same port (Ray refuses a head whose components share one).

    Raises:
        RuntimeError: a free port was not found in 200 tries."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            socks.append(_bound_socket(lo, hi))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


#: Where :func:`free_port` picks by default: outside the ephemeral range for the reason :data:`HEAD_PORTS` gives
#: (once the operator's liveness port, picked by binding port 0, was taken before kopf bound it: its health
#: reporter failed and the operator under test stopped), and outside the ranges the heads use (GCS 20000-24999).
SERVER_PORTS = (25000, 29999)


def free_port(lo: int = SERVER_PORTS[0], hi: int = SERVER_PORTS[1]) -> int:
    """A TCP port in [lo, hi] free on every address right now, for a server a test starts (operator ports, the
    control plane's, Prometheus, a trainer's endpoint).

    Bound on all addresses, not 127.0.0.1 alone: the operator's metrics server listens on all of them, and a port free
    on loopback can be held on the machine's own address (Ray's worker processes take ephemeral ports there), which
    made ``--metrics-port`` fail with EADDRINUSE in two e2e tests of one CI run.

    Raises:
        RuntimeError: no free port found in 200 tries."""
    with _bound_socket(lo, hi) as s:
        return s.getsockname()[1]


@dataclasses.dataclass
class RayHead:
    """A running head: ``dashboard_url`` (``http://127.0.0.1:<port>``), ``gcs_address``, its process and temp dir."""

    dashboard_port: int
    gcs_port: int
    temp_dir: Path
    process: subprocess.Popen
    log_path: Path

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    @property
    def gcs_address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the head's process group, SIGKILL after ``grace`` seconds; remove the temp dir."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # leftovers of the group (raylet, gcs, workers)
        except (ProcessLookupError, PermissionError):
            pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def start_ray_head(num_cpus: int = 2, timeout: float = 120.0, env: dict[str, str] | None = None) -> RayHead:
    """Start a head and wait until its job API answers ``/api/version``.

    Raises:
        RuntimeError: the head exited or did not answer within ``timeout`` seconds (with the tail of its log).
    """
    venv_bin = Path(sys.executable).parent
    ray = venv_bin / "ray"
    temp_dir = Path(tempfile.mkdtemp(prefix="dray-", dir="/tmp"))
    gcs = free_port(20000, 24999)
    names = ("dashboard", "client", "agent_http", "agent_grpc", "runtime_env", "metrics", "node_manager",
             "object_manager")
    ports = dict(zip(names, distinct_free_ports(len(names))))
    dash = ports["dashboard"]
    worker_lo = free_port(30000, 30999) // 10 * 10
    cmd = [
        str(ray), "start", "--head", "--block", "--disable-usage-stats",
        f"--port={gcs}", f"--num-cpus={num_cpus}", "--num-gpus=0",
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
        f"--ray-client-server-port={ports['client']}",
        f"--dashboard-agent-listen-port={ports['agent_http']}", f"--dashboard-agent-grpc-port={ports['agent_grpc']}",
        f"--runtime-env-agent-port={ports['runtime_env']}", f"--metrics-export-port={ports['metrics']}",
        f"--node-manager-port={ports['node_manager']}", f"--object-manager-port={ports['object_manager']}",
        f"--min-worker-port={worker_lo}", f"--max-worker-port={worker_lo + 99}",
        f"--temp-dir={temp_dir}", "--node-ip-address=127.0.0.1",
    ]
    full_env = dict(os.environ)
    full_env.update({"PATH": f"{venv_bin}:{full_env.get('PATH', '')}", "RAY_USAGE_STATS_ENABLED": "0",
                     "OMP_NUM_THREADS": "1", "RAY_TMPDIR": str(temp_dir), "PYTHONUNBUFFERED": "1",
                     # Ray >= 2.52 turns token auth on when ~/.ray/auth_token exists (a file shared by every
                     # session on this machine); this head must not depend on it. ``env`` may turn it on with a
                     # token of its own (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN), as the operator's RayClusters run.
                     "RAY_AUTH_MODE": "disabled"})
    full_env.pop("RAY_ADDRESS", None)
    full_env.update(env or {})
    log_path = temp_dir / "ray-start.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True,
                                cwd=str(temp_dir))
    head = RayHead(dash, gcs, temp_dir, proc, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = head.log_tail()
            head.stop()
            raise RuntimeError(f"ray start exited with {proc.returncode}:\n{tail}")
        # with RAY_AUTH_MODE=token in ``env`` the job API needs the token (the health endpoint would answer before
        # the job API is up)
        token = full_env.get("RAY_AUTH_TOKEN") if full_env.get("RAY_AUTH_MODE") == "token" else None
        request = urllib.request.Request(f"{head.dashboard_url}/api/version",
                                         headers={"Authorization": f"Bearer {token}"} if token else {})
        try:
            with urllib.request.urlopen(request, timeout=2) as r:
                if r.status == 200:
                    return head
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    tail = head.log_tail()
    head.stop()
    raise RuntimeError(f"Ray head did not answer within {timeout:.0f} s:\n{tail}")
