"""The GRPO learner on a real tiny Qwen3-VL (random weights): one step over real rollouts, once and twice per batch.

Rewards are assigned by hand (the random policy never reaches a goal) so that every group has mixed outcomes: the
learner, not the environment, is under test.
"""

from __future__ import annotations

import math

import pytest
import torch
from support.tiny_model import make_tiny_job, tiny_checkpoint  # noqa: F401

from daedalus_trainer.actors import Learner
from daedalus_trainer.envs import maze_from_seed
from daedalus_trainer.grpo import step_advantages
from daedalus_trainer.rollout import SamplingParams, TransformersEngine, run_episodes

GROUP = 4


def _rollouts(learner: Learner, job):
    """2 groups of 4 short episodes sampled from the learner's own policy, rewards 1 for the first two of a group."""
    engine = TransformersEngine(learner.policy)
    mazes = [maze_from_seed(7, s) for s in (1, 2) for _ in range(GROUP)]
    with torch.no_grad():
        trajs = run_episodes(engine, mazes, job.spec.environment, SamplingParams(1.0, 1.0, 6), seed=11)
    for i, t in enumerate(trajs):
        t.reward = 1.0 if i % GROUP < 2 else 0.0
    return trajs


def _mean_logprob(learner: Learner, trajs, which) -> float:
    """Mean log-prob (temperature 1) of the sampled tokens of the episodes ``which`` selects."""
    seqs = [turn.sequence() for i, t in enumerate(trajs) if which(i) for turn in t.turns]
    batch = learner.policy.collate(seqs)
    with torch.no_grad():
        lp = learner.policy.response_logprobs(batch, 1.0)
    return float((lp * batch.assistant_mask).sum() / batch.assistant_mask.sum())


@pytest.mark.parametrize("iterations", [1, 2])
def test_update_raises_rewarded_and_lowers_unrewarded_episodes(tiny_checkpoint, iterations):  # noqa: F811
    job = make_tiny_job(tiny_checkpoint, algorithm={"learningRate": 0.01, "iterationsPerStep": iterations},
                        environment={"maxTurns": 3})
    learner = Learner(job, None, str(tiny_checkpoint.parent))
    trajs = _rollouts(learner, job)
    good_before = _mean_logprob(learner, trajs, lambda i: i % GROUP < 2)
    bad_before = _mean_logprob(learner, trajs, lambda i: i % GROUP >= 2)

    stats = learner.update(trajs, GROUP)

    assert not stats.skipped and stats.updates == iterations and stats.zero_variance_groups == 0
    assert stats.sequences == sum(len(t.turns) for t in trajs)
    if iterations == 1:
        # on-policy: the ratio is exactly 1, nothing is clipped
        assert stats.clip_fraction == 0.0
    good_after = _mean_logprob(learner, trajs, lambda i: i % GROUP < 2)
    bad_after = _mean_logprob(learner, trajs, lambda i: i % GROUP >= 2)
    assert good_after > good_before and bad_after < bad_before


def test_lora_dropout_leaves_the_on_policy_ratio_at_one(tiny_checkpoint):  # noqa: F811
    """The learner scores tokens as the engine sampled them (dropout off): with lora.dropout 0.5 the first
    iteration's ratio is still exactly 1 (nothing clipped) and two learners on the same batch end bit-identical."""
    job = make_tiny_job(tiny_checkpoint, algorithm={"learningRate": 0.01}, environment={"maxTurns": 3},
                        lora={"dropout": 0.5})
    states = []
    for seed in (1, 2):
        learner = Learner(job, None, str(tiny_checkpoint.parent))
        trajs = _rollouts(learner, job)
        torch.manual_seed(seed)  # a dropout mask would differ between the two learners
        stats = learner.update(trajs, GROUP)
        assert not stats.skipped and stats.clip_fraction == 0.0
        states.append(learner.adapter_state())
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_token_mean_scale_does_not_depend_on_the_kl_term(tiny_checkpoint):  # noqa: F811
    """token-mean with a zero-variance group in the batch: a KL term (here one that is 0, the adapter starting at
    B = 0) must not change the policy-gradient scale, i.e. the denominator counts the same tokens either way."""
    norms = {}
    for kl in (0.0, 1e-9):
        job = make_tiny_job(tiny_checkpoint, algorithm={"lossAggregation": "token-mean", "klCoef": kl},
                            environment={"maxTurns": 3})
        learner = Learner(job, None, str(tiny_checkpoint.parent))
        trajs = _rollouts(learner, job)
        for i, t in enumerate(trajs):
            t.reward = float(i < 2)  # group 0 mixed (1, 1, 0, 0), group 1 all 0
        stats = learner.update(trajs, GROUP)
        assert stats.zero_variance_groups == 1 and not stats.skipped
        norms[kl] = stats.grad_norm
    assert norms[1e-9] == pytest.approx(norms[0.0], rel=1e-5)


