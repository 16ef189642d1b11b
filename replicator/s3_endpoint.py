"""Which S3 endpoint the environment names, read one way for every client of it.

replicator reaches an S3 warehouse with three clients: obstore (the Delta log and data files),
delta-rs (reads, checkpoints) and Spark's s3a. Each reads the credentials itself, the AWS tools'
way (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN), but they differ on the
endpoint: delta-rs and Hadoop do not read AWS_ENDPOINT_URL_S3, Hadoop reads no AWS_* variable
for the endpoint or region, and obstore and delta-rs refuse an http:// endpoint unless
AWS_ALLOW_HTTP is set. This reading is handed to each of them explicitly.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class S3Endpoint:
    url: str | None       # an S3-compatible server (MinIO, moto...); None: AWS itself
    region: str | None

    @property
    def plain_http(self) -> bool:
        """The endpoint is http://: naming one is the user's consent to plain HTTP, as for the AWS CLI."""
        return bool(self.url and self.url.lower().startswith("http://"))


def s3_endpoint(environ: Mapping[str, str] | None = None) -> S3Endpoint:
    """AWS_ENDPOINT_URL_S3 (the AWS tools' per-service name) or AWS_ENDPOINT_URL; AWS_REGION or
    AWS_DEFAULT_REGION, us-east-1 for an endpoint given without one (what S3-compatible servers expect)."""
    env = os.environ if environ is None else environ
    url = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or ("us-east-1" if url else None)
    return S3Endpoint(url.rstrip("/") if url else None, region)
