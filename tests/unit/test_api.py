"""The RLTrainingJob API: pydantic models, the generated CRD, the examples, and the CEL rules.

Real parts: the checked-in CRD YAML, jsonschema validation against its openAPIV3Schema, and the CEL rules evaluated by
a CEL interpreter (cel-python) on objects defaulted the way the API server defaults them.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import celpy
import jsonschema
import pytest
import yaml

from daedalus_trainer import config as c
from daedalus_trainer import crd

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


@pytest.fixture(scope="module")
def schema() -> dict:
    doc = yaml.safe_load((ROOT / "crds" / "rltrainingjob.yaml").read_text())
    return doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _cel_eval(rule: c.CelRule, obj: dict) -> bool:
    env = celpy.Environment()
    target = obj
    for part in rule.path.split("."):
        target = target[part]
    program = env.program(env.compile(rule.rule))
    return bool(program.evaluate({"self": celpy.json_to_cel(target)}))


def _invalid_reasons(schema: dict, obj: dict) -> list[str]:
    validator = jsonschema.Draft4Validator(schema)
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]


def test_checked_in_crd_matches_generator():
    assert (ROOT / "crds" / "rltrainingjob.yaml").read_text() == crd.render()


def test_daedalus_crd_prints_the_same_bytes():
    out = subprocess.run([sys.executable, "-m", "daedalus_trainer", "crd"], capture_output=True, text=True, check=True)
    assert out.stdout == (ROOT / "crds" / "rltrainingjob.yaml").read_text()


def test_crd_shape():
    body = crd.crd()
    spec = body["spec"]
    assert body["metadata"]["name"] == "rltrainingjobs.daedalus.dev"
    assert spec["names"]["shortNames"] == ["rltj"]
    assert "all" in spec["names"]["categories"]
    version = spec["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = {col["name"]: col["jsonPath"] for col in version["additionalPrinterColumns"]}
    assert columns == {
        "Phase": ".status.phase", "Step": ".status.currentStep", "Total": ".status.totalSteps",
        "Success": ".status.metrics.successRate", "Restarts": ".status.restarts", "Age": ".metadata.creationTimestamp",
    }


def _walk(node, path=""):
    yield path, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, f"{path}/{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, f"{path}/{i}")


def test_schema_is_structural(schema):
    """No JSON-schema constructs that a structural schema forbids; every property has a type and a description. The
    one exception apiextensions allows: `x-kubernetes-int-or-string` with `anyOf: [integer, string]` and no type
    (the pod quantities)."""
    int_or_string = []
    for path, node in _walk(schema):
        if isinstance(node, dict):
            if node.get("x-kubernetes-int-or-string"):
                assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}] and "type" not in node, path
                int_or_string.append(path.rsplit("/", 1)[-1])
            else:
                assert "anyOf" not in node, path
            assert "$ref" not in node and "const" not in node, path
            if path.endswith(("/properties/spec", "/properties/status")) or "/properties/spec/properties/" in path:
                if "/properties/" in path and not path.endswith("/items") and "x-kubernetes-validations" not in path:
                    if path.split("/")[-2] == "properties":
                        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"{path} has no type"
                        assert node.get("description"), f"{path} has no description"
    assert int_or_string == ["cpu", "memory", "cpu", "memory", "shmSize"]  # head, then the worker group


def test_defaults_match_pydantic(schema):
    """The API server's defaults (structural defaulting) produce the same spec as the trainer's pydantic defaults."""
    minimal = {"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": "x"}, "spec": {"model": {"tiny": True}}}
    defaulted = crd.apply_defaults(schema, minimal)
    from_pydantic = c.parse_job(minimal).to_manifest()["spec"]
    assert defaulted["spec"] == from_pydantic


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate(schema, path):
    obj = yaml.safe_load(path.read_text())
    assert _invalid_reasons(schema, obj) == []
    c.parse_job(obj)
    defaulted = crd.apply_defaults(schema, obj)
    for rule in c.CEL_RULES:
        assert _cel_eval(rule, defaulted), rule.rule


def _local() -> dict:
    return yaml.safe_load((ROOT / "examples" / "local-tiny.yaml").read_text())


def _set(obj: dict, dotted: str, value) -> dict:
    obj = copy.deepcopy(obj)
    node = obj
    parts = dotted.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value
    return obj


INVALID = [
    # (change, field path in the error, reason fragment, rejected by the CRD schema, by CEL or by both)
    ("spec.environment.size", 8, "spec.environment.size", "odd", "cel"),
    # a vision-tower name is outside the schema's enum and fails the CEL rule that says why
    ("spec.lora.targetModules", ["q_proj", "attn.qkv"], "spec.lora.targetModules", "vision", "both"),
    ("spec.lora.targetModules", ["visual.blocks.0.mlp.linear_fc1"], "spec.lora.targetModules", "vision", "both"),
    # any other name that is not one of the seven language-model projections: a typo, the LM head, a dotted suffix
    ("spec.lora.targetModules", ["q_proj", "q_projj"], "spec.lora.targetModules",
     "'q_projj' is not a language-model projection of Qwen3-VL (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
     "down_proj); did you mean 'q_proj'?", "schema"),
    ("spec.lora.targetModules", ["lm_head", "self_attn.q_proj"], "spec.lora.targetModules",
     "'lm_head', 'self_attn.q_proj' are not language-model projections of Qwen3-VL", "schema"),
    # pod resources must be positive quantities
    ("spec.cluster.head.cpu", "-2", "spec.cluster.head.cpu", "greater than zero (a Ray pod's resources); got '-2'",
     "schema"),
    ("spec.cluster.head.memory", "0", "spec.cluster.head.memory", "greater than zero (a Ray pod's resources); got '0'",
     "schema"),
    ("spec.cluster.head.memory", "0.0Gi", "spec.cluster.head.memory", "greater than zero", "schema"),
    ("spec.algorithm.steps", -3, "spec.algorithm.steps", "greater than or equal to 1", "schema"),
    ("spec.algorithm.groupSize", 1, "spec.algorithm.groupSize", "greater than or equal to 2", "schema"),
    ("spec.environment.actionFormat", "json", "spec.environment.actionFormat", "'function'", "schema"),
    # the Ray pods are built to one of the two Pod Security levels; `privileged` is not one of them
    ("spec.cluster.podSecurity", "privileged", "spec.cluster.podSecurity", "'restricted' or 'baseline'", "schema"),
    ("spec.model.tiny", False, "spec.cluster.workerGroups", "gpusPerWorker", "cel"),
    # Held-out sets that leave too few training layouts: size 5 has 4 layouts, size 7 192 (at most 96 held out).
    ("spec.environment.size", 5, "spec.environment.evalMazes", "size 5 has too few layouts", "cel"),
    ("spec.environment.evalMazes", 97, "spec.environment.evalMazes", "at most 96 at size 7", "cel"),
    # A quoted number is a string to the API server: integer fields are strict (pydantic would coerce "11").
    ("spec.environment.size", "11", "spec.environment.size", "valid integer", "schema"),
    ("spec.algorithm.steps", 30.5, "spec.algorithm.steps", "valid integer", "schema"),
    ("spec.sft.onPolicyFraction", 1.5, "spec.sft.onPolicyFraction", "less than or equal to 1", "schema"),
    # the example's 8 mazes per step do not split into 3 mini-batches of whole groups
    ("spec.algorithm.miniBatches", 3, "spec.algorithm.miniBatches", "must divide algorithm.mazesPerStep", "cel"),
    # seeds fit the integers torch takes: evalSeed 1e14 passed and crashed the last evaluation of a run
    ("spec.algorithm.seed", 2**31, "spec.algorithm.seed", "less than or equal to 2147483647", "schema"),
    ("spec.environment.evalSeed", 10**14, "spec.environment.evalSeed", "less than or equal to 2147483647", "schema"),
    ("spec.sft.seed", 2**64, "spec.sft.seed", "less than or equal to 2147483647", "schema"),
    # YAML's .inf / .nan (JSON, and so kubectl, cannot carry them: "json"): an infinite alpha made every weight NaN
    ("spec.lora.alpha", float("inf"), "spec.lora.alpha", "finite number", "json"),
    ("spec.algorithm.maxGradNorm", float("nan"), "spec.algorithm.maxGradNorm", "finite number", "json"),
]


@pytest.mark.parametrize("dotted,value,path,fragment,where", INVALID, ids=[f"{d}={v}" for d, v, *_ in INVALID])
def test_invalid_specs_rejected_with_field_path(schema, dotted, value, path, fragment, where):
    obj = _set(_local(), dotted, value)
    with pytest.raises(c.SpecError) as info:
        c.parse_job(obj)
    paths = [p for p, _ in info.value.errors]
    assert path in paths, info.value.errors
    assert any(fragment in m for p, m in info.value.errors if p == path), info.value.errors
    # The API server rejects the same object: by the schema, or by a CEL rule.
    defaulted = crd.apply_defaults(schema, obj)
    schema_errors = _invalid_reasons(schema, defaulted)
    if where in ("schema", "both"):
        assert schema_errors, "the CRD schema should reject this"
    else:
        assert not schema_errors
    if where in ("cel", "both"):
        assert not all(_cel_eval(rule, defaulted) for rule in c.CEL_RULES)


def test_quantities_must_be_positive_in_both_validators(schema):
    """Pod resources: the CRD's pattern and the Python validator accept and refuse the same quantities. An unquoted
    whole number is a quantity too (IntOrString, as in pod resources and KubeRay's CRD): `cpu: 8` is "8"."""
    for value, ok in [("500m", True), ("0.5", True), (".5", True), ("1e3", True), ("+2", True), ("16Gi", True),
                      ("0", False), ("-2", False), ("0m", False), ("00.000", False), ("-1Gi", False),
                      (8, True), (0, False), (-2, False)]:
        groups = copy.deepcopy(_local()["spec"]["cluster"]["workerGroups"])
        groups[0]["shmSize"] = value
        obj = _set(_local(), "spec.cluster.workerGroups", groups)
        defaulted = crd.apply_defaults(schema, obj)
        assert (not _invalid_reasons(schema, defaulted)) is ok, value
        if ok:
            assert c.parse_job(obj).spec.cluster.worker_groups[0].shm_size == str(value)
            continue
        with pytest.raises(c.SpecError) as info:
            c.parse_job(obj)
        assert info.value.errors == [("spec.cluster.workerGroups[0].shmSize",
                                      f"must be a quantity greater than zero (a Ray pod's resources); "
                                      f"got {str(value)!r}")]
    # a fraction or a boolean unquoted is neither an integer nor a string: both refuse it
    for value, said in [(0.5, "(got the number 0.5: quote it)"), (True, "(got the boolean true: quote it")]:
        obj = _set(_local(), "spec.cluster.head.cpu", value)
        assert _invalid_reasons(schema, crd.apply_defaults(schema, obj)), value
        with pytest.raises(c.SpecError) as info:
            c.parse_job(obj)
        assert [p for p, _ in info.value.errors] == ["spec.cluster.head.cpu"] and said in info.value.errors[0][1]


def test_every_language_model_projection_is_a_target(schema):
    obj = _set(_local(), "spec.lora.targetModules", list(c.LANGUAGE_MODEL_PROJECTIONS))
    assert _invalid_reasons(schema, crd.apply_defaults(schema, obj)) == []
    assert c.parse_job(obj).spec.lora.target_modules == list(c.LANGUAGE_MODEL_PROJECTIONS)
    items = _schema_at(schema["properties"]["spec"], "lora.targetModules")["items"]
    assert items["enum"] == list(c.LANGUAGE_MODEL_PROJECTIONS)


METADATA_INVALID = [
    # (metadata, field path, the message, or a fragment of it)
    ({"name": "local-tiny", "namespace": "Bad_NS"}, "metadata.namespace",
     "must be a lowercase DNS label: a-z, 0-9 and '-', starting and ending with a letter or digit (RFC 1123); "
     "got 'Bad_NS'"),
    # the namespace is a directory of local runs' checkpoints: no way out of checkpoint.path
    ({"name": "local-tiny", "namespace": "../../escape"}, "metadata.namespace", "got '../../escape'"),
    ({"name": "local-tiny", "namespace": "n" * 64}, "metadata.namespace", f"at most 63 characters (got '{'n' * 64}'"),
    # KubeRay requires the job's RayCluster name, "<name>-ray", to be a DNS-1035 label
    ({"name": "2024-maze"}, "metadata.name",
     "must be a lowercase DNS label that starts with a letter: a-z, 0-9 and '-', starting with a letter and ending "
     "with a letter or digit (RFC 1035: it begins the name of the job's RayCluster, which KubeRay requires to be "
     "one); got '2024-maze'"),
    ({"name": "a" * 64}, "metadata.name",
     f"String should have at most 63 characters (got '{'a' * 64}', 64 characters)"),
    ({"name": "x", "labels": {"a": 1}}, "metadata.labels",
     "the value of 'a' must be a string; got the number 1 (quote it)"),
    ({"name": "x", "labels": {"a": True}}, "metadata.labels", "got the boolean true (quote it)"),
    ({"name": "x", "labels": {"a": None}}, "metadata.labels", "the value of 'a' is empty"),
    ({"name": "x", "labels": {"bad key": "v"}}, "metadata.labels", "'bad key' is not a valid key"),
    ({"name": "x", "labels": {"Example.com/a": "v"}}, "metadata.labels", "its prefix 'Example.com' must be"),
    ({"name": "x", "labels": {"a/b/c": "v"}}, "metadata.labels", "'a/b/c' is not a valid key"),
    ({"name": "x", "labels": {"k" * 64: "v"}}, "metadata.labels", "is not a valid key"),
    ({"name": "x", "labels": {"a": "not valid!"}}, "metadata.labels",
     "the value 'not valid!' of 'a' is not a valid label"),
    ({"name": "x", "labels": {"a": "v" * 64}}, "metadata.labels",
     "is not a valid label value (at most 63 characters"),
    ({"name": "x", "annotations": {"a": 5}}, "metadata.annotations",
     "the value of 'a' must be a string; got the number 5"),
    ({"name": "x", "annotations": {"-a": "v"}}, "metadata.annotations", "'-a' is not a valid key"),
    ({"name": "x", "annotations": {"a": "v" * 262_144}}, "metadata.annotations",
     "the API server allows at most 262144"),
]


@pytest.mark.parametrize("metadata,path,message", METADATA_INVALID, ids=[m for _, m, _ in METADATA_INVALID])
def test_metadata_is_checked_as_the_api_server_checks_it(metadata, path, message):
    """Names and namespaces are RFC 1123 DNS labels (Kubernetes "Object Names and IDs"); label keys and values, and
    annotation keys, follow Kubernetes label syntax; label and annotation values are strings."""
    with pytest.raises(c.SpecError) as info:
        c.parse_job(_set(_local(), "metadata", metadata))
    assert [p for p, _ in info.value.errors] == [path], info.value.errors
    assert message in info.value.errors[0][1], info.value.errors


@pytest.mark.parametrize("field", ["spec.model.path", "spec.model.sftAdapter", "spec.checkpoint.path"])
def test_an_empty_path_is_refused_not_taken_for_the_working_directory(schema, field):
    obj = _set(_local(), field, "")
    assert _invalid_reasons(schema, crd.apply_defaults(schema, obj)) != []  # the API server's schema: minLength 1
    with pytest.raises(c.SpecError) as info:
        c.parse_job(obj)
    assert [p for p, _ in info.value.errors] == [field], info.value.errors
    assert "at least 1 character" in info.value.errors[0][1]


@pytest.mark.parametrize("name,ok", [("2024-maze", False), ("maze-2024", True), ("a", True), ("9", False)])
def test_the_crd_refuses_a_job_name_that_starts_with_a_digit(schema, name, ok):
    """The root CEL rule (the API server's twin of the pydantic pattern) on metadata.name."""
    rule = schema["x-kubernetes-validations"]
    assert [r["rule"] for r in rule] == [c.JOB_NAME_CEL]
    env = celpy.Environment()
    obj = _set(_local(), "metadata.name", name)
    assert bool(env.program(env.compile(c.JOB_NAME_CEL)).evaluate({"self": celpy.json_to_cel(obj)})) is ok
    if ok:
        assert c.parse_job(obj).metadata.name == name
    else:
        with pytest.raises(c.SpecError, match="starts with a letter"):
            c.parse_job(obj)


def test_valid_metadata_passes_and_each_label_problem_is_an_error():
    meta = {"name": "x", "namespace": "ml-training",
            "labels": {"app.kubernetes.io/name": "daedalus", "team": "", "x_y.Z": "A-b_c.1", "k" * 63: "v" * 63},
            "annotations": {"daedalus.dev/serving-lora-uri": "s3://bucket/adapters", "note": "free text: any!"}}
    job = c.parse_job(_set(_local(), "metadata", meta))
    assert job.metadata.namespace == "ml-training" and job.metadata.labels["team"] == ""
    assert job.to_manifest()["metadata"]["labels"] == meta["labels"]
    assert "labels" not in c.parse_job(_local()).to_manifest()["metadata"]  # none written when none given
    with pytest.raises(c.SpecError) as info:
        c.parse_job(_set(_local(), "metadata", {"name": "x", "labels": {"a": 1, "b c": "d"}}))
    assert [p for p, _ in info.value.errors] == ["metadata.labels", "metadata.labels"]


def test_kind_api_version_name_and_spec_are_required():
    """What kubectl requires of every document ("apiVersion not set", "kind not set", a name), every command
    requires: no default name under which two unnamed jobs would share their files."""
    obj = _local()
    del obj["apiVersion"], obj["kind"]
    with pytest.raises(c.SpecError) as info:
        c.parse_job(obj)
    errors = dict(info.value.errors)
    assert set(errors) == {"kind", "apiVersion"}
    assert "kind not set" in errors["kind"] and "apiVersion not set" in errors["apiVersion"]

    for metadata, fragment in [(None, "required (metadata is empty): the API server rejects an object without a"),
                               ({}, "required: the API server rejects an object without a name"),
                               ({"namespace": "ml"}, "required: the API server rejects"),
                               ({"name": None}, "required: the API server rejects"),
                               ("absent", "required: the API server rejects")]:
        obj = _local()
        if metadata == "absent":
            del obj["metadata"]
        else:
            obj["metadata"] = metadata
        with pytest.raises(c.SpecError) as info:
            c.parse_job(obj)
        assert info.value.errors == [("metadata.name", info.value.errors[0][1])], info.value.errors
        assert fragment in info.value.errors[0][1] and "defaults" not in info.value.errors[0][1]

    obj = _set(_local(), "spec", None)
    with pytest.raises(c.SpecError) as info:
        c.parse_job(obj)
    assert info.value.errors == [("spec", "must be a mapping: the job's desired state (model, algorithm, environment, "
                                          "...); got an empty value")]
    # a nested section left empty is defaulted, as the API server defaults it (its null is pruned first)
    assert c.parse_job(_set(_local(), "spec.checkpoint", None)).spec.checkpoint == c.CheckpointSpec()
    # with both spec and metadata missing, both are named (and nothing about the spec's defaults)
    obj = _local()
    del obj["spec"], obj["metadata"]
    with pytest.raises(c.SpecError) as info:
        c.parse_job(obj)
    assert [p for p, _ in info.value.errors] == ["spec", "metadata.name"]


def test_every_error_is_reported_at_once():
    obj = _set(_set(_set(_local(), "spec.environment.size", 8), "spec.algorithm.steps", -1),
               "spec.lora.targetModules", ["qkv"])
    with pytest.raises(c.SpecError) as info:
        c.parse_job(obj)
    assert {p for p, _ in info.value.errors} == {
        "spec.environment.size", "spec.algorithm.steps", "spec.lora.targetModules"}


def test_wrong_api_version_is_one_error_that_names_both_versions():
    with pytest.raises(c.SpecError) as info:
        c.parse_job(_set(_local(), "apiVersion", "daedalus.dev/v1"))
    assert info.value.errors == [("apiVersion", "expected 'daedalus.dev/v1alpha1', got 'daedalus.dev/v1'")]


def test_unknown_field_is_an_error():
    with pytest.raises(c.SpecError) as info:
        c.parse_job(_set(_local(), "spec.algorithm.groupSzie", 4))
    assert ("spec.algorithm.groupSzie", "unknown field (did you mean 'groupSize'?)") in info.value.errors


def test_a_null_the_crd_does_not_allow_is_dropped_and_defaulted_as_the_api_server_does(schema):
    """`podSecurity:` with no value (YAML null) is read as left out, so it is defaulted ("restricted"), as the API
    server prunes a non-nullable null before defaulting (tests/cluster/test_dry_run.py checks that on the real
    server); a field the CRD makes nullable keeps its null; the manifest passed in is not modified."""
    base = _local()
    text = yaml.safe_dump(base).replace("  cluster:\n", "  cluster:\n    podSecurity:\n", 1)
    job = _set(yaml.safe_load(text), "spec.algorithm.klCoef", None)
    job = _set(job, "spec.cluster.workerGroups", [dict(base["spec"]["cluster"]["workerGroups"][0], shmSize=None)])
    assert job["spec"]["cluster"]["podSecurity"] is None and job["spec"]["algorithm"]["klCoef"] is None
    sent = copy.deepcopy(job)
    parsed = c.parse_job(job)
    assert job == sent
    assert parsed.spec.cluster.pod_security == "restricted" and parsed.spec.algorithm.kl_coef == 0
    assert parsed.model_dump() == c.parse_job(_set(base, "spec.cluster.workerGroups", [
        {k: v for k, v in base["spec"]["cluster"]["workerGroups"][0].items() if k != "shmSize"}])).model_dump()
    # the same pruning as the checked-in CRD's schema gives
    assert crd.prune_nulls(sent, schema) == crd.prune_nulls(sent)
    # nullable in the CRD (an optional path): the null stays, and means "none"
    assert schema["properties"]["spec"]["properties"]["model"]["properties"]["sftAdapter"]["nullable"] is True
    kept = crd.prune_nulls(_set(base, "spec.model.sftAdapter", None))
    assert "sftAdapter" in kept["spec"]["model"] and kept["spec"]["model"]["sftAdapter"] is None
    assert c.parse_job(_set(base, "spec.model.sftAdapter", None)).spec.model.sft_adapter is None
    # a null list item is not dropped (nor by the API server): an error that says what is wrong
    with pytest.raises(c.SpecError) as info:
        c.parse_job(_set(base, "spec.cluster.workerGroups", [None]))
    assert info.value.errors == [("spec.cluster.workerGroups[0]", "must be a mapping of fields; got an empty value "
                                                                  "(a list item with nothing after its '-'?)")]
    # a wrong type is still an error, and a null under an unknown field is still an unknown field
    with pytest.raises(c.SpecError) as info:
        c.parse_job(_set(base, "spec.cluster.podSecurity", 3))
    assert [p for p, _ in info.value.errors] == ["spec.cluster.podSecurity"]
    with pytest.raises(c.SpecError) as info:
        c.parse_job(_set(base, "spec.cluster.podSecurty", None))
    assert [p for p, _ in info.value.errors] == ["spec.cluster.podSecurty"]


def test_validate_cli_reports_paths(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(_set(_local(), "spec.environment.size", 10)))
    out = subprocess.run([sys.executable, "-m", "daedalus_trainer", "validate", str(bad)], capture_output=True, text=True)
    assert out.returncode == 1
    assert "spec.environment.size" in out.stdout and "odd" in out.stdout
    ok = subprocess.run([sys.executable, "-m", "daedalus_trainer", "validate", str(EXAMPLES[0])],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_validate_reads_standard_input():
    """`kubectl get rltj -A -o yaml | daedalus validate -`: a List from standard input, each item checked and named."""
    items = [_local(), _set(_set(_local(), "metadata.name", "other"), "spec.environment.size", 10)]
    text = yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": items})
    out = subprocess.run([sys.executable, "-m", "daedalus_trainer", "validate", "-"], input=text, capture_output=True,
                         text=True)
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "✓ <stdin> (RLTrainingJob document 1 of 2): RLTrainingJob 'local-tiny' is valid"
    assert lines[1] == "✗ <stdin> (RLTrainingJob document 2 of 2): 1 error(s)"
    assert "spec.environment.size" in lines[2]


def test_validate_standard_input_that_is_not_utf8_or_is_closed_is_one_error_line():
    """Bytes that are not UTF-8 are the same error as in a file, whatever the locale (under C or C.UTF-8 Python's
    stdin let them through as surrogates, and YAML said "unacceptable character #xdcff"); a closed standard input is
    an error line, not an AttributeError traceback."""
    env = {**os.environ, "LC_ALL": "C"}
    cmd = [sys.executable, "-m", "daedalus_trainer", "validate", "-"]
    out = subprocess.run(cmd, input=b"kind: RLTrainingJob\nx: \xff\xfe\n", capture_output=True, env=env)
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stdout.decode().splitlines()[1:] == ["    (file): is not UTF-8 text: expected a YAML or JSON file"]
    closed = subprocess.run(["sh", "-c", 'exec "$@" <&-', "sh", *cmd], capture_output=True, text=True, env=env)
    assert closed.returncode == 1 and not closed.stderr, closed.stdout + closed.stderr
    assert closed.stdout.splitlines() == ["✗ <stdin>: 1 error(s)",
                                          "    (file): cannot be read: standard input is closed"]


def test_validate_refuses_standard_input_twice():
    out = subprocess.run([sys.executable, "-m", "daedalus_trainer", "validate", "-", "-"], input="kind: x\n",
                         capture_output=True, text=True)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == "error: - (standard input) is given more than once; it can be read only once"


def test_validate_cli_checks_every_document_and_prints_messages_literally(tmp_path):
    """A later broken document is not hidden by a valid first one; a missing name is reported as the API server
    would; a list in a message keeps its brackets (rich markup is escaped)."""
    nameless = _local()
    del nameless["metadata"]
    badname = _set(_local(), "metadata.name", "-bad-")
    vision = _set(_local(), "spec.lora.targetModules", ["visual.qkv"])
    f = tmp_path / "jobs.yaml"
    f.write_text(yaml.safe_dump_all([_local(), nameless, badname, vision]))
    out = subprocess.run([sys.executable, "-m", "daedalus_trainer", "validate", str(f)], capture_output=True, text=True)
    assert out.returncode == 1
    assert "document 1 of 4): RLTrainingJob 'local-tiny' is valid" in out.stdout
    assert "document 2 of 4): 1 error(s)" in out.stdout and "metadata.name: required" in out.stdout
    assert "lowercase DNS label" in out.stdout and "got '-bad-'" in out.stdout
    assert "['visual.qkv']" in out.stdout, out.stdout


def test_malformed_yaml_is_a_spec_error(tmp_path):
    f = tmp_path / "x.yaml"
    f.write_text("spec: [unclosed\n")
    with pytest.raises(c.SpecError) as info:
        c.load_job(f)
    assert info.value.errors == [("(syntax)", "line 2, column 1: expected ',' or ']', but got '<stream end>' (while "
                                  "parsing a flow sequence from line 1, column 7)")]
    f.write_text("spec:\n  a: 1\x00\n")  # a character YAML refuses: PyYAML names a position, not a line
    with pytest.raises(c.SpecError) as info:
        c.load_job(f)
    assert info.value.errors == [("(syntax)", "character 13 of the file: special characters are not allowed "
                                              "(#x0000)")]


# ------------------------------------------------------------------------------------------------ spec edits mid-run
def _transition_violations(schema: dict, old: dict, new: dict, path: str = "") -> list[str]:
    """Evaluate every CEL transition rule (one that reads ``oldSelf``) of the CRD schema on an update from ``old`` to
    ``new``, as the API server does: at each object property present in both, ``self`` is the new value and
    ``oldSelf`` the old one. Returns the messages of the rules that fail."""
    out = []
    env = celpy.Environment()
    for v in schema.get("x-kubernetes-validations", []):
        if "oldSelf" in v["rule"]:
            program = env.program(env.compile(v["rule"]))
            if not bool(program.evaluate({"self": celpy.json_to_cel(new), "oldSelf": celpy.json_to_cel(old)})):
                out.append(f"{path or '.'}: {v['message']}")
    for key, sub in (schema.get("properties") or {}).items():
        if isinstance(old, dict) and isinstance(new, dict) and key in old and key in new:
            out += _transition_violations(sub, old[key], new[key], f"{path}.{key}")
    return out


def _edit(doc: dict, dotted: str, value) -> dict:
    new = copy.deepcopy(doc)
    node = new
    *parents, leaf = dotted.split(".")
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    node[leaf] = value
    return new


@pytest.mark.parametrize("dotted, value, refused", [
    ("spec.cluster.workerGroups.0.replicas", 2, True),      # the RayCluster is never updated: Recovering forever
    ("spec.algorithm.steps", 96, True),                      # the running trainer keeps its 48
    ("spec.algorithm.learningRate", 0.001, True),
    ("spec.model.name", "other", True),
    ("spec.lora.rank", 8, True),
    ("spec.environment.size", 9, True),
    ("spec.checkpoint.intervalSteps", 10, True),
    ("spec.cluster.image", "registry/other:1", True),
    ("spec.suspend", True, False),                           # documented as mutable
    ("spec.resilience.maxRestarts", 20, False),
    ("spec.resilience.progressDeadlineSeconds", 7200, False),
    ("spec.serving.enabled", True, False),
])
def test_spec_edits_a_running_job_cannot_take_are_refused_by_the_api_server(schema, dotted, value, refused):
    """The generated CRD's CEL transition rules (cel-python, evaluated as the API server does on update) refuse edits
    of the sections a running job was built from, and let through the documented mutable ones."""
    import yaml as _yaml

    doc = crd.apply_defaults(schema, _yaml.safe_load((ROOT / "examples" / "local-tiny.yaml").read_text()))
    assert _transition_violations(schema, doc, doc) == []
    violations = _transition_violations(schema, doc, _edit(doc, dotted, value))
    if refused:
        section = dotted.split(".")[1]
        assert violations and all(f"spec.{section} is immutable" in v for v in violations), violations
    else:
        assert violations == []


def _schema_at(schema: dict, dotted: str) -> dict:
    node = schema
    for part in dotted.split("."):
        node = node["properties"][part]
    return node


def test_what_cel_rules_iterate_or_search_is_bounded(schema):
    """The API server prices every rule by the largest input the schema allows (per-rule budget 1e6 cost units;
    an unbounded list is priced at ~1e6 items, an unbounded string at ~3e6 characters) and refuses the whole CRD when
    a rule is over budget. So every list a rule iterates (exists/all/filter) has maxItems, and every string it searches
    (contains/matches/startsWith/endsWith) has maxLength. cel-python does not price rules; this is the structural
    half of that check, for the rule shapes used here."""
    import re

    checked = 0
    for rule in c.CEL_RULES:
        base = rule.path.removeprefix("spec").lstrip(".")
        for field, var in re.findall(r"self\.([A-Za-z.]+)\.(?:exists|all|filter|exists_one)\((\w+),", rule.rule):
            node = _schema_at(schema["properties"]["spec"], f"{base}.{field}" if base else field)
            assert node["type"] == "array" and "maxItems" in node, (rule.rule, field)
            if re.search(rf"\b{var}\.(contains|matches|startsWith|endsWith)\(", rule.rule):
                assert "maxLength" in node["items"], (rule.rule, field)
            checked += 1
    assert checked >= 3  # targetModules, workerGroups (twice)
    # and the bounds are what the pydantic models enforce, so `daedalus validate` rejects the same objects
    with pytest.raises(c.SpecError):
        c.parse_job(_set(_local(), "spec.lora.targetModules", [f"m{i}" for i in range(65)]))
    with pytest.raises(c.SpecError):
        c.parse_job(_set(_local(), "spec.lora.targetModules", ["q" * 129]))


def test_objects_read_back_from_the_api_server_validate(tmp_path):
    """What `kubectl get rltj -A -o yaml` prints: a List of jobs with server metadata and the operator's status (its
    phase a plain string). Each item is validated like a manifest; the status is read as JSON, and a status the
    operator could not have written is still named."""
    job = _local()
    job["metadata"].update(namespace="ml", uid="u1", resourceVersion="12", generation=2,
                           creationTimestamp="2026-12-01T00:00:00Z", finalizers=["daedalus.dev/finalizer"],
                           managedFields=[{"manager": "kubectl-client-side-apply", "operation": "Update"}])
    job["status"] = {"phase": "Running", "currentStep": 3, "conditions": []}
    bad = copy.deepcopy(job)
    bad["metadata"]["name"] = "other"
    bad["spec"]["environment"]["size"] = 5
    (tmp_path / "jobs.yaml").write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": [job, bad]}))
    docs = c.load_documents(tmp_path / "jobs.yaml")
    assert [d["metadata"]["name"] for d in docs] == ["local-tiny", "other"]
    parsed = c.parse_job(docs[0])
    assert parsed.status.phase == c.Phase.RUNNING and parsed.status.current_step == 3
    with pytest.raises(c.SpecError) as info:
        c.parse_job(docs[1])
    assert [p for p, _ in info.value.errors] == ["spec.environment.evalMazes"]
    job["status"]["phase"] = "Bogus"
    with pytest.raises(c.SpecError) as info:
        c.parse_job(job)
    assert [p for p, _ in info.value.errors] == ["status.phase"]
