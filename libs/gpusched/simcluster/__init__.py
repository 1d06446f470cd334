"""The simulated cluster: the pure models behind the cluster agent's simulation.

Utilization and latency of inference, the virtual training loop's step math and the
projection of which GPUs serve inference. No I/O and no clock of their own, so the
agent, the tests and trace replay run the very same functions.
"""
