"""What every section of the job spec is built on."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")]


def _no_credentials(location: str) -> str:
    """A spec is written into run directories and events: a URL must not carry a secret."""
    if "://" in location:
        try:
            parts = urlsplit(location)
            secret = parts.password is not None or parts.username is not None
        except ValueError as e:
            raise ValueError(f"not a valid URL ({e})") from None
        if secret:
            raise ValueError(
                "credentials in a URL would be written into the run directory; give them as the store expects "
                "them (for S3: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE, AWS_ENDPOINT_URL)"
            )
    return location


# A local path or an fsspec URL (s3://bucket/prefix, gs://...), without credentials in it.
Location = Annotated[str, Field(min_length=1, max_length=4096), AfterValidator(_no_credentials)]


class Strict(BaseModel):
    """Base for every spec section: unknown keys are errors, not silently ignored."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_default=True, allow_inf_nan=False)
