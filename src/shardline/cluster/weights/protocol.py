"""The weight queries between nodes: keys, chunk requests and error replies.

Keys, under the cluster namespace (one queryable per serving node: `{namespace}/weights/{node_id}/**`):
    {namespace}/weights/{node_id}/{model}/manifest  -> Manifest JSON
    {namespace}/weights/{node_id}/{model}/tensor    payload ChunkRequest JSON -> raw bytes of a tensor range
    {namespace}/weights/{node_id}/{model}/file      payload ChunkRequest JSON -> raw bytes of a small file
Errors come back as `reply_err` with an `ErrorReply` JSON.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

MAX_CHUNK_BYTES = 64 << 20  # a server never reads more than this for one query: bounds its memory


class ChunkRequest(BaseModel):
    name: str
    offset: int = Field(ge=0)
    length: int = Field(gt=0, le=MAX_CHUNK_BYTES)
    digest: str  # the manifest the fetcher plans from: a model that changed since is refused, never mixed


class ErrorReply(BaseModel):
    code: Literal["no_model", "bad_request", "stale", "internal"]
    message: str


def key_prefix(namespace: str, node_id: str) -> str:
    return f"{namespace}/weights/{node_id}"
