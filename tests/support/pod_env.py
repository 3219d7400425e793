"""Entrypoint prefix for the Ray jobs of the operator tests: ``python pod_env.py DIR -- COMMAND...``.

On a cluster the Ray job's entrypoint inherits the head container's environment (the control token among it, from
the job's Secret by ``env.valueFrom.secretKeyRef``) with the submission's ``runtime_env.env_vars`` on top. The tests
share one local Ray head between pods, so the fake kubelet (``fake_kuberay.FakeKubeRay``) writes each head
container's resolved environment to ``DIR/<namespace>/<job>.json`` and this prefix adds it, without overriding what
the Ray job already has, before it execs COMMAND. The job is found from ``$DAEDALUS_NAMESPACE`` / ``$DAEDALUS_JOB``
(the operator's ``env_vars``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    folder, sep, *command = argv
    if sep != "--" or not command:
        raise SystemExit("usage: pod_env.py DIR -- COMMAND...")
    path = Path(folder) / os.environ.get("DAEDALUS_NAMESPACE", "") / f"{os.environ.get('DAEDALUS_JOB', '')}.json"
    if path.exists():
        for key, value in json.loads(path.read_text()).items():
            os.environ.setdefault(key, value)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
