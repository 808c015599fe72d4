"""Weight distribution between nodes: a node that lacks a model gets its stage's tensors from a peer.

Only the tensors of the stage's layer range travel, over zenoh queryables of the cluster's namespace (never
from outside). A model's digests (every tensor's and small file's sha256, in a `Manifest`) are recorded once,
when it is imported, and kept beside its directory; nodes report the short model digest, and the master names
the digest a stage must have (the first importer's). A fetcher checks the source's manifest against that
digest, then every tensor against its hash; a source that fails is refused and another holder is tried. A
fetch writes chunks where they belong in one preallocated safetensors file and logs each finished chunk, so
an interrupted fetch continues where it stopped. The finished directory replaces the old one with a rename
and carries a shard manifest (`SHARD_MANIFEST`) that says which layers it holds, their hashes and the model
digest, so corruption on disk is found before the stage loads (`check_stage_copy`) and repaired by fetching
only what is wrong; a whole local copy is checked against its record the same way (`check_full_copy`).

Modules by job: `server` (serving a model to peers), `peer` (one peer's server as a fetch sees it, and the
checks of its manifest), `fetch` (copying a stage from a peer), `sources` (which holders to try, in which
order), `stage` (a node's way to a checked stage directory); `protocol` (the queries between nodes) is shared
by them. What a model holds and how a copy is checked (manifest, verify, files) is models/store/'s.
"""
