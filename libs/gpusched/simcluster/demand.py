"""The simulated inference load, set by command (the demo and tests create surges with it)."""

from __future__ import annotations

from typing import Final

from pydantic import Field

from gpusched.contracts.messages import Wire

# Both the message type and the verb of its subject, <p>.cmd.agent.sim.demand.
SIM_DEMAND: Final = "sim.demand"


class InferenceDemand(Wire):
    """Inference work offered to the cluster, in GPUs worth of load."""

    gpus: float = Field(ge=0)
