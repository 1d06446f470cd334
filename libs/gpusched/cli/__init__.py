"""The `gpusched` command: run the stack, run one service, talk to the API."""
