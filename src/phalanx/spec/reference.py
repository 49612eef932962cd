"""The job spec reference (docs/spec.md), generated from the pydantic models' JSON schema, so that the
documentation says exactly what validation accepts: every key, its type and bounds, default and meaning.

    python -m phalanx.spec.reference > docs/spec.md      # `make docs`; a test checks the file is current
"""

from __future__ import annotations

import json
from typing import Any

from phalanx.spec.model import JobSpec

BOUNDS = (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="), ("exclusiveMaximum", "<"))


def kind(schema: dict[str, Any], defs: dict[str, Any]) -> str:
    """A field's type in a few words: ``integer >= 1``, ``"cpu" | "cuda"``, ``number > 0 | null``."""
    if "$ref" in schema:
        key = SECTIONS_BY_MODEL[schema["$ref"].rsplit("/", 1)[-1]]
        return f"[`{key}`](#{slug(key)})"
    if "anyOf" in schema:
        return " \\| ".join(kind(option, defs) for option in schema["anyOf"])
    if "enum" in schema:
        return " \\| ".join(json.dumps(v) for v in schema["enum"])
    if "const" in schema:
        return json.dumps(schema["const"])
    name = schema.get("type", "any")
    if name == "array":
        if "prefixItems" in schema:
            return "[" + ", ".join(kind(item, defs) for item in schema["prefixItems"]) + "]"
        name = f"list of {kind(schema.get('items', {}), defs)}" + (
            f" (at least {schema['minItems']})" if schema.get("minItems") else ""
        )
    elif name == "object":
        name = f"map of string to {kind(schema.get('additionalProperties', {}), defs)}"
    elif name == "string" and "pattern" in schema:
        name = "string matching `{}`".format(schema["pattern"].replace("|", "\\|"))  # a table cell
    bounds = [f"{op} {schema[key]}" for key, op in BOUNDS if key in schema]
    return " ".join([name, *bounds])


def slug(key: str) -> str:
    return "".join(c for c in key if c.isalnum()) or "top"


# Each section of the spec, by the dotted key it sits at (the model names are the schema's).
SECTIONS = (
    ("JobSpec", "(top level)"),
    ("Resources", "resources"),
    ("Train", "train"),
    ("ModelSpec", "train.model"),
    ("Parallel", "train.parallel"),
    ("Optimizer", "train.optimizer"),
    ("Data", "data"),
    ("DataSource", "data.sources[]"),
    ("Checkpoint", "checkpoint"),
    ("Resilience", "resilience"),
    ("Slurm", "slurm"),
    ("Kubernetes", "kubernetes"),
)
SECTIONS_BY_MODEL = {model: key for model, key in SECTIONS}


def section(key: str, schema: dict[str, Any], defs: dict[str, Any]) -> str:
    lines = [f'<a id="{slug(key)}"></a>', f"## `{key}`", ""]
    if schema.get("description"):
        lines += [" ".join(schema["description"].split()), ""]
    lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
    required = set(schema.get("required", ()))
    for name, field in schema["properties"].items():
        default = "required" if name in required else f"`{json.dumps(field.get('default'))}`"
        if "$ref" in field and name not in required:
            default = "its defaults"
        refs = [option["$ref"] for option in [field, *field.get("anyOf", [])] if "$ref" in option]
        about = field.get("description") or (defs[refs[0].rsplit("/", 1)[-1]].get("description", "") if refs else "")
        meaning = " ".join(about.split()).replace("<", "&lt;").replace(">", "&gt;")
        lines.append(f"| `{name}` | {kind(field, defs)} | {default} | {meaning} |")
    return "\n".join(lines)


def markdown() -> str:
    schema = JobSpec.model_json_schema(by_alias=True)
    defs = schema.get("$defs", {})
    models = {"JobSpec": schema, **defs}
    head = [
        "# Job spec reference",
        "",
        "Generated from the pydantic models in `src/phalanx/spec/model.py` by `python -m phalanx.spec.reference` "
        "(`make docs`); do not edit by hand. A job spec is YAML; unknown keys are errors, and every error names "
        "the field's path, the value and what would be valid. `phalanx validate job.yaml` prints the resolved "
        "spec with every default filled in.",
        "",
        "A job gives exactly one of `train:` (the built-in LLM recipe) and `command:` (any script, run on every "
        "rank). Rules across fields: pp x dp_replicate x dp_shard x tp must equal nodes x procs_per_node; "
        "global_batch must be a multiple of micro_batch x the data-parallel size; with pp > 1 the quotient is "
        "the number of micro-batches a step, at least pp for 1F1B, and the model's n_layers must divide into "
        "pp x pp_stages_per_rank stages; warmup_steps at most steps.",
    ]
    body = [section(key, models[model], defs) for model, key in SECTIONS]
    return "\n".join(head) + "\n\n" + "\n\n".join(body) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
