"""What goes wrong moving or checking weights: one base class, two cases a caller handles apart."""

from __future__ import annotations


class WeightsError(RuntimeError):
    """A weight transfer or check failed; the message says what, from whom and what to do."""


class ModelNotOnSourceError(WeightsError):
    """The source node has not the model, or not the layers asked for."""


class SourceUnavailableError(WeightsError):
    """Nothing answers weight queries for that node in this namespace."""
