"""NodeLink: the preflight of a node of an engine that spans hosts (its rank interface, the NCCL
in its venv, whether the head's master port is reachable), read before any change."""

from __future__ import annotations

from pyinfra.api import FactBase

from sparkform.rules.nodes import NodeLink as Link
from sparkform.rules.nodes import node_link_command, parse_node_link


class NodeLink(FactBase):
    """
    Returns what sparkform.rules.nodes.NodeLink holds: the interface, its addresses and MTU, the NCCL
    libraries of the venv, and (on a worker) whether the head's master port answers.
    """

    def command(self, interface: str, venv: str, head: tuple[str, int] | None = None) -> str:
        self.interface = interface
        return node_link_command(interface, venv, head)

    def process(self, output: list[str]) -> Link:
        return parse_node_link(self.interface, output)
