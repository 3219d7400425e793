"""The vLLM rollout path: engine choice, the vLLM engine's adapter files, the spec rule, the recorded engine.

No GPU and no vLLM here, so the vLLM path runs on ``tests/support/fake_vllm/vllm``: a small stand-in for vLLM's
offline API that serves the real tiny Qwen3-VL checkpoint with transformers and reads each adapter directory with real
peft when a request first uses it. What it cannot show is how real vLLM behaves (its kernels, its memory accounting,
its adapter loader): that path has not yet run on a real GPU. The stand-in is put on ``sys.path`` only by the
``fake_vllm`` fixture of this module, and taken off (with its modules) afterwards.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import celpy
import pytest
import torch
import yaml
from support.tiny_model import make_tiny_job, tiny_checkpoint  # noqa: F401

from daedalus_trainer import config as c
from daedalus_trainer import crd
from daedalus_trainer.actors import (
    VLLM_SHARE_FRACTION,
    EngineProbe,
    RolloutEngineUnavailable,
    RolloutWorker,
    load_training_policy,
    resolve_rollout_engine,
    vllm_import_error,
)
from daedalus_trainer.checkpoint import pack_tensors
from daedalus_trainer.envs import maze_from_seed
from daedalus_trainer.policy import TokenSequence, adapter_config_dict, load_pretrained, lora_config

FAKE_VLLM = Path(__file__).resolve().parents[1] / "support" / "fake_vllm"
ROOT = Path(__file__).resolve().parents[2]
NO_VLLM = "ModuleNotFoundError: No module named 'vllm'"


@pytest.fixture
def fake_vllm(monkeypatch):
    """The stand-in ``vllm`` importable for one test; afterwards neither its path nor its modules are left."""
    assert vllm_import_error() is not None, "a real vllm is installed: these tests are written for a machine without"
    monkeypatch.syspath_prepend(str(FAKE_VLLM))
    yield
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]


def _perturbed_state(policy, seed: int) -> dict[str, torch.Tensor]:
    """The policy's adapter with its ``lora_B`` (zero at peft's init) set to random values: an adapter that changes
    the model's outputs, so serving the wrong one shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return policy.adapter_state()


# ------------------------------------------------------------------------------------------------- engine choice
CUDA_VLLM = EngineProbe(cuda=True, vllm_error=None)
CHOICES = [
    # (requested, gpu share, probe, topP, engine)
    ("auto", 0.5, CUDA_VLLM, 1.0, "vllm"),
    ("auto", 0.0, CUDA_VLLM, 1.0, "transformers"),  # a GPU node, but Ray gave this actor no GPU
    ("auto", 0.5, EngineProbe(cuda=False, vllm_error="not tried: no CUDA GPU"), 1.0, "transformers"),
    ("auto", 0.5, EngineProbe(cuda=True, vllm_error=NO_VLLM), 1.0, "transformers"),
    ("auto", 0.5, CUDA_VLLM, 0.9, "transformers"),  # vLLM's log-probs with top-p < 1 are not the policy's
    ("transformers", 1.0, CUDA_VLLM, 1.0, "transformers"),
    ("vllm", 0.25, CUDA_VLLM, 1.0, "vllm"),
]


@pytest.mark.parametrize("requested,share,probe,top_p,engine", CHOICES)
def test_engine_resolution(requested, share, probe, top_p, engine):
    got, reason = resolve_rollout_engine(requested, share, probe, top_p)
    assert got == engine
    assert reason.startswith("auto: " if requested == "auto" else "algorithm.rolloutEngine is ")


UNAVAILABLE = [
    # (gpu share, probe, what the message must name, what it must not)
    (0.5, EngineProbe(False, "not tried: no CUDA GPU"), ["no CUDA GPU is visible"], ["no GPU share", "vLLM is not"]),
    (0.0, CUDA_VLLM, ["holds no GPU share"], ["no CUDA GPU", "vLLM is not"]),
    (0.5, EngineProbe(True, NO_VLLM), [f"vLLM is not installed or does not import ({NO_VLLM}"],
     ["no CUDA GPU", "no GPU share"]),
    (0.0, EngineProbe(False, "not tried: no CUDA GPU"), ["no CUDA GPU is visible", "holds no GPU share"], []),
]


