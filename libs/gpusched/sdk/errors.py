"""The SDK's own errors: callers never need to import the NATS client to handle them."""


class JobClientError(Exception):
    """The client cannot talk to the control plane (not connected, no stream, timeout)."""


class CheckpointError(JobClientError):
    """Saving a checkpoint failed; `checkpoint.failed` was published before this is raised."""
