"""Generate the RLTrainingJob CustomResourceDefinition from the pydantic models in :mod:`daedalus_trainer.config`.

`crds/rltrainingjob.yaml` and `charts/daedalus/crds/rltrainingjob.yaml` are this module's output (`make crds`); a test
fails when they differ from it. Never edit them by hand.

The pydantic JSON schema (draft 2020-12) is turned into a Kubernetes *structural* OpenAPI v3 schema
(apiextensions.k8s.io/v1, "Specifying a structural schema"): `$ref`s inlined, `anyOf [X, null]` turned into
`nullable: true`, `const` into a one-value `enum`, numeric `exclusiveMinimum: x` into `minimum: x` +
`exclusiveMinimum: true`, titles dropped, and every default filled in from a default-constructed job so that the API
server applies the same defaults as the trainer. Cross-field rules become `x-kubernetes-validations` (CEL), and the
spec sections a running job cannot take a change of get the CEL transition rule `self == oldSelf` (`IMMUTABLE_SECTIONS`).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import yaml

from daedalus_trainer import config as c

_DROP = {"title", "discriminator"}

#: Spec sections fixed once the job exists: the operator builds the RayCluster from them once and never updates it,
#: and a running trainer never rereads its config (a later attempt would silently train something else). An edit is
#: refused by the API server (CEL transition rule, Kubernetes 1.29+). Mutable: ``suspend``, ``resilience`` (read by
#: the operator on every reconcile) and ``serving`` (used after the training succeeded).
IMMUTABLE_SECTIONS = ("model", "lora", "algorithm", "environment", "sft", "checkpoint", "cluster")
IMMUTABLE_MESSAGE = ("is immutable once the job exists (a running trainer and its RayCluster cannot take the change): "
                     "delete the job and create it again; with the same name it resumes from its latest checkpoint "
                     "(a changed lora section cannot: use a new name, or move the job's checkpoints directory aside)")


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    """Inline `$ref`s and translate JSON-schema constructs into their structural-schema equivalents."""
    if isinstance(node, list):
        return [_resolve(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].split("/")[-1]])
        extra = {k: v for k, v in node.items() if k != "$ref"}
        target.update(extra)  # a field's own description/default win over the class's
        return _resolve(target, defs)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP or key == "$defs":
            continue
        out[key] = _resolve(value, defs)
    if "anyOf" in out:
        options = [o for o in out["anyOf"] if o.get("type") != "null"]
        nullable = len(options) != len(out["anyOf"])
        if len(options) == 1:
            del out["anyOf"]
            merged = dict(options[0])
            merged.update(out)
            out = merged
            if nullable:
                out["nullable"] = True
    if isinstance(out.get("description"), str):
        out["description"] = " ".join(out["description"].split())
    if "const" in out:
        out["enum"] = [out.pop("const")]
    for bound, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if bound in out and not isinstance(out[bound], bool):
            out[plain] = out.pop(bound)
            out[bound] = True
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    if "default" in out and out["default"] is None:
        del out["default"]  # a null default would be written into every object
    if out.get("type") == "object" and "properties" in out:
        out.pop("additionalProperties", None)
    if out.get("x-kubernetes-int-or-string"):
        # A quantity (config.PositiveQuantity): the structural form of IntOrString (apiextensions: the one anyOf with
        # types allowed).
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return out


def _fill_defaults(schema: dict[str, Any], value: Any) -> None:
    """Set `default` on every optional property from a default-constructed instance (as dumped to JSON)."""
    if schema.get("type") != "object" or not isinstance(value, dict):
        return
    required = set(schema.get("required", []))
    for name, prop in schema.get("properties", {}).items():
        if name not in value:
            continue
        if name not in required and value[name] is not None and "default" not in prop:
            # Objects default to {} and get their leaves from their own properties' defaults (structural defaulting).
            prop["default"] = {} if isinstance(value[name], dict) and "properties" in prop else _drop_nones(value[name])
        _fill_defaults(prop, value[name])


def _drop_nones(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nones(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nones(v) for v in value]
    return value


def _at(schema: dict[str, Any], dotted: str) -> dict[str, Any]:
    node = schema
    for part in dotted.split("."):
        node = node["properties"][part]
    return node


def openapi_schema() -> dict[str, Any]:
    """The CRD's `openAPIV3Schema` for version v1alpha1 (structural, with defaults and CEL rules)."""
    raw = c.RLTrainingJob.model_json_schema(by_alias=True, mode="validation")
    defs = raw.get("$defs", {})
    spec = _resolve(copy.deepcopy(defs["RLTrainingJobSpec"]), defs)
    status = _resolve(copy.deepcopy(defs["RLTrainingJobStatus"]), defs)
    status.pop("additionalProperties", None)
    _fill_defaults(spec, c.RLTrainingJobSpec.model_construct().model_dump(by_alias=True, mode="json"))
    # Status defaults would make the API server invent values the operator never wrote: keep status default-free.
    _strip_defaults(status)

    for rule in c.CEL_RULES:
        target = spec if rule.path == "spec" else _at({"properties": {"spec": spec}}, rule.path)
        target.setdefault("x-kubernetes-validations", []).append(rule.as_validation())
    for section in IMMUTABLE_SECTIONS:
        spec["properties"][section].setdefault("x-kubernetes-validations", []).append(
            {"rule": "self == oldSelf", "message": f"spec.{section} {IMMUTABLE_MESSAGE}"})

    return {
        "type": "object",
        "description": c.RLTrainingJob.__doc__.strip().splitlines()[0],
        # metadata.name is visible to CEL at the root only (apiextensions: metadata.name and generateName)
        "x-kubernetes-validations": [{"rule": c.JOB_NAME_CEL, "message": c.JOB_NAME_MESSAGE}],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec | {"default": {}},
            "status": status,
        },
    }


