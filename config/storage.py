"""Where an ``s3://`` snapshot store is and how to sign in to it (``ObjectStoreConfig``).

The endpoint, region and credentials come from the environment at an entry point, under the AWS
SDKs' standard names (``AWS_ENDPOINT_URL``, ``AWS_REGION``, ``AWS_ACCESS_KEY_ID``...), and are
passed down typed; like Kafka's security settings they are never written to a run config file.
Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from config.env import (
    ENV_AWS_ACCESS_KEY_ID,
    ENV_AWS_DEFAULT_REGION,
    ENV_AWS_ENDPOINT_URL,
    ENV_AWS_REGION,
    ENV_AWS_SECRET_ACCESS_KEY,
    ENV_AWS_SESSION_TOKEN,
    Environment,
)


@dataclass(frozen=True)
class ObjectStoreConfig:
    """An S3-compatible object store; None everywhere: AWS with the SDK's own credential chain."""

    endpoint_url: str | None = None
    """S3-compatible endpoint (MinIO, Ceph, a local moto server); None: AWS."""
    region: str | None = None
    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)

    @classmethod
    def from_environment(cls, env: Environment) -> "ObjectStoreConfig":
        """``AWS_ENDPOINT_URL``, ``AWS_REGION`` (else ``AWS_DEFAULT_REGION``), ``AWS_ACCESS_KEY_ID``,
        ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``."""
        return cls(endpoint_url=env.optional(ENV_AWS_ENDPOINT_URL),
                   region=env.optional(ENV_AWS_REGION) or env.optional(ENV_AWS_DEFAULT_REGION),
                   access_key_id=env.optional(ENV_AWS_ACCESS_KEY_ID),
                   secret_access_key=env.optional(ENV_AWS_SECRET_ACCESS_KEY),
                   session_token=env.optional(ENV_AWS_SESSION_TOKEN))
