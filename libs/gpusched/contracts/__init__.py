"""Wire contracts: the envelope, subjects and the pydantic payload schemas.

Everything that crosses the bus is defined here, once. The public contracts
(job control/events, telemetry, audit, the jobs API) are versioned and stable:
code outside this project relies on them.
"""
