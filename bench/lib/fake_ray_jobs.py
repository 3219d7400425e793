"""A stand-in for the Ray Jobs REST API of many Ray heads, for the operator scale benchmark.

500 real Ray jobs would need 500 job-supervisor actors and 500 trainer processes (tens of GB); the scale benchmark
measures the operator, so every RayCluster's published dashboard endpoint points here instead. It speaks the subset
of the Ray Jobs REST API that ``ray.job_submission.JobSubmissionClient`` (Ray 2.60) uses
(https://docs.ray.io/en/latest/cluster/running-applications/job-submission/rest.html):

- ``GET /api/version`` -> ``{"version", "ray_version", "ray_commit"}``;
- ``POST /api/jobs/`` -> ``{"job_id", "submission_id"}``; a known id answers 500 "already exists" like Ray;
- ``GET /api/jobs/<id>`` -> job details (``RUNNING`` once submitted, ``STOPPED`` after a stop), 404 when unknown;
- ``POST /api/jobs/<id>/stop`` -> ``{"stopped"}``; ``GET /api/jobs/<id>/logs`` -> ``{"logs": ""}``.

With ``--trainer-port M`` it also stands in for every job's trainer on that port: ``GET /status`` ->
``{"step", "totalSteps", "phase"}`` with the step counting up every ``--step-seconds`` (10 s: a GPU-sized step) from
the start, for whichever job asks (the operator reads a ``/status`` without ``attempt`` as its current attempt's).

Run: ``python fake_ray_jobs.py --port N [--trainer-port M]`` (prints ``ready`` when listening). Not a test double of anything under
test: the operator's real ``JobSubmissionClient`` talks to it over HTTP.
"""

from __future__ import annotations

import argparse
import http.server
import json
import threading
import time

RAY_VERSION = "2.60.0"


class Jobs:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.jobs: dict[str, dict] = {}


def make_handler(jobs: Jobs):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _json(self, code: int, doc) -> None:
            body = json.dumps(doc).encode() if not isinstance(doc, bytes) else doc
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _body(self) -> dict:
            n = int(self.headers.get("Content-Length") or 0)
            return json.loads(self.rfile.read(n) or b"{}") if n else {}

        def do_GET(self) -> None:  # noqa: N802
            path = self.path.split("?")[0].rstrip("/")
            if path == "/api/version":
                self._json(200, {"version": "4", "ray_version": RAY_VERSION, "ray_commit": "fake"})
                return
            parts = path.split("/")
            if len(parts) >= 4 and parts[1:3] == ["api", "jobs"]:
                with jobs.lock:
                    job = jobs.jobs.get(parts[3])
                if job is None:
                    self._json(404, {"error": f"job {parts[3]} does not exist"})
                elif len(parts) == 5 and parts[4] == "logs":
                    self._json(200, {"logs": ""})
                else:
                    self._json(200, job)
                return
            self._json(404, {"error": "not found"})

        def do_POST(self) -> None:  # noqa: N802
            path = self.path.split("?")[0].rstrip("/")
            body = self._body()
            if path == "/api/jobs":
                sid = body.get("submission_id") or f"raysubmit_{len(jobs.jobs)}"
                with jobs.lock:
                    if sid in jobs.jobs:
                        self._json(500, {"error": f"Job with submission_id {sid} already exists."})
                        return
                    jobs.jobs[sid] = {"type": "SUBMISSION", "job_id": None, "submission_id": sid,
                                      "status": "RUNNING", "entrypoint": body.get("entrypoint", ""),
                                      "message": "Job is currently running.", "metadata": body.get("metadata") or {},
                                      "runtime_env": body.get("runtime_env") or {}, "start_time": int(time.time() * 1000),
                                      "end_time": None, "driver_info": None}
                self._json(200, {"job_id": None, "submission_id": sid})
                return
            parts = path.split("/")
            if len(parts) == 5 and parts[1:3] == ["api", "jobs"] and parts[4] == "stop":
                with jobs.lock:
                    job = jobs.jobs.get(parts[3])
                    stopped = job is not None and job["status"] in ("PENDING", "RUNNING")
                    if stopped:
                        job.update(status="STOPPED", message="Job was intentionally stopped.",
                                   end_time=int(time.time() * 1000))
                if job is None:
                    self._json(404, {"error": f"job {parts[3]} does not exist"})
                else:
                    self._json(200, {"stopped": stopped})
                return
            self._json(404, {"error": "not found"})

    return Handler


def make_trainer_handler(started: float, step_seconds: float):
    """``GET /status`` of a trainer stepping every ``step_seconds`` since ``started`` (``time.monotonic()``)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path != "/status":
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            step = int((time.monotonic() - started) / step_seconds)
            body = json.dumps({"step": step, "totalSteps": 1_000_000, "phase": "training"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--trainer-port", type=int, default=0, help="also answer GET /status here for every job's trainer")
    p.add_argument("--step-seconds", type=float, default=10.0, help="seconds per step of the stand-in trainers")
    args = p.parse_args(argv)
    if args.trainer_port:
        trainer = http.server.ThreadingHTTPServer(("127.0.0.1", args.trainer_port),
                                                  make_trainer_handler(time.monotonic(), args.step_seconds))
        trainer.daemon_threads = True
        threading.Thread(target=trainer.serve_forever, daemon=True).start()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(Jobs()))
    server.daemon_threads = True
    print("ready", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
