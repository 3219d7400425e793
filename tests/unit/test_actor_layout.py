"""Where the trainer's Ray actors go: never more GPUs than the cluster has (`grpo.actor_layout`)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from daedalus_trainer.grpo import actor_layout, check_layout_fits, local_ray_cpus


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
    # Shares Ray can pack into whole GPUs: 10 workers on 7 GPUs at 0.7 each would fit only 7 (one per GPU)
    for gpus, workers, share in ((8, 10, 1 / 2), (16, 20, 1 / 2), (4, 7, 1 / 3), (3, 2, 1.0), (9, 17, 1 / 3)):
        layout = actor_layout(gpus, workers)
        assert layout.worker["num_gpus"] == share, (gpus, workers)
        per_gpu = int(1 / share + 1e-9)
        assert workers <= per_gpu * (gpus - 1)  # every worker has a place on the GPUs the learner leaves


def test_layout_rejects_nonsense():
    with pytest.raises(ValueError, match="workers must be >= 1"):
        actor_layout(2, workers=0)
    with pytest.raises(ValueError, match="gpus must be >= 0"):
        actor_layout(-1)


def test_an_explicit_worker_count_the_cluster_cannot_hold_is_refused_before_any_actor():
    """algorithm.rolloutWorkers beyond the Ray cluster's CPUs or GPUs: refused, naming the field and the counts."""
    check_layout_fits(actor_layout(0, 3), {"CPU": 2.0})  # learner + 3 workers at 0.5 CPU: exactly 2
    with pytest.raises(ValueError, match=r"the learner and 4 rollout workers need 2.5 CPUs but the Ray cluster has "
                                         r"2: set algorithm.rolloutWorkers lower"):
        check_layout_fits(actor_layout(0, 4), {"CPU": 2.0})
    check_layout_fits(actor_layout(2, 3), {"CPU": 4.0, "GPU": 2.0})  # 1 + 3 CPUs, the workers share one GPU
    with pytest.raises(ValueError, match="need 4 CPUs but the Ray cluster has 3"):
        check_layout_fits(actor_layout(2, 3), {"CPU": 3.0, "GPU": 2.0})
    with pytest.raises(ValueError, match="need 2 GPUs but the Ray cluster has 1"):  # a layout made for more GPUs
        check_layout_fits(actor_layout(2, 1), {"CPU": 8.0, "GPU": 1.0})


def test_a_local_ray_has_room_for_an_explicit_worker_count():
    assert [local_ray_cpus(0, cpus=c) for c in (1, 2, 3, 16)] == [2, 2, 3, 4]  # the machine's, clamped to 2-4
    assert local_ray_cpus(7, cpus=16) == 8 and local_ray_cpus(1, cpus=2) == 2
    for workers in (1, 3, 7, 12):  # every CPU layout of that count fits the local Ray started for it
        check_layout_fits(actor_layout(0, workers), {"CPU": float(local_ray_cpus(workers, cpus=2))})


def test_the_trainer_takes_its_worker_count_from_the_spec_unless_told():
    from support.jobs import tiny_job_dict

    from daedalus_trainer.config import parse_job
    from daedalus_trainer.grpo import Trainer

    assert Trainer(parse_job(tiny_job_dict()), "unused").rollout_workers is None  # 0 in the spec: automatic
    job = parse_job(tiny_job_dict(algorithm={"rolloutWorkers": 3}))
    assert Trainer(job, "unused").rollout_workers == 3
    assert Trainer(job, "unused", rollout_workers=1).rollout_workers == 1
    with pytest.raises(ValueError, match="rolloutWorkers"):
        parse_job(tiny_job_dict(algorithm={"rolloutWorkers": -1}))


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
            # as many actors as the 4 GPUs can hold start (many seconds on a loaded 2-core machine: Ray worker
            # processes); once they hold them, any actor left cannot be placed (3 s to show it stays pending)
            ready, rest = ray.wait(refs, num_returns=min(len(refs), 4), timeout=60)
            if rest and len(ready) == 4:
                ready, rest = ray.wait(rest, num_returns=len(rest), timeout=3)
            for a in actors:
                ray.kill(a)
            return len(rest)

        layout = actor_layout(4)
        print("new", layout.workers, pending(layout.learner, layout.worker, layout.workers))
        print("old", 4, pending({"num_gpus": 1, "num_cpus": 1}, {"num_gpus": 1, "num_cpus": 1}, 4))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.startswith(("new ", "old ")))
    assert lines["new"] == "3 0"  # 3 rollout actors + the learner, none pending
    assert lines["old"] == "4 1"  # what the trainer asked for before: one actor never starts


def test_layouts_that_share_a_gpu_are_started_one_actor_at_a_time():
    assert actor_layout(1).shares_gpus  # the learner and the rollout worker, half a GPU each
    assert actor_layout(3, workers=4).shares_gpus  # two rollout actors per GPU
    assert not actor_layout(16).shares_gpus  # the HyperPod example: a whole GPU each
    assert not actor_layout(0).shares_gpus  # CPU: nothing to share, all start at once


def _slow_actor_class():
    """A toy actor class whose constructor takes ``seconds`` and records when it ran (wall clock: it runs in other
    processes). Made in a function so that Ray ships it by value (this test module is not importable there)."""

    class Slow:
        def __init__(self, seconds: float, fail: bool = False):
            import time

            self.began = time.time()
            time.sleep(seconds)
            if fail:
                raise RuntimeError("constructor failed")
            self.ended = time.time()

        def span(self) -> tuple[float, float]:
            return self.began, self.ended

    return Slow


def test_start_actors_in_sequence_waits_for_each_constructor(local_ray):
    """sequential=True: each actor's constructor runs only after the one before it has finished (what keeps one
    vLLM engine's memory profiling from seeing a neighbour's model load)."""
    import ray

    from daedalus_trainer.grpo import start_actors

    slow = ray.remote(_slow_actor_class()).options(num_cpus=0)
    handles = start_actors([(lambda: slow.remote(0.4), lambda a: a.span.remote())] * 3, sequential=True)
    spans = ray.get([h.span.remote() for h in handles])
    for h in handles:
        ray.kill(h)
    assert len(spans) == 3 and all(end - begin >= 0.39 for begin, end in spans)
    assert all(spans[i + 1][0] >= spans[i][1] for i in range(2)), spans


def test_start_actors_kills_the_started_ones_when_a_constructor_fails(local_ray):
    """A constructor that raises (a vLLM engine out of memory, say) fails the start with Ray's error, and the actors
    already started are killed rather than left holding their GPU share."""
    import time

    import ray
    from ray.exceptions import RayActorError

    from daedalus_trainer.grpo import start_actors

    slow = ray.remote(_slow_actor_class()).options(num_cpus=0)
    first = ray.remote(_slow_actor_class()).options(num_cpus=0, name="start-actors-first")
    with pytest.raises(RayActorError, match="constructor failed"):
        start_actors([(lambda: first.remote(0.0), lambda a: a.span.remote()),
                      (lambda: slow.remote(0.0, fail=True), lambda a: a.span.remote())], sequential=True)
    deadline = time.monotonic() + 30
    while True:  # a killed actor's name is released once Ray has torn it down
        try:
            ray.get_actor("start-actors-first")
        except ValueError:
            break
        assert time.monotonic() < deadline, "the first actor is still alive"
        time.sleep(0.1)
