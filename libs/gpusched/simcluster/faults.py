"""Node faults in the simulated cluster, set by command (tests and the demo break nodes
with it); the agent then reports the node's health as a real agent would."""

from __future__ import annotations

from typing import Final

from pydantic import Field

from gpusched.contracts.messages import Wire

# Both the message type and the verb of its subject, <p>.cmd.agent.sim.node_health.
SIM_NODE_HEALTH: Final = "sim.node_health"


class SetNodeHealth(Wire):
    node: str = Field(min_length=1, max_length=200)
    healthy: bool
    reason: str = Field(default="", max_length=1000)
