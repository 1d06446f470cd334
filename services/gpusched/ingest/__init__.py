"""Ingest: GPU samples and inference stats -> pool utilization snapshots (DESIGN §3.2)."""
