"""The cluster agent: the edge to the (simulated) cluster. Nothing durable.

It starts and evicts workloads on command, reports them started and stopped, and
publishes GPU telemetry and inference stats for the simulated load.
"""
