"""The checkpoint service: owns the eviction sagas and the checkpoint catalogue (DESIGN §3.4)."""
