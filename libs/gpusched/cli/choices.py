"""The fixed vocabularies of the command line (priority classes, kinds, job states), as
plain enums so that `--help` and completion list them without importing the contracts.
tests/unit/test_cli.py checks that they equal the contract's enums.
"""

from __future__ import annotations

import enum


class Priority(enum.StrEnum):
    INFERENCE = "inference"
    P0_URGENT = "p0-urgent"
    P1_NORMAL = "p1-normal"
    P2_OFFLINE = "p2-offline"


class Kind(enum.StrEnum):
    TRAINING = "training"
    INFERENCE = "inference"


class State(enum.StrEnum):
    HELD = "held"
    QUEUED = "queued"
    RUNNING = "running"
    PREEMPTED = "preempted"
    COMPLETED = "completed"
    FAILED = "failed"
    PARKED = "parked"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