def _strip_defaults(node: Any) -> None:
    if isinstance(node, dict):
        node.pop("default", None)
        for v in node.values():
            _strip_defaults(v)
    elif isinstance(node, list):
        for v in node:
            _strip_defaults(v)


PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Step", "type": "integer", "jsonPath": ".status.currentStep"},
    {"name": "Total", "type": "integer", "jsonPath": ".status.totalSteps"},
    {"name": "Success", "type": "number", "jsonPath": ".status.metrics.successRate"},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def crd() -> dict[str, Any]:
    """The full CustomResourceDefinition object (apiextensions.k8s.io/v1)."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{c.PLURAL}.{c.GROUP}",
            "labels": {"app.kubernetes.io/name": "daedalus", "app.kubernetes.io/part-of": "daedalus"},
        },
        "spec": {
            "group": c.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": c.KIND,
                "listKind": f"{c.KIND}List",
                "plural": c.PLURAL,
                "singular": c.SINGULAR,
                "shortNames": list(c.SHORT_NAMES),
                "categories": ["all", "daedalus"],
            },
            "versions": [
                {
                    "name": c.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                }
            ],
        },
    }


_KEY_ORDER = ["description", "type", "anyOf", "x-kubernetes-int-or-string", "nullable", "enum", "default", "minimum",
              "exclusiveMinimum", "maximum", "exclusiveMaximum", "minLength", "maxLength", "pattern", "minItems",
              "maxItems", "items", "required", "properties", "additionalProperties", "x-kubernetes-validations"]


def _ordered(node: Any) -> Any:
    """Stable, readable key order for schema nodes (description and type first)."""
    if isinstance(node, list):
        return [_ordered(n) for n in node]
    if not isinstance(node, dict):
        return node
    if "properties" in node and isinstance(node["properties"], dict) and "type" in node:
        rank = {k: i for i, k in enumerate(_KEY_ORDER)}
        keys = sorted(node, key=lambda k: rank.get(k, len(rank)))
    elif "type" in node or "description" in node:
        rank = {k: i for i, k in enumerate(_KEY_ORDER)}
        keys = sorted(node, key=lambda k: rank.get(k, len(rank)))
    else:
        keys = list(node)
    return {k: (_ordered(node[k]) if k != "default" else node[k]) for k in keys}


class _NoAliasDumper(yaml.SafeDumper):
    """SafeDumper that writes repeated values in full instead of YAML anchors."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


HEADER = (
    "# Generated by `daedalus crd` from daedalus_trainer/config.py. Do not edit: run `make crds`.\n"
)


