"""Weight distribution between nodes: a node that lacks a model gets its stage's tensors from a peer.

Only the tensors of the stage's layer range travel, over zenoh queryables of the cluster's namespace (never
from outside). A source describes a model with a `Manifest` (every tensor's dtype, shape, place and sha256;
small files with theirs), built once per model directory and cached beside it. A fetcher asks for chunks of
tensors' raw bytes, writes them where they belong in one preallocated safetensors file and records each
finished chunk in an append-only log, so a fetch that is interrupted continues where it stopped. Every tensor
is checked against its hash: a mismatch fetches that tensor again. The finished directory replaces the old one
with a rename and carries a shard manifest (`SHARD_MANIFEST`) that says which layers it holds and their
hashes, so corruption on disk is found later (`verify_shard`) and repaired by fetching only what is wrong.

Modules by job: `manifest` (what a model has), `server` (serving it to peers), `fetch` (copying a stage
from a peer), `verify` (checking a directory against its manifest); `files` (the on-disk layout) and
`protocol` (the queries between nodes) are shared by them.
"""
