"""What goes wrong moving or checking weights: one base class, the cases a caller handles apart."""

from __future__ import annotations


class WeightsError(RuntimeError):
    """A weight transfer or check failed; the message says what, from whom and what to do."""


class ModelNotOnSourceError(WeightsError):
    """The source node has not the model, or not the layers asked for."""


class SourceUnavailableError(WeightsError):
    """Nothing answers weight queries for that node in this namespace."""


class SourceRefusedError(WeightsError):
    """The source's bytes (or its description of them) do not match what the model must be: never used for
    this copy; the fetcher tries another holder. `node` and `model` name the culprit for the cluster's
    events."""

    def __init__(self, node: str, model: str, why: str) -> None:
        super().__init__(f"node {node} refused as a source of {model}: {why}")
        self.node = node
        self.model = model
        self.why = why