@pytest.mark.parametrize("share,probe,named,not_named", UNAVAILABLE)
def test_explicit_vllm_where_it_cannot_run_says_why(share, probe, named, not_named):
    with pytest.raises(RolloutEngineUnavailable) as info:
        resolve_rollout_engine("vllm", share, probe)
    message = str(info.value)
    assert message.startswith("algorithm.rolloutEngine is vllm but this rollout worker cannot run vLLM: ")
    assert message.endswith("Run on GPU workers with the trainer image, or set rolloutEngine to auto or transformers")
    for fragment in named:
        assert fragment in message
    for fragment in not_named:
        assert fragment not in message
    with pytest.raises(ValueError, match="unknown rollout engine 'tgi'"):
        resolve_rollout_engine("tgi", 1.0, CUDA_VLLM)


def test_the_import_probe_sees_an_importable_vllm(fake_vllm):
    assert vllm_import_error() is None


def test_the_import_probe_names_a_missing_vllm():
    assert vllm_import_error() == NO_VLLM


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU machine's answer")
def test_a_rollout_worker_asked_for_vllm_on_this_cpu_machine_fails_at_build(tmp_path, caplog):
    """The real probe of this process (no CUDA GPU), through the actor's constructor: the error comes before any model
    is loaded (nothing is built in the work directory)."""
    job = make_tiny_job(algorithm={"rolloutEngine": "vllm"})
    with pytest.raises(RolloutEngineUnavailable, match="no CUDA GPU is visible to the rollout worker; the rollout "
                                                       "worker holds no GPU share"):
        RolloutWorker(job, None, str(tmp_path))
    assert list(tmp_path.iterdir()) == []
    with caplog.at_level(logging.INFO, logger="daedalus.actors"):
        worker = RolloutWorker(make_tiny_job(), None, str(tmp_path))  # auto
    assert worker.rollout_engine == "transformers" and worker.engine_name() == "transformers"
    assert type(worker.engine).__name__ == "TransformersEngine"
    assert ["rollout worker: transformers engine (auto: no CUDA GPU is visible to the rollout worker; the rollout "
            "worker holds no GPU share (Ray num_gpus 0: the cluster has no GPU for it))"] == [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("rollout worker:")]


# ------------------------------------------------------------------------------------------- the vLLM engine itself
def test_vllm_engine_writes_loadable_adapters_and_keeps_two_versions(fake_vllm, tiny_checkpoint, tmp_path):  # noqa: F811
    from peft import PeftConfig, PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file

    from daedalus_trainer.rollout.engine import SamplingParams
    from daedalus_trainer.rollout.vllm_engine import VLLMEngine

    job = make_tiny_job(tiny_checkpoint)
    learner = load_pretrained(tiny_checkpoint, "float32", "cpu")
    learner.add_lora(job.spec.lora)
    config = adapter_config_dict(lora_config(job.spec.lora, base_model_name_or_path=str(tiny_checkpoint)))
    engine = VLLMEngine(tiny_checkpoint, adapter_config=config, dtype="float32", gpu_memory_utilization=0.45,
                        adapter_dir=tmp_path / "adapters")
    assert engine.max_lora_rank == 8 and engine.llm.kwargs["max_lora_rank"] == 8  # the adapter's rank
    assert engine.llm.kwargs["gpu_memory_utilization"] == 0.45 and engine.llm.kwargs["enable_lora"] is True
    maze = maze_from_seed(7, 3)
    from daedalus_trainer.envs import render_rgb
    from daedalus_trainer.prompts import PromptSettings, build_conversation

    messages, images = build_conversation([{"image": render_rgb(maze, maze.start, 16), "ascii": "", "feedback": ""}],
                                          [], PromptSettings())
    states = []
    for version in range(4):
        states.append(_perturbed_state(learner, seed=version))
        engine.load_adapter(states[-1], version)
        gen, = engine.generate([messages], [images], SamplingParams(1.0, 1.0, 4, seed=version))  # vLLM reads it now
        assert len(gen.token_ids) == len(gen.logprobs) > 0
    # every version was read from its own directory when first used; only the last two are left on disk
    assert [p for _, p in engine.llm.loaded_adapters] == [str(tmp_path / "adapters" / f"v{v}") for v in range(4)]
    assert [p.name for p in engine.version_dirs()] == ["v2", "v3"]
    assert engine.adapter_path == tmp_path / "adapters" / "v3" and engine.adapter_version == 3
    latest = engine.adapter_path
    assert json.loads((latest / "adapter_config.json").read_text()) == json.loads(json.dumps(config))
    assert PeftConfig.from_pretrained(str(latest)).r == 8
    saved = load_file(str(latest / "adapter_model.safetensors"))
    assert saved.keys() == states[3].keys() and all(torch.equal(saved[k], states[3][k]) for k in saved)
    # peft loads the written directory onto the base model, with exactly the published weights
    base = load_pretrained(tiny_checkpoint, "float32", "cpu")
    peft_model = PeftModel.from_pretrained(base.model, str(latest))
    loaded = get_peft_model_state_dict(peft_model)
    assert all(torch.equal(loaded[k], states[3][k]) for k in states[3])
    # a directory the engine did not write is served where it is and never deleted
    own = learner.save_adapter(tmp_path / "sft-adapter")
    engine.load_adapter(own, 4)
    engine.load_adapter(states[0], 5)
    assert [p.name for p in engine.version_dirs()] == ["v5"] and (own / "adapter_config.json").is_file()


