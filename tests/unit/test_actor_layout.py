"""Where the trainer's Ray actors go: never more GPUs than the cluster has (`grpo.actor_layout`)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from daedalus_trainer.grpo import actor_layout


@pytest.mark.parametrize("gpus", [0, 1, 2, 3, 8, 16])
@pytest.mark.parametrize("workers", [None, 1, 2, 5, 16])
def test_layout_never_asks_for_more_gpus_than_exist(gpus, workers):
    layout = actor_layout(gpus, workers, cpus=2)
    assert layout.gpus <= gpus + 1e-9
    assert layout.workers == (workers or {0: 2, 1: 1}.get(gpus, gpus - 1))
    if gpus:
        assert layout.learner["num_gpus"] > 0 and layout.worker["num_gpus"] > 0
    else:
        assert "num_gpus" not in layout.learner and "num_gpus" not in layout.worker


def test_layout_gives_the_learner_its_own_gpu_when_there_are_several():
    layout = actor_layout(16)  # the HyperPod example: 2 workers x 8 GPUs
    assert layout.workers == 15 and layout.learner["num_gpus"] == 1 and layout.worker["num_gpus"] == 1
    assert layout.gpus == 16
    one = actor_layout(1)
    assert (one.workers, one.learner["num_gpus"], one.worker["num_gpus"]) == (1, 0.5, 0.5)
    crowded = actor_layout(3, workers=4)  # 4 rollout actors on the 2 GPUs the learner leaves
    assert crowded.worker["num_gpus"] == 0.5 and crowded.gpus == 3


def test_layout_rejects_nonsense():
    with pytest.raises(ValueError, match="workers must be >= 1"):
        actor_layout(2, workers=0)
    with pytest.raises(ValueError, match="gpus must be >= 0"):
        actor_layout(-1)


def test_ray_schedules_every_actor_of_the_layout():
    """A real Ray with 4 logical GPUs schedules the learner and every rollout actor of the default layout (the old
    layout, one actor per GPU plus the learner, leaves one pending forever). In a subprocess: the suite's own
    local Ray has no GPUs and one process holds one Ray."""
    code = textwrap.dedent("""
        import ray
        from daedalus_trainer.grpo import actor_layout

        ray.init(num_cpus=8, num_gpus=4, include_dashboard=False, log_to_driver=False)

        @ray.remote
        class Actor:
            def ping(self):
                return ray.get_gpu_ids()

        def pending(learner_opts, worker_opts, n):
            actors = [Actor.options(**learner_opts).remote()] + [Actor.options(**worker_opts).remote()
                                                                  for _ in range(n)]
            refs = [a.ping.remote() for a in actors]
            # the one actor that cannot be placed waits out the timeout; the others must all start within it, which
            # on a loaded 2-core machine can take many seconds (Ray worker processes)
            ready, rest = ray.wait(refs, num_returns=len(refs), timeout=30)
            for a in actors:
                ray.kill(a)
            return len(rest)

        layout = actor_layout(4)
        print("new", layout.workers, pending(layout.learner, layout.worker, layout.workers))
        print("old", 4, pending({"num_gpus": 1, "num_cpus": 1}, {"num_gpus": 1, "num_cpus": 1}, 4))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.startswith(("new ", "old ")))
    assert lines["new"] == "3 0"  # 3 rollout actors + the learner, none pending
    assert lines["old"] == "4 1"  # what the trainer asked for before: one actor never starts