def test_kl_reference_of_an_sft_adapter_start_is_that_adapter(tiny_checkpoint, tmp_path, caplog):  # noqa: F811
    """Start = a PEFT SFT adapter (trained further by GRPO): the KL term's reference is that adapter, frozen, so
    before any update the KL is 0, while the base model (what disabling the adapter gives) is measurably far away;
    the lora section that does not apply is reported."""
    from daedalus_trainer.policy import load_pretrained

    sft = load_pretrained(tiny_checkpoint, "float32", "cpu")
    sft.add_lora(make_tiny_job(tiny_checkpoint).spec.lora)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in sft.model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    sft.model.save_pretrained(str(tmp_path / "sft-adapter"))

    job = make_tiny_job(tiny_checkpoint, algorithm={"klCoef": 0.1}, environment={"maxTurns": 3},
                        lora={"rank": 4})
    with caplog.at_level("WARNING", logger="daedalus.policy"):
        learner = Learner(job, str(tmp_path / "sft-adapter"), str(tiny_checkpoint.parent))
    assert any("lora.rank 4 -> 8" in r.getMessage() for r in caplog.records)
    trajs = _rollouts(learner, job)
    seqs = [turn.sequence() for t in trajs for turn in t.turns]
    batch = learner.policy.collate(seqs)
    with torch.no_grad():
        current = learner.policy.response_logprobs(batch, 1.0)
        reference = learner.policy.reference_logprobs(batch, 1.0)
        with learner.policy.model.disable_adapter():
            base = learner.policy.response_logprobs(batch, 1.0)
    mask = batch.assistant_mask.bool()
    assert torch.equal(current[mask], reference[mask])
    assert float((current - base)[mask].abs().max()) > 1e-2
    stats = learner.update(trajs, GROUP)
    assert stats.kl is not None and stats.kl < 1e-9
    # only the trained adapter's weights are in the optimizer and in what the engines load
    assert all("reference" not in k for k in learner.adapter_state())
    assert sum(p.numel() for p in learner.params) == sum(v.numel() for v in learner.adapter_state().values())


def test_second_iteration_moves_further_than_one(tiny_checkpoint):  # noqa: F811
    moved = {}
    for iterations in (1, 2):
        job = make_tiny_job(tiny_checkpoint, algorithm={"learningRate": 0.01, "iterationsPerStep": iterations},
                            environment={"maxTurns": 3})
        learner = Learner(job, None, str(tiny_checkpoint.parent))
        trajs = _rollouts(learner, job)
        before = _mean_logprob(learner, trajs, lambda i: i % GROUP < 2)
        learner.update(trajs, GROUP)
        moved[iterations] = _mean_logprob(learner, trajs, lambda i: i % GROUP < 2) - before
    assert moved[2] > moved[1] > 0


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean"])
def test_mini_batches_equal_one_update_per_group_in_turn(tiny_checkpoint, aggregation):  # noqa: F811
    """miniBatches 2 over 2 groups = two plain updates, one on each group, in order: the same AdamW steps, the
    second off-policy (scored against the behaviour log-probs recorded at sampling time), so the same adapter."""
    algorithm = {"learningRate": 0.01, "lossAggregation": aggregation}
    job = make_tiny_job(tiny_checkpoint, algorithm={**algorithm, "mazesPerStep": 2, "miniBatches": 2},
                        environment={"maxTurns": 3})
    split = Learner(job, None, str(tiny_checkpoint.parent))
    trajs = _rollouts(split, job)
    stats = split.update(trajs, GROUP)
    assert stats.updates == 2 and not stats.skipped
    assert stats.sequences == sum(len(t.turns) for t in trajs)

    plain = make_tiny_job(tiny_checkpoint, algorithm={**algorithm, "mazesPerStep": 1},
                          environment={"maxTurns": 3})
    in_turn = Learner(plain, None, str(tiny_checkpoint.parent))
    first = in_turn.update(trajs[:GROUP], GROUP)
    second = in_turn.update(trajs[GROUP:], GROUP)
    assert first.updates == second.updates == 1
    # each mini-batch's loss is the mean over its own episodes (the gradient norm sees the scale; AdamW does not)
    assert stats.grad_norm == pytest.approx((first.grad_norm + second.grad_norm) / 2, rel=1e-5)
    assert stats.loss == pytest.approx((first.loss + second.loss) / 2, rel=1e-5, abs=1e-9)
    a, b = split.adapter_state(), in_turn.adapter_state()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-7)
    # and not what miniBatches 1 gives: one step over both groups
    whole = Learner(make_tiny_job(tiny_checkpoint, algorithm={**algorithm, "mazesPerStep": 2},
                                  environment={"maxTurns": 3}), None, str(tiny_checkpoint.parent))
    assert whole.update(trajs, GROUP).updates == 1
    c = whole.adapter_state()
    assert max(float((a[k] - c[k]).abs().max()) for k in a) > 1e-4


