"""A stand-in for ``daedalus train`` speaking the trainer's contract, for operator tests against a real Ray head.

It is not the thing under test: it lets the operator's tests run real Ray jobs in seconds. It honours the same
contract as the real trainer (``daedalus_trainer.server``):

- reads the resolved config JSON (``--config``): ``metadata.name/namespace``, ``spec.algorithm.steps``,
  ``spec.checkpoint.path/intervalSteps``;
- resumes from ``<checkpoint.path>/<namespace>/<name>/latest`` (``--resume latest``);
- one "step" every ``$DAEDALUS_STANDIN_STEP_SECONDS`` (default 0.4 s); checkpoints ``step-NNNNNN/`` every
  ``intervalSteps`` and on request, written to a temporary directory, renamed, then ``latest`` replaced atomically;
- serves on ``$DAEDALUS_METRICS_PORT`` (127.0.0.1): ``GET /status`` (``{step, totalSteps, phase, latestCheckpoint
  {step, path, time}, successRatio, rewardMean, adapterPath, attempt}`` plus ``resumedFrom`` (the step of the
  checkpoint this attempt loaded, or null) and ``pid``), ``POST /checkpoint
  [?timeout=S]`` (Bearer token from ``$DAEDALUS_CONTROL_TOKEN`` or the file ``$DAEDALUS_CONTROL_TOKEN_FILE``; waits
  for the checkpoint at the next step boundary; 401 without or with a wrong token) and ``POST /stop``;
- exports ``exports/adapter/`` at the end and exits 0;
- appends ``{attempt, step, time}`` per completed step to ``steps.jsonl`` (ground truth for lost-step measurements)
  and ``{attempt, path, authorized, time}`` per ``POST`` to a control route to ``control.jsonl`` (what the operator
  asked, with or without the right token, and when).

Usage: ``python standin_trainer.py --config CONFIG.json [--resume latest|none]``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hmac
import http.server
import json
import os
import threading
import time
from pathlib import Path
from urllib.parse import parse_qs, urlsplit


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _token() -> str | None:
    tok = os.environ.get("DAEDALUS_CONTROL_TOKEN", "").strip()
    if tok:
        return tok
    path = os.environ.get("DAEDALUS_CONTROL_TOKEN_FILE", "").strip()
    if path and Path(path).exists():
        return Path(path).read_text().strip() or None
    return None


class State:
    def __init__(self, total: int, attempt: int):
        self.cond = threading.Condition()
        self.step = 0
        self.total = total
        self.attempt = attempt
        self.phase = "starting"
        self.latest: dict | None = None
        self.adapter: str | None = None
        self.requests = 0  # checkpoint requests not yet served
        self.stop = False
        self.stop_answered = threading.Event()  # the POST /stop answer is written: safe to exit
        self.resumed_from: int | None = None
        self.control_log: Path | None = None  # control.jsonl: one line per POST to /checkpoint or /stop

    def note_control(self, path: str, authorized: bool) -> None:
        if self.control_log is None:
            return
        with self.cond, open(self.control_log, "a") as f:
            f.write(json.dumps({"attempt": self.attempt, "path": path, "authorized": authorized,
                                "time": time.time()}) + "\n")

    def snapshot(self) -> dict:
        with self.cond:
            return {"step": self.step, "totalSteps": self.total, "phase": self.phase, "latestCheckpoint": self.latest,
                    "successRatio": round(min(1.0, 0.1 + self.step / max(1, self.total)), 4),
                    "rewardMean": round(self.step / max(1, self.total), 4), "adapterPath": self.adapter,
                    "attempt": self.attempt, "resumedFrom": self.resumed_from, "pid": os.getpid()}


def make_handler(state: State):
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet
            pass

        def _json(self, code: int, doc: dict) -> None:
            body = json.dumps(doc).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            if code == 401:
                self.send_header("WWW-Authenticate", "Bearer")
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802
            if urlsplit(self.path).path == "/status":
                self._json(200, state.snapshot())
            elif urlsplit(self.path).path == "/healthz":
                self._json(200, {"ok": True})
            else:
                self._json(404, {"error": "not found"})

        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            url = urlsplit(self.path)
            if url.path not in ("/checkpoint", "/stop"):
                self._json(404, {"error": "not found"})
                return
            expected = _token()
            if expected is None:
                self._json(503, {"error": "no control token configured"})
                return
            got = self.headers.get("Authorization", "")
            authorized = hmac.compare_digest(got.encode(), f"Bearer {expected}".encode())
            state.note_control(url.path, authorized)
            if not authorized:
                self._json(401, {"error": "unauthorized"})
                return
            wait = float(parse_qs(url.query).get("timeout", ["300"])[0])
            with state.cond:
                if state.phase in ("finished", "failed"):
                    self._json(409, {"error": f"trainer already {state.phase}"})
                    return
                boundary = state.step + 1  # the next step boundary
                state.requests += 1
                if url.path == "/stop":
                    state.stop = True
                state.cond.notify_all()
                ok = state.cond.wait_for(lambda: state.latest is not None and state.latest["step"] >= boundary,
                                         timeout=wait)
                latest = dict(state.latest) if state.latest else None
            if not ok:
                self._json(504, {"error": f"no checkpoint within {wait} s"})
                return
            self._json(200, dict(latest, stopping=state.stop))
            self.wfile.flush()
            if url.path == "/stop":
                state.stop_answered.set()

    return Handler


def save(root: Path, step: int, attempt: int) -> dict:
    final = root / f"step-{step:06d}"
    if not final.exists():
        tmp = root / f".tmp-step-{step:06d}-{os.getpid()}"
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "trainer_state.json").write_text(json.dumps({"step": step, "attempt": attempt, "time": _now()}))
        os.replace(tmp, final)
    pointer = root / f".latest-{os.getpid()}"
    pointer.write_text(final.name + "\n")
    os.replace(pointer, root / "latest")
    return {"step": step, "path": str(final), "time": _now()}


def load_latest(root: Path) -> tuple[int, dict | None]:
    try:
        name = (root / "latest").read_text().strip()
        state = json.loads((root / name / "trainer_state.json").read_text())
        return int(state["step"]), {"step": int(state["step"]), "path": str(root / name), "time": state.get("time")}
    except (OSError, ValueError, KeyError):
        return 0, None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--resume", default="latest")
    args = ap.parse_args(argv)
    doc = json.loads(Path(args.config).read_text())
    spec = doc["spec"]
    meta = doc["metadata"]
    root = Path(spec["checkpoint"]["path"]) / meta.get("namespace", "default") / meta["name"]
    root.mkdir(parents=True, exist_ok=True)
    total = int(spec["algorithm"]["steps"])
    interval = int(spec["checkpoint"]["intervalSteps"])
    attempt = int(os.environ.get("DAEDALUS_ATTEMPT", "0") or 0)
    step_seconds = float(os.environ.get("DAEDALUS_STANDIN_STEP_SECONDS", "0.4"))
    port = int(os.environ.get("DAEDALUS_METRICS_PORT", "9400"))

    state = State(total, attempt)
    state.control_log = root / "control.jsonl"
    if args.resume == "latest":
        state.step, state.latest = load_latest(root)
        state.resumed_from = state.step if state.latest else None
    http.server.ThreadingHTTPServer.allow_reuse_address = True
    deadline = time.monotonic() + 15
    while True:
        try:
            server = http.server.ThreadingHTTPServer(("127.0.0.1", port), make_handler(state))
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"stand-in trainer attempt {attempt}: resuming at step {state.step}/{total}, port {port}", flush=True)
    with state.cond:
        state.phase = "training"
    log = open(root / "steps.jsonl", "a")
    while True:
        with state.cond:
            if state.step >= total:
                break
        time.sleep(step_seconds)
        with state.cond:
            state.step += 1
            step = state.step
            log.write(json.dumps({"attempt": attempt, "step": step, "time": time.time()}) + "\n")
            log.flush()
            if state.requests or state.stop or step % interval == 0 or step == total:
                state.phase = "checkpointing"
        if step % interval == 0 or step == total or state.requests or state.stop:
            info = save(root, step, attempt)
            with state.cond:
                state.latest = info
                state.requests = 0
                state.phase = "training"
                state.cond.notify_all()
                stopping = state.stop
                if stopping:
                    state.phase = "finished"
            if stopping:
                state.stop_answered.wait(5)  # let the caller read its answer before the process exits
                print(f"stopping at step {step} after the checkpoint", flush=True)
                server.shutdown()
                return 0
    adapter = root / "exports" / "adapter"
    adapter.mkdir(parents=True, exist_ok=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"r": spec["lora"]["rank"], "peft_type": "LORA"}))
    with state.cond:
        state.adapter = str(adapter)
        state.phase = "finished"
        state.cond.notify_all()
    print(f"finished {total} steps; adapter at {adapter}", flush=True)
    time.sleep(float(os.environ.get("DAEDALUS_STANDIN_LINGER_SECONDS", "0")))
    server.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
