"""An audit record is made whatever the text it records: a reason or an entity built
from what a user sent is made to fit the record's bounds. Pure: no database is touched
(an audit record is staged in memory until its unit of work commits)."""

from __future__ import annotations

import re
from typing import Any

from gpusched.contracts.messages import AuditRecord
from gpusched.contracts.subjects import Subjects
from gpusched.contracts.validation import NAME_MAX, TEXT_MAX
from gpusched.infra.db import UnitOfWork


def audit(entity: str, reason: str) -> tuple[AuditRecord, str | None]:
    unused: Any = None
    outgoing = UnitOfWork(unused, "s", "admission", Subjects()).audit_event(
        "job.rejected", entity=entity, reason=reason
    )
    assert isinstance(outgoing.data, AuditRecord)
    return outgoing.data, outgoing.correlation_id


def test_a_reason_longer_than_a_record_holds_keeps_its_start_and_says_how_much_is_left_out() -> (
    None
):
    reason = "unknown_gpu_model: " + "M" * 6_336
    record, _ = audit("vision", reason)

    assert len(record.reason) <= TEXT_MAX
    shown = re.fullmatch(r"(.*)\.\.\. \((\d+) more characters\)", record.reason, re.DOTALL)
    assert shown is not None, record.reason[-60:]
    kept, left_out = shown.group(1), int(shown.group(2))
    assert reason.startswith(kept)
    assert len(kept) + left_out == len(reason)


def test_a_reason_that_fits_is_kept_as_it_is_line_breaks_included() -> None:
    reason = "x" * (TEXT_MAX - 20) + "\nsecond line"
    assert audit("vision", reason)[0].reason == reason


def test_a_reason_with_a_control_character_is_recorded_with_it_escaped() -> None:
    record, _ = audit("vision", "refused: name 'a\x07b'")
    assert record.reason == "refused: name 'a\\x07b'"


def test_an_entity_too_long_or_with_control_characters_still_makes_a_record() -> None:
    record, correlation_id = audit("n" * 300, "why")
    assert len(record.entity) <= NAME_MAX
    assert record.entity.startswith("n" * 100) and record.entity.endswith("more characters)")
    assert correlation_id == record.entity

    record, correlation_id = audit("a\nb", "why")
    assert record.entity == "a\\nb" == correlation_id