def test_vllm_max_lora_rank_is_rounded_up_to_what_vllm_accepts():
    from daedalus_trainer.rollout.vllm_engine import vllm_max_lora_rank

    assert [vllm_max_lora_rank(r) for r in (1, 2, 8, 9, 16, 17, 64, 300, 512)] == [1, 8, 8, 16, 16, 32, 64, 320, 512]
    for bad in (0, 513):
        with pytest.raises(ValueError, match=f"LoRA rank {bad} cannot be served by vLLM"):
            vllm_max_lora_rank(bad)


def test_the_served_rank_covers_a_rank_pattern():
    """A PEFT adapter whose ``rank_pattern`` gives some modules a larger rank than ``r`` needs vLLM buffers of that
    larger rank: the config PEFT itself writes for such an adapter is read."""
    from peft import LoraConfig

    from daedalus_trainer.policy import adapter_config_dict
    from daedalus_trainer.rollout.vllm_engine import adapter_max_rank

    plain = adapter_config_dict(LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))
    patterned = adapter_config_dict(LoraConfig(r=16, target_modules=["q_proj", "v_proj"], rank_pattern={"v_proj": 48}))
    assert adapter_max_rank(plain) == 16
    assert adapter_max_rank(patterned) == 48


def test_a_rollout_worker_on_vllm_samples_with_the_published_adapter(fake_vllm, tmp_path):
    """The worker's vLLM path end to end on the stand-in: ``auto`` picks vLLM where CUDA, a GPU share and vLLM are
    there; the worker serves the tiny base with 0.9 of its share; the adapter the learner publishes (tensors only)
    is the one sampled from: the behaviour log-probs recorded per turn are the learner's own for the same tokens
    (and not the base model's), which is what GRPO's importance ratio needs. Up to one known term: vLLM's processed
    log-probs include the logit bias that keeps vision tokens out, so they are the learner's renormalised over the
    other tokens, ``log p - log(1 - m)`` with ``m`` the policy's mass on the vision tokens (about 1% for the random
    tiny model, 0.01 nats; negligible for a trained model, which puts ~0 mass there)."""
    job = make_tiny_job(algorithm={"groupSize": 2, "mazesPerStep": 1, "maxTokensPerTurn": 8},
                        environment={"maxTurns": 2})
    work = tmp_path / "work"
    worker = RolloutWorker(job.model_dump(by_alias=True, mode="json"), None, str(work), gpu_share=0.5,
                           probe=CUDA_VLLM)
    assert worker.rollout_engine == "vllm" and type(worker.engine).__name__ == "VLLMEngine"
    kwargs = worker.engine.llm.kwargs
    assert kwargs["gpu_memory_utilization"] == pytest.approx(VLLM_SHARE_FRACTION * 0.5)
    assert kwargs["max_lora_rank"] == 8 and kwargs["model"] == str(work / "tiny-base")
    learner = load_training_policy(job, None, str(work), seed=job.spec.algorithm.seed)
    assert worker.engine._adapter_config == adapter_config_dict(learner.model.peft_config["default"])

    mazes = [maze_from_seed(7, 5)] * 2
    for version in range(3):
        state = _perturbed_state(learner, seed=10 + version)
        trajectories = worker.rollout(mazes, 7, pack_tensors(state), version)
    assert [p.name for p in worker.engine.version_dirs()] == ["v1", "v2"]
    assert all(t.adapter_version == 2 for t in trajectories)
    turns = [turn for t in trajectories for turn in t.turns]
    assert turns and all(len(turn.logprobs) == len(turn.completion_ids) > 0 for turn in turns)
    learner.model.eval()
    with torch.no_grad():
        for turn in turns:
            seq = TokenSequence(turn.prompt_ids, turn.completion_ids, turn.images)
            batch = learner.collate([seq])
            recorded = torch.tensor(turn.logprobs)
            own = learner.response_logprobs(batch)[0][batch.assistant_mask[0].bool()]
            logits, _, _ = learner._assistant_logits(batch, 1.0)  # [N, V]
            vision_mass = torch.softmax(logits, dim=-1)[:, learner.suppressed_token_ids].sum(-1)  # [N]
            assert torch.allclose(recorded, own - torch.log1p(-vision_mass), atol=1e-4), (recorded, own)
            assert bool((vision_mass > 0).all()) and bool((vision_mass < 0.05).all())
            with learner.reference():  # the base model: the adapter changes these log-probs
                base = learner.response_logprobs(batch)[0][batch.assistant_mask[0].bool()]
            assert not torch.allclose(recorded, base, atol=1e-2)


