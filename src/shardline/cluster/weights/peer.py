"""One peer's weight server as a fetch sees it: its answers, with deadlines proportional to the bytes asked
for, and the checks of its manifest before anything it says is trusted (names become paths, sizes become
allocations, and its hashes are the model's only when its digest is the one the master names).
"""

from __future__ import annotations

import math
import time

import zenoh
from pydantic import ValidationError

from shardline.cluster.weights.protocol import ChunkRequest, ErrorReply, key_prefix
from shardline.models.store.errors import (
    ModelNotOnSourceError,
    SourceRefusedError,
    SourceUnavailableError,
    WeightsError,
)
from shardline.models.store.files import NAME, SHARD_MANIFEST
from shardline.models.store.formats import SAFETENSORS_ITEMSIZE
from shardline.models.store.manifest import Manifest

_ITEMSIZE = SAFETENSORS_ITEMSIZE  # packed quantized weights are U32, their scales F16/BF16/F32


class _NoAnswer(Exception):
    """No usable reply; `failed`: the source answered with an internal error (worth another try)."""

    def __init__(self, message: str, failed: bool = False) -> None:
        super().__init__(message)
        self.failed = failed


class WeightSource:
    """Queries to one node's weight server, with deadlines proportional to the bytes asked for."""

    def __init__(
        self, session: zenoh.Session, namespace: str, node: str, model: str, retries: int, min_rate_bps: float
    ) -> None:
        self.session = session
        self.node = node
        self.model = model
        self.prefix = f"{key_prefix(namespace, node)}/{model}"
        self.retries = retries
        self.min_rate_bps = min_rate_bps

    def ask(self, kind: str, payload: bytes | None, timeout: float) -> bytes:
        replies = self.session.get(f"{self.prefix}/{kind}", payload=payload, timeout=timeout)
        for reply in replies:
            if reply.ok is not None:
                return reply.ok.payload.to_bytes()
            raw = reply.err.payload.to_bytes() if reply.err is not None else b""
            try:
                err = ErrorReply.model_validate_json(raw)
            except ValidationError:
                err = ErrorReply(code="internal", message=raw.decode(errors="replace")[:500])
            if err.code == "no_model":
                raise ModelNotOnSourceError(err.message)
            if err.code == "internal":
                raise _NoAnswer(err.message, failed=True)
            raise WeightsError(f"node {self.node} refused {kind} of {self.model}: {err.message}")
        raise _NoAnswer("no reply")

    def manifest(self, timeout_s: float, discover_s: float) -> Manifest:
        t0 = time.monotonic()
        pause, failures = 0.02, 0
        while True:
            left = timeout_s - (time.monotonic() - t0)
            if left <= 0:
                raise WeightsError(f"node {self.node} sent no manifest of {self.model} in {timeout_s:.0f}s")
            asked = time.monotonic()
            try:
                raw = self.ask("manifest", None, left)
                break
            except _NoAnswer as exc:
                failures += exc.failed
                if failures > self.retries:
                    raise WeightsError(f"node {self.node} cannot describe model {self.model}: {exc}") from exc
                # An empty answer at once means no queryable is routed (yet): node absent or just joined.
                quick = time.monotonic() - asked < 0.5 * left
                if quick and not exc.failed and time.monotonic() - t0 > discover_s:
                    raise SourceUnavailableError(
                        f"node {self.node} does not answer weight queries on {self.prefix} "
                        f"(not connected, or not serving weights): {exc}"
                    ) from exc
                time.sleep(pause)  # backoff while routes form; never a synchronisation point
                pause = min(pause * 2, 0.5)
        try:
            return Manifest.model_validate_json(raw)
        except ValidationError as exc:
            raise WeightsError(f"node {self.node} sent an invalid manifest of {self.model}: {exc}") from exc

    def chunk(self, kind: str, req: ChunkRequest, expected: int) -> bytes:
        timeout = 5.0 + req.length / self.min_rate_bps
        payload = req.model_dump_json().encode()
        why = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(0.1 * 2**attempt, 2.0))
            try:
                data = self.ask(kind, payload, timeout)
            except _NoAnswer as exc:
                why = str(exc)
                continue
            if len(data) == expected:
                return data
            why = f"{len(data)} bytes instead of {expected}"
        raise WeightsError(
            f"{kind} {req.name!r} bytes {req.offset}+{req.length} of {self.model} from node {self.node}: "
            f"{why} (after {self.retries + 1} tries, {timeout:.1f}s each)"
        )


def check_manifest(m: Manifest, node: str) -> None:
    """A peer's manifest is input: names become paths and headers, sizes become allocations."""
    for name in m.files:
        if not NAME.match(name) or name.endswith(".safetensors") or name == SHARD_MANIFEST:
            raise WeightsError(f"node {node} lists a file with a forbidden name {name!r}")
    for name, t in m.tensors.items():
        if not name or len(name) > 500 or any(ord(c) < 32 for c in name):
            raise WeightsError(f"node {node} lists a tensor with a forbidden name {name!r}")
        item = _ITEMSIZE.get(t.dtype)
        if item is None:  # fail closed: a size that cannot be checked is an allocation taken on trust
            raise WeightsError(
                f"node {node}: tensor {name} has dtype {t.dtype!r}, which this node does not know, so its "
                f"size cannot be checked (known: {', '.join(_ITEMSIZE)})"
            )
        if any(d < 0 for d in t.shape) or math.prod(t.shape) * item != t.bytes:
            raise WeightsError(f"node {node}: tensor {name} {t.dtype}{t.shape} cannot be {t.bytes} bytes")
    if m.num_layers <= 0:
        raise WeightsError(f"node {node}: model {m.model} has no layers")


def check_digest(manifest: Manifest, node: str, model: str, expected: str) -> None:
    """The source describes the very model the cluster expects: else its hashes prove nothing."""
    if manifest.layers is not None:
        # A stage holder's manifest lists only its tensors: the model digest cannot be recomputed from it.
        raise SourceRefusedError(node, model, "it holds one stage only, which cannot be checked")
    if (digest := manifest.digest()) != expected:
        raise SourceRefusedError(
            node,
            model,
            f"its copy has digest {digest[:12]}, not the expected {expected[:12]} (another version, "
            "or altered since its import)",
        )
