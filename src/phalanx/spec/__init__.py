"""The job spec: parsing YAML and validating it with precise errors; every layer reads it."""

from phalanx.spec.load import (
    MAX_SPEC_CHARS,
    SpecError,
    SpecIssue,
    dump_spec,
    excerpt,
    load_spec,
    parse_spec,
    validate_spec,
)
from phalanx.spec.model import JobSpec

__all__ = [
    "MAX_SPEC_CHARS",
    "JobSpec",
    "SpecError",
    "SpecIssue",
    "dump_spec",
    "excerpt",
    "load_spec",
    "parse_spec",
    "validate_spec",
]