# ------------------------------------------------------------------------------------------------------ the spec rule
def _cel(rule: c.CelRule, obj: dict) -> bool:
    env = celpy.Environment()
    target = obj
    for part in rule.path.split("."):
        target = target[part]
    return bool(env.program(env.compile(rule.rule)).evaluate({"self": celpy.json_to_cel(target)}))


@pytest.mark.parametrize("engine,top_p,ok", [
    ("vllm", 0.9, False), ("vllm", 1, True), ("vllm", 1.0, True), ("transformers", 0.9, True), ("auto", 0.9, True),
])
def test_vllm_with_top_p_below_one_is_refused_by_pydantic_and_by_cel(engine, top_p, ok):
    schema = yaml.safe_load((ROOT / "crds" / "rltrainingjob.yaml").read_text())
    schema = schema["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    doc = yaml.safe_load((ROOT / "examples" / "local-tiny.yaml").read_text())
    doc["spec"]["algorithm"].update({"rolloutEngine": engine, "topP": top_p})
    rule = next(r for r in c.CEL_RULES if "rolloutEngine" in r.rule)
    assert _cel(rule, crd.apply_defaults(schema, doc)) is ok
    if ok:
        assert c.parse_job(doc).spec.algorithm.rollout_engine == engine
        return
    with pytest.raises(c.SpecError) as info:
        c.parse_job(doc)
    assert [p for p, _ in info.value.errors] == ["spec.algorithm.topP"]
    assert "algorithm.rolloutEngine vllm needs algorithm.topP 1" in info.value.errors[0][1]


def test_rollout_engine_field_default_and_enum():
    schema = yaml.safe_load((ROOT / "crds" / "rltrainingjob.yaml").read_text())
    field = schema["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "algorithm"]["properties"]["rolloutEngine"]
    assert field["enum"] == ["auto", "transformers", "vllm"] and field["default"] == "auto"
    assert c.AlgorithmSpec().rollout_engine == "auto"
    doc = yaml.safe_load((ROOT / "examples" / "local-tiny.yaml").read_text())
    doc["spec"]["algorithm"]["rolloutEngine"] = "tgi"
    with pytest.raises(c.SpecError) as info:
        c.parse_job(doc)
    assert [p for p, _ in info.value.errors] == ["spec.algorithm.rolloutEngine"]


# ---------------------------------------------------------------------------------------- what a run records (Ray)
@pytest.mark.slow
def test_explicit_vllm_fails_before_any_step_on_a_machine_without_a_gpu(local_ray, tmp_path):
    """The rollout worker refuses ``rolloutEngine: vllm`` without a CUDA GPU, and the run ends before any step is
    checkpointed. (What engine a run records in its checkpoints: test_grpo_run.py, on its uninterrupted run.)"""
    import ray
    from support.jobs import tiny_job_dict

    from daedalus_trainer.grpo import RESUMABLE_ALGORITHM_FIELDS, Trainer, run_identity

    small = {"steps": 1, "groupSize": 2, "mazesPerStep": 1, "maxTokensPerTurn": 6}
    job = c.parse_job(tiny_job_dict(algorithm=small, environment={"maxTurns": 2}))
    # the field is not part of the run's identity: a checkpoint continues under another engine
    assert "rolloutEngine" in RESUMABLE_ALGORITHM_FIELDS and "algorithm.rolloutEngine" not in run_identity(job, None)

    explicit = c.parse_job(tiny_job_dict(algorithm={**small, "rolloutEngine": "vllm"}, environment={"maxTurns": 2}))
    with pytest.raises(ray.exceptions.RayActorError, match="no CUDA GPU is visible to the rollout worker") as info:
        Trainer(explicit, tmp_path / "vllm", rollout_workers=1, final_eval=False).train("none")
    assert "RolloutEngineUnavailable" in str(info.value)
    assert not (tmp_path / "vllm" / "checkpoints").exists() or not any((tmp_path / "vllm" / "checkpoints").glob(
        "step-*"))