def test_a_mini_batch_without_signal_makes_no_step(tiny_checkpoint):  # noqa: F811
    """Group 0 mixed, group 1 all failures: with miniBatches 2 only the first mini-batch steps, and the adapter is
    the one a plain update on group 0 alone gives (AdamW with a zero gradient would still move it)."""
    job = make_tiny_job(tiny_checkpoint, algorithm={"learningRate": 0.01, "mazesPerStep": 2, "miniBatches": 2},
                        environment={"maxTurns": 3})
    split = Learner(job, None, str(tiny_checkpoint.parent))
    trajs = _rollouts(split, job)
    for t in trajs[GROUP:]:
        t.reward = 0.0
    stats = split.update(trajs, GROUP)
    assert stats.updates == 1 and stats.zero_variance_groups == 1 and not stats.skipped
    alone = Learner(make_tiny_job(tiny_checkpoint, algorithm={"learningRate": 0.01, "mazesPerStep": 1},
                                  environment={"maxTurns": 3}), None, str(tiny_checkpoint.parent))
    alone.update(trajs[:GROUP], GROUP)
    a, b = split.adapter_state(), alone.adapter_state()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-7)


def test_groups_that_do_not_split_into_the_mini_batches_are_refused(tiny_checkpoint):  # noqa: F811
    job = make_tiny_job(tiny_checkpoint, algorithm={"mazesPerStep": 2, "miniBatches": 2}, environment={"maxTurns": 3})
    learner = Learner(job, None, str(tiny_checkpoint.parent))
    trajs = _rollouts(learner, job)
    with pytest.raises(ValueError, match="do not split into 2 mini-batches"):
        learner.update(trajs[:6], 2)  # 3 groups of 2


