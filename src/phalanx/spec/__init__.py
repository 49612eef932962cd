"""The job spec: parsing YAML and validating it with precise errors; every layer reads it."""

from phalanx.spec.load import SpecError, SpecIssue, dump_spec, load_spec, parse_spec, validate_spec
from phalanx.spec.model import JobSpec

__all__ = ["JobSpec", "SpecError", "SpecIssue", "dump_spec", "load_spec", "parse_spec", "validate_spec"]