def render() -> str:
    """The CRD as YAML text, exactly as stored in `crds/rltrainingjob.yaml`."""
    body = crd()
    schema = body["spec"]["versions"][0]["schema"]
    schema["openAPIV3Schema"] = _ordered(schema["openAPIV3Schema"])
    return HEADER + yaml.dump(body, Dumper=_NoAliasDumper, sort_keys=False, width=120, allow_unicode=True)


def apply_defaults(schema: dict[str, Any], obj: Any) -> Any:
    """Apply structural-schema defaults to `obj` the way the API server does (apiextensions.k8s.io/v1 defaulting).

    Nulls the schema does not allow are dropped first (:func:`prune_nulls`), then missing properties with a `default`
    are set (objects then recursively defaulted), list items are defaulted with the `items` schema. Returns a new
    object; the input is not modified. Used where no API server defaults for us (local mode, kmock tests) so that
    every path sees the same object.
    """
    return _default_in_place(schema, copy.deepcopy(prune_nulls(obj, schema)))


def _default_in_place(schema: dict[str, Any], obj: Any) -> Any:
    """:func:`apply_defaults`' walk over an object it already owns (pruned and copied once, at the top)."""
    if isinstance(obj, dict) and schema.get("type") == "object":
        for name, prop in schema.get("properties", {}).items():
            if name not in obj and "default" in prop:
                obj[name] = copy.deepcopy(prop["default"])
            if name in obj:
                obj[name] = _default_in_place(prop, obj[name])
    elif isinstance(obj, list) and "items" in schema:
        obj = [_default_in_place(schema["items"], item) for item in obj]
    return obj


@functools.lru_cache(maxsize=1)
def _schema_for_reading() -> dict[str, Any]:
    """:func:`openapi_schema`, built once per process for :func:`prune_nulls` (callers must not modify it)."""
    return openapi_schema()


def prune_nulls(obj: Any, schema: dict[str, Any] | None = None, dropped: list[tuple[str | int, ...]] | None = None,
                _path: tuple[str | int, ...] = ()) -> Any:
    """``obj`` without the nulls the API server drops before it validates a custom resource: every object property
    (or ``additionalProperties`` entry) that is ``null`` where its schema is not ``nullable: true``. A dropped field is
    then defaulted, or reported as required, exactly as if it had been left out, both by the API server and by
    :func:`daedalus_trainer.config.parse_job`. Nulls a schema allows (``nullable: true``: an optional field such as
    ``model.sftAdapter``) stay; list items are pruned inside but never removed.

    Source: Kubernetes apiextensions-apiserver, ``schema/defaulting`` (``PruneNonNullableNullsWithoutDefaults``, then
    ``Default`` replacing a non-nullable null that has a default; kubernetes/kubernetes#95423, Kubernetes 1.20), and
    the "Defaulting and Nullable" section of the CustomResourceDefinition docs.

    ``schema``: a structural schema; the RLTrainingJob CRD's (:func:`openapi_schema`) when not given. Returns new
    dicts and lists along the schema; ``obj`` is not modified (values the schema does not describe are shared with
    it, not copied). Never raises: a value of the wrong type is left for validation to report.

    ``dropped``: when given, the path of each dropped field is appended to it as a tuple of keys and list indexes
    (``("spec", "model", "name")``), for a warning that names what was read as left out.
    """
    if schema is None:
        schema = _schema_for_reading()
    if isinstance(obj, dict):
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        out = {}
        for key, value in obj.items():
            sub = properties.get(key, extra if isinstance(extra, dict) else None)
            if sub is None:  # not in the schema: kept, for validation to call it an unknown field
                out[key] = value
            elif value is None and not sub.get("nullable", False):
                if dropped is not None:
                    dropped.append((*_path, str(key)))  # a YAML key may be a number or a boolean
            else:
                out[key] = prune_nulls(value, sub, dropped, (*_path, str(key)))
        return out
    if isinstance(obj, list) and isinstance(schema.get("items"), dict):
        return [prune_nulls(item, schema["items"], dropped, (*_path, i)) for i, item in enumerate(obj)]
    return obj
