"""shardline: one language model, pipeline-sharded across machines."""

__version__ = "0.1.0"
