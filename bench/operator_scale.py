"""Operator at scale: N RLTrainingJobs created at once against the honest kmock API with the fake KubeRay.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python bench/operator_scale.py [--jobs 500]`` (a few minutes on 2 cores).

Set-up, all real processes and real HTTP:

- the API: ``tests/support/kmock_api.py`` (kmock with resourceVersions, 409s, watches, status subresource, owner GC)
  in a thread of this process;
- KubeRay: ``tests/support/fake_kuberay.py`` (pods from the RayCluster templates, scheduler, kubelet, RayCluster
  status), with one change for N clusters: the per-node pod load is computed once per pass instead of once per
  cluster (:class:`ScaleFakeKubeRay`; otherwise the fixture itself is O(N^2) per pass), and a pass every second;
- Ray: every cluster's dashboard endpoint is ``bench/lib/fake_ray_jobs.py`` (the Ray Jobs REST API subset that Ray's
  ``JobSubmissionClient`` uses), in its own process: N real Ray jobs would need N supervisor actors and N trainers;
- the trainers: the same process answers every job's ``GET /status`` on the operator's ``--control-port``, one step
  every 10 s (as a GPU-sized step), so a Running job looks like a training one;
- the operator: ``python -m daedalus_operator`` in its own process (default ``--poll-interval`` 2 s and
  ``--poll-budget``; ``--poll-budget 0`` here runs it without the budget), so its peak RSS (``VmHWM`` in
  ``/proc/<pid>/status``) is its own.

Measured: seconds from the first create until every RayCluster exists and until every job is ``Running``; reconcile
latency p50/p99 from the operator's own histogram ``daedalus_operator_reconcile_seconds`` (``histogram_quantile``-style
interpolation in its buckets); the operator's peak RSS; API requests per job made by the operator (kmock's request log,
by User-Agent: kopf's aiohttp and the kubernetes client; the fake KubeRay and this script use ``requests``), until all
jobs run and per minute in a steady-state window afterwards.

Floor: the same number of RayCluster creates (the operator's own RayCluster body) with the official ``kubernetes``
client, sequentially, against a fresh kmock in the same run (3 rounds before the operator run and 3 after it, so
that the floor sees the same range of machine load; median with min/max). Targets: time to all RayClusters and
to all Running <= 3x floor, p99 <= 1 s, RSS <= 200 MiB.

One N-job run per invocation (about 3 minutes at 500 on 2 cores); the floor is repeated 6 times and the percentiles
come from every reconcile of the run.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import copy
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
LIB = Path(__file__).resolve().parent / "lib"
sys.path.insert(0, str(LIB))
sys.path.insert(0, str(ROOT / "tests" / "support"))

import yaml  # noqa: E402

from benchutil import print_load, summarize  # noqa: E402

RLTJ = "daedalus.dev/v1alpha1/rltrainingjobs"
RAYCLUSTERS = "ray.io/v1/rayclusters"
NAMESPACE = "scale"


def scale_fake_kuberay_class():
    from fake_kuberay import PODS, FakeKubeRay

    class ScaleFakeKubeRay(FakeKubeRay):
        """:class:`FakeKubeRay` with the node load computed once per pass (same behaviour, O(N) per pass)."""

        def step(self) -> None:
            nodes = {n["metadata"]["name"]: n for n in self.kube.list("v1/nodes")}
            pods = self.kube.list(PODS, selector="ray.io/cluster")
            self._node_lifecycle(pods, nodes)
            self._load: dict[str, int] = {}
            for p in pods:
                n = (p.get("spec") or {}).get("nodeName")
                if n:
                    self._load[n] = self._load.get(n, 0) + 1
            by_cluster: dict[tuple[str, str], list[dict]] = {}
            for p in pods:
                key = (p["metadata"]["namespace"], p["metadata"]["labels"].get("ray.io/cluster"))
                by_cluster.setdefault(key, []).append(p)
            for cluster in self.kube.list("ray.io/v1/rayclusters"):
                if cluster["metadata"].get("deletionTimestamp"):
                    continue
                mine = by_cluster.get((cluster["metadata"]["namespace"], cluster["metadata"]["name"]), [])
                self._reconcile_cluster(cluster, mine, nodes)

        def _reconcile_cluster(self, cluster: dict, pods: list[dict], nodes: dict[str, dict]) -> None:
            spec = cluster["spec"]
            live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
            wanted = [("head", "headgroup", spec["headGroupSpec"]["template"], 1)]
            wanted += [("worker", g["groupName"], g["template"], int(g.get("replicas", 0)))
                       for g in spec.get("workerGroupSpecs", [])]
            for role, group, template, replicas in wanted:
                have = [p for p in live if p["metadata"]["labels"].get("ray.io/group") == group]
                for _ in range(replicas - len(have)):
                    live.append(self._create_pod(cluster, role, group, template))
            for pod in live:
                if not (pod.get("spec") or {}).get("nodeName"):
                    self._schedule(pod, nodes, self._load)
            self._write_status(cluster, live)

    return ScaleFakeKubeRay


def job_body(name: str, checkpoints: Path) -> dict:
    """``examples/local-tiny.yaml`` as job ``name``, defaulted like the API server does with the generated CRD."""
    from daedalus_trainer.crd import apply_defaults, openapi_schema

    doc = yaml.safe_load((ROOT / "examples" / "local-tiny.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": NAMESPACE}
    doc["spec"]["checkpoint"]["path"] = str(checkpoints)
    return apply_defaults(openapi_schema(), doc)


def free_port() -> int:
    from ray_head import free_port as fp

    return fp()


def histogram_quantiles(text: str, name: str, qs: tuple[float, ...]) -> tuple[dict[float, float], int, float]:
    """Quantiles of a Prometheus histogram from its exposition text (linear interpolation inside the bucket, as
    PromQL's ``histogram_quantile``); also the count and the sum."""
    buckets: dict[float, float] = {}
    count = total = 0.0
    for line in text.splitlines():
        if line.startswith(f"{name}_bucket"):
            le = re.search(r'le="([^"]+)"', line).group(1)
            buckets[float("inf") if le == "+Inf" else float(le)] = buckets.get(
                float("inf") if le == "+Inf" else float(le), 0.0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith(f"{name}_count"):
            count += float(line.rsplit(" ", 1)[1])
        elif line.startswith(f"{name}_sum"):
            total += float(line.rsplit(" ", 1)[1])
    edges = sorted(buckets)
    out = {}
    for q in qs:
        rank = q * count
        prev_le, prev_c = 0.0, 0.0
        value = float("nan")
        for le in edges:
            c = buckets[le]
            if c >= rank:
                if le == float("inf"):
                    value = prev_le
                else:
                    value = prev_le + (le - prev_le) * ((rank - prev_c) / max(c - prev_c, 1e-12))
                break
            prev_le, prev_c = le, c
        out[q] = value
    return out, int(count), total


def peak_rss_mib(pid: int) -> tuple[float, float]:
    """``(VmHWM, VmRSS)`` of a process in MiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmHWM:", "VmRSS:")):
            k, v = line.split(":", 1)
            fields[k] = int(v.split()[0]) / 1024
    return fields.get("VmHWM", float("nan")), fields.get("VmRSS", float("nan"))


def operator_requests(api, breakdown: dict | None = None, start: int = 0) -> int:
    """Requests in kmock's log made by the operator (kopf's aiohttp or the kubernetes client, not ``requests``), from
    log index ``start``; ``breakdown`` (if given) is filled with counts per ``METHOD resource[/subresource]``."""
    n = 0
    for r in list(api._requests)[start:]:  # kmock's request log
        ua = (r.headers or {}).get("User-Agent", "")
        if ua.startswith("python-requests"):
            continue
        n += 1
        if breakdown is not None:
            res = r.resource.plural if r.resource is not None else "(discovery)"
            sub = f"/{r.subresource}" if getattr(r, "subresource", None) else ""
            watch = "?watch" if "watch" in (r.url.query or {}) else ""
            method = r.method.value if hasattr(r.method, "value") else str(r.method)
            key = f"{method} {res}{sub}{watch}"
            breakdown[key] = breakdown.get(key, 0) + 1
    return n


def operator_raycluster_spec(tmp: Path) -> dict:
    """The spec of the RayCluster the operator builds for one of the jobs (for the floor's creates)."""
    from daedalus_operator import resources
    from daedalus_operator.handlers import job_view
    from daedalus_operator.settings import OperatorSettings

    body = job_body("floor-job", tmp / "checkpoints")
    body["metadata"]["uid"] = "00000000-0000-0000-0000-000000000000"
    return resources.build_raycluster(job_view(body), OperatorSettings())["spec"]


def count_objects(api) -> tuple[int, int]:
    """``(RayClusters, Running jobs)`` read straight from kmock's store (no copies, no HTTP: the monitor must not
    load the API server it measures)."""
    clusters = running = 0
    with api._lock:
        for (key, ns, _), obj in api._store.items():
            if ns != NAMESPACE:
                continue
            if key == RAYCLUSTERS:
                clusters += 1
            elif key == RLTJ and (obj.get("status") or {}).get("phase") == "Running":
                running += 1
    return clusters, running


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (``/proc/<pid>/stat`` fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def floor_creates(n: int, body: dict, rounds: int) -> list[float]:
    """Seconds for ``n`` sequential RayCluster creates with the official kubernetes client against a fresh kmock."""
    import kubernetes
    from kmock_api import KubeServer

    out = []
    for _ in range(rounds):
        server = KubeServer().start()
        try:
            cfg = kubernetes.client.Configuration()
            cfg.host = server.url
            cfg.api_key = {"authorization": "Bearer kmock-token"}
            api = kubernetes.client.CustomObjectsApi(kubernetes.client.ApiClient(cfg))
            t = time.perf_counter()
            for i in range(n):
                b = copy.deepcopy(body)
                b["metadata"] = {"name": f"floor-{i:05d}", "namespace": NAMESPACE}
                api.create_namespaced_custom_object("ray.io", "v1", NAMESPACE, "rayclusters", b)
            out.append(time.perf_counter() - t)
        finally:
            server.stop()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=500)
    p.add_argument("--poll-interval", type=float, default=2.0, help="the operator's --poll-interval")
    p.add_argument("--poll-budget", type=float, default=None,
                   help="the operator's --poll-budget (default: the operator's default; 0: no limit, every job "
                        "looked at every poll interval)")
    p.add_argument("--steady-seconds", type=float, default=20.0, help="steady-state window after all are Running")
    p.add_argument("--timeout", type=float, default=900.0)
    args = p.parse_args(argv)

    from kmock_api import KubeServer

    print_load("start")
    tmp = Path(tempfile.mkdtemp(prefix="daedalus-bench-scale-"))
    floor_body = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "spec": operator_raycluster_spec(tmp)}
    floors = floor_creates(args.jobs, floor_body, rounds=3)  # before the operator run; 3 more after it
    ray_port, metrics_port, liveness_port, control_port = free_port(), free_port(), free_port(), free_port()
    ray = subprocess.Popen([sys.executable, str(LIB / "fake_ray_jobs.py"), "--port", str(ray_port),
                            "--trainer-port", str(control_port)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    assert ray.stdout.readline().strip() == b"ready"
    server = KubeServer().start()
    kubeconfig = server.write_kubeconfig(tmp / "kubeconfig")
    kube = server.client()
    fake = scale_fake_kuberay_class()(kube, dashboard_port=ray_port, volume_root=None, interval=1.0)
    operator = None
    figures: dict = {}
    try:
        for i in range(4):
            fake.add_node(f"node-{i}")
        fake.start()
        log_path = tmp / "operator.log"
        operator = subprocess.Popen(
            [sys.executable, "-m", "daedalus_operator", "--all-namespaces", "--standalone", "--kubeconfig",
             str(kubeconfig), "--poll-interval", str(args.poll_interval), "--control-port", str(control_port),
             "--metrics-port", str(metrics_port), "--liveness", f"http://127.0.0.1:{liveness_port}/healthz",
             "--entrypoint", "true {config}", "--request-timeout", "3", "--unreachable-grace", "600",
             *(["--poll-budget", str(args.poll_budget)] if args.poll_budget is not None else [])],
            stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONPATH": f"{ROOT / 'operator'}:{ROOT / 'trainer'}"})
        deadline = time.time() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{liveness_port}/healthz", timeout=2).read()
                break
            except OSError:
                if time.time() > deadline or operator.poll() is not None:
                    raise RuntimeError(f"the operator did not start:\n{log_path.read_text()[-3000:]}")
                time.sleep(0.3)
        rss_idle = peak_rss_mib(operator.pid)
        bodies = [job_body(f"job-{i:04d}", tmp / "checkpoints") for i in range(args.jobs)]
        req0 = operator_requests(server.api)
        log0 = len(server.api._requests)
        print(f"operator pid {operator.pid} ready (RSS {rss_idle[1]:.0f} MiB); creating {args.jobs} RLTrainingJobs",
              flush=True)

        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda b: kube.create(RLTJ, NAMESPACE, b), bodies))
        t_created = time.perf_counter() - t0
        t_clusters = t_running = None
        last_print = 0.0
        cpu0 = cpu_seconds(operator.pid), time.process_time()
        while time.perf_counter() - t0 < args.timeout:
            clusters, running = count_objects(server.api)
            now = time.perf_counter() - t0
            if t_clusters is None and clusters >= args.jobs:
                t_clusters = now
            if running >= args.jobs:
                t_running = now
                break
            if now - last_print > 15:
                print(f"  +{now:.0f} s: {clusters} RayClusters, {running} Running", flush=True)
                last_print = now
            time.sleep(1.0)
        cpu_run = cpu_seconds(operator.pid) - cpu0[0], time.process_time() - cpu0[1]
        if t_running is None:
            raise RuntimeError(f"not all jobs Running after {args.timeout:.0f} s ({running}/{args.jobs})")
        log_start = len(server.api._requests) - 1
        breakdown: dict[str, int] = {}
        req_run = operator_requests(server.api) - req0
        print(f"  all {args.jobs} RayClusters after {t_clusters:.1f} s, all Running after {t_running:.1f} s", flush=True)
        t_s = time.perf_counter()
        time.sleep(args.steady_seconds)
        req_steady = operator_requests(server.api) - req0 - req_run
        operator_requests(server.api, breakdown, start=log0)
        del log_start
        steady = time.perf_counter() - t_s
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        qs, n_rec, sum_rec = histogram_quantiles(metrics, "daedalus_operator_reconcile_seconds", (0.5, 0.99))
        hwm, rss = peak_rss_mib(operator.pid)
        sample_rc = copy.deepcopy(server.api.objects(RAYCLUSTERS, NAMESPACE)[0])
        figures = {"created": t_created, "clusters": t_clusters, "running": t_running, "requests_run": req_run,
                   "requests_steady": req_steady, "steady_s": steady, "p50": qs[0.5], "p99": qs[0.99],
                   "reconciles": n_rec, "reconcile_mean": sum_rec / max(n_rec, 1), "hwm": hwm, "rss": rss,
                   "rss_idle": rss_idle[1], "fake_passes": fake.passes, "fake_errors": len(fake.errors),
                   "cpu_operator": cpu_run[0], "cpu_bench": cpu_run[1], "breakdown": breakdown,
                   "api_timeouts": log_path.read_text(errors="replace").count("Read timed out")}
    finally:
        if operator is not None and operator.poll() is None:
            os.killpg(operator.pid, signal.SIGTERM)
            try:
                operator.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(operator.pid, signal.SIGKILL)
        fake.stop()
        server.stop()
        os.killpg(ray.pid, signal.SIGTERM)
        ray.wait(10)
    body = {k: v for k, v in sample_rc.items() if k in ("apiVersion", "kind", "spec")}
    floors += floor_creates(args.jobs, body, rounds=3)
    shutil.rmtree(tmp, ignore_errors=True)
    print_load("end")

    f = figures
    fl = summarize(floors)
    n = args.jobs
    print(f"\n== operator scale: {n} RLTrainingJobs created at once (8 client threads, {f['created']:.1f} s) ==")
    print(f"all RayClusters exist       {f['clusters']:.1f} s  ({f['clusters'] / fl.median:.2f}x floor)")
    print(f"all jobs Running            {f['running']:.1f} s  ({f['running'] / fl.median:.2f}x floor)")
    print(f"floor: {n} RayCluster creates, kubernetes client, sequential  {fl.fmt(2, 's')}")
    print(f"reconcile latency           p50 {f['p50']:.3f} s, p99 {f['p99']:.3f} s, mean {f['reconcile_mean']:.3f} s "
          f"over {f['reconciles']} reconciles (operator histogram)")
    print(f"operator RSS                peak {f['hwm']:.0f} MiB (idle {f['rss_idle']:.0f} MiB, end {f['rss']:.0f} MiB)")
    print(f"API requests by the operator {f['requests_run'] / n:.1f} per job until all Running; "
          f"{f['requests_steady'] / n / f['steady_s'] * 60:.1f} per job per minute in steady state "
          f"({f['steady_s']:.0f} s window)")
    top = sorted(f["breakdown"].items(), key=lambda kv: -kv[1])[:12]
    print("  per job, until the end of the steady-state window: " + ", ".join(f"{k} {v / n:.1f}" for k, v in top))
    print(f"CPU until all Running: operator {f['cpu_operator']:.0f} s; API stand-in + fake KubeRay (this process) "
          f"{f['cpu_bench']:.0f} s; operator log lines with an API read timeout: {f['api_timeouts']}")
    print(f"fake KubeRay passes {f['fake_passes']}, errors {f['fake_errors']}")
    print()
    print(f"operator_scale_p99: {f['p99']:.3f} s reconcile p99 (anchor: 1 s target, {f['p99']:.2f}x); "
          f"peak RSS {f['hwm']:.0f} MiB (target 200 MiB)")
    print(f"operator_scale: {f['running']:.1f} s to {n} jobs Running (anchor: floor {n} kubernetes-client creates "
          f"{fl.median:.1f} s, {f['running'] / fl.median:.2f}x; target <= 3x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