def test_all_equal_rewards_skip_the_update(tiny_checkpoint):  # noqa: F811
    job = make_tiny_job(tiny_checkpoint, algorithm={"iterationsPerStep": 3}, environment={"maxTurns": 2})
    learner = Learner(job, None, str(tiny_checkpoint.parent))
    trajs = _rollouts(learner, job)
    for t in trajs:
        t.reward = 0.0
    before = learner.adapter_state()
    stats = learner.update(trajs, GROUP)
    assert stats.skipped and stats.updates == 0 and stats.zero_variance_groups == 2
    after = learner.adapter_state()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_step_advantages_give_signal_where_every_episode_succeeded(tiny_checkpoint):  # noqa: F811
    """GiGPO's step groups (``stepAdvantageWeight`` > 0) train on groups that plain GRPO skips as zero-variance."""
    job = make_tiny_job(tiny_checkpoint, algorithm={"stepAdvantageWeight": 1.0, "stepDiscount": 0.5},
                        environment={"maxTurns": 3})
    learner = Learner(job, None, str(tiny_checkpoint.parent))
    trajs = _rollouts(learner, job)
    for t in trajs:  # every episode "succeeds" on its last turn
        t.reward = 1.0
        t.turns[-1].reward = 1.0
    # the anchor state of each turn is the agent's cell before it: the start, then wherever the moves led
    for t in trajs:
        assert t.turns[0].state == tuple(t.maze.start)
        for prev, nxt in zip(t.turns, t.turns[1:]):
            assert (nxt.state != prev.state) == prev.feedback.startswith("Moved"), (prev.feedback, prev.state)
    expect = step_advantages([[u.state for u in t.turns] for t in trajs], [[u.reward for u in t.turns] for t in trajs],
                             GROUP, 0.5)
    assert any(v != 0.0 for row in expect for v in row)  # cells revisited at different distances from the reward

    plain = make_tiny_job(tiny_checkpoint, environment={"maxTurns": 3})
    grpo = Learner(plain, None, str(tiny_checkpoint.parent))
    assert grpo.update(trajs, GROUP).skipped  # plain GRPO: both groups all-success, nothing to learn

    before = learner.adapter_state()
    stats = learner.update(trajs, GROUP)
    assert not stats.skipped and stats.updates == 1 and stats.zero_variance_groups == 2
    assert stats.sequences == sum(len(t.turns) for t, row in zip(trajs, expect) if any(row))
    after = learner.adapter_state()
    assert any(not torch.equal(before[k], after[k]) for k in before)

    trajs[0].turns[-1].reward = 0.0  # the episode says 1.0, its turns now 0.0: two rewards, which one to train on?
    with pytest.raises(ValueError, match="sum of its turns' rewards"):
        learner.update(trajs, GROUP)


def test_packed_adapter_publication_loads_the_same_weights(tiny_checkpoint):  # noqa: F811
    """The adapter as the trainer publishes it through Ray (byte views, read-only on arrival) makes a rollout worker
    play exactly the episodes it plays with the adapter's tensors."""
    from daedalus_trainer.actors import RolloutWorker

    job = make_tiny_job(tiny_checkpoint, algorithm={"learningRate": 0.01}, environment={"maxTurns": 3})
    learner = Learner(job, None, str(tiny_checkpoint.parent))
    learner.update(_rollouts(learner, job), GROUP)  # a non-zero LoRA B, so that loading it matters
    packed = learner.adapter_state(packed=True)
    for p in packed.values():
        p.data.setflags(write=False)
    mazes = [maze_from_seed(7, s) for s in (3, 4)]
    plain = RolloutWorker(job, None, str(tiny_checkpoint.parent)).rollout(mazes, 5, learner.adapter_state(), 1)
    worker = RolloutWorker(job, None, str(tiny_checkpoint.parent))
    got = worker.rollout(mazes, 5, packed, 1)
    assert [[t.completion_ids for t in e.turns] for e in got] == [[t.completion_ids for t in e.turns] for e in plain]
    state = worker.engine.policy.adapter_state()
    assert all(torch.equal(state[k], v) for k, v in learner.adapter_state().items())


def test_cosine_schedule_sets_the_learning_rate_of_each_step(tiny_checkpoint):  # noqa: F811
    """With ``lrSchedule: cosine`` the update of step ``s`` runs AdamW at that step's rate: step 1 at the full rate,
    the last step at a sliver of it, which moves the adapter correspondingly less than a constant rate does."""
    moved = {}
    for schedule, step in (("constant", 10), ("cosine", 1), ("cosine", 10)):
        job = make_tiny_job(tiny_checkpoint, algorithm={"learningRate": 0.01, "steps": 10, "lrSchedule": schedule},
                            environment={"maxTurns": 3})
        learner = Learner(job, None, str(tiny_checkpoint.parent))
        trajs = _rollouts(learner, job)
        before = learner.adapter_state()
        stats = learner.update(trajs, GROUP, step)
        after = learner.adapter_state()
        moved[schedule, step] = max(float((after[k] - before[k]).abs().max()) for k in before)
        assert stats.learning_rate == pytest.approx(0.01 if (schedule, step) != ("cosine", 10)
                                                    else 0.01 * (1 + math.cos(math.pi * 9 / 10)) / 2)
        assert learner.optimizer.param_groups[0]["lr"] == stats.learning_rate
    # AdamW's first step moves each weight by about lr: the cosine's last step (lr 2.4e-4) moves it ~40x less
    assert moved["cosine", 1] == pytest.approx(moved["constant", 10], rel=1e-6)
    assert moved["cosine", 10] < moved["constant", 10] / 20
