"""The cluster's key space: everything lives under its namespace, so two clusters on one LAN never meet."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ClusterKeys:
    namespace: str = "shardline"

    def alive(self, node: str) -> str:
        return f"{self.namespace}/alive/{node}"  # liveliness token: present while the node's session lives

    @property
    def alive_any(self) -> str:
        return f"{self.namespace}/alive/*"

    def report(self, node: str) -> str:
        return f"{self.namespace}/node/{node}/report"  # the node's own facts, republished on a period

    @property
    def report_any(self) -> str:
        return f"{self.namespace}/node/*/report"

    def agent(self, node: str) -> str:
        return f"{self.namespace}/node/{node}/agent"  # master (or local engine) -> that node's agent

    @property
    def view(self) -> str:
        return f"{self.namespace}/master/view"  # the master's cluster view, with its term

    @property
    def ballot(self) -> str:
        return f"{self.namespace}/master/ballot"  # claims and votes of elections

    @property
    def query(self) -> str:
        return f"{self.namespace}/master/query"  # place, preview, remove: answered by the master

    @property
    def view_query(self) -> str:
        return f"{self.namespace}/node/*/view"  # any node answers with the newest view it holds


def node_from_key(key: str) -> str:
    """The node id in an alive/report key."""
    parts = str(key).split("/")
    return parts[-1] if parts[-2] == "alive" else parts[-2]
