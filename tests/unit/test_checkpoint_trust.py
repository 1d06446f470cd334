"""Which checkpoint claims the checkpoint service may accept without verifying them."""

from __future__ import annotations

import pytest

from gpusched.checkpoint.policy import TrustPolicy
from gpusched.checkpoint.verification import (
    ClaimCheck,
    MalformedUri,
    judge_unverifiable,
    uri_scheme,
)
from gpusched.infra.settings import CheckpointSettings


@pytest.mark.parametrize(
    ("uri", "scheme"),
    [
        ("file:///var/ckpt/a.pt", "file"),
        ("file://localhost/var/ckpt/a.pt", "file"),
        ("s3://bucket/key.pt", "s3"),
        ("S3://bucket/key.pt", "s3"),
        ("gs://bucket/key.pt", "gs"),
        ("hf+hub://org/model", "hf+hub"),
    ],
)
def test_a_claims_scheme_is_read_in_lower_case(uri: str, scheme: str) -> None:
    assert uri_scheme(uri) == scheme


@pytest.mark.parametrize(
    "uri",
    [
        "ckpt.pt",
        "/var/ckpt/a.pt",
        "://bucket/key",
        " s3://bucket/key",
        "http://[::1/a.pt",
        "file:a.pt",
        "file://elsewhere/var/ckpt/a.pt",
        "1s3://bucket/key",
    ],
)
def test_a_uri_with_no_scheme_or_no_local_path_is_malformed(uri: str) -> None:
    with pytest.raises(MalformedUri):
        uri_scheme(uri)


def test_nothing_is_trusted_by_default() -> None:
    trust = TrustPolicy.from_settings(CheckpointSettings())

    assert not trust.trusts("p2-offline", "s3")
    assert not trust.trusts("p2-offline", "file")


def test_a_scheme_is_trusted_only_for_the_classes_that_name_it() -> None:
    settings = CheckpointSettings(trusted_schemes={"p2-offline": ["S3", "gs"], "p1-normal": []})
    trust = TrustPolicy.from_settings(settings)

    assert trust.trusts("p2-offline", "s3") and trust.trusts("p2-offline", "gs")
    assert not trust.trusts("p1-normal", "s3")
    assert not trust.trusts("p0-urgent", "s3")
    assert not trust.trusts(None, "s3")  # a job whose class is not known


@pytest.mark.parametrize(
    ("trusted", "message"),
    [
        ({"p2": ["s3"]}, "not a priority class"),
        ({"p2-offline": ["s3://"]}, "is not a URI scheme"),
        ({"p2-offline": ["s3://bucket"]}, "is not a URI scheme"),
        ({"p2-offline": [""]}, "is not a URI scheme"),
    ],
)
def test_a_misspelt_trust_setting_stops_the_service_naming_it(
    trusted: dict[str, list[str]], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        TrustPolicy.from_settings(CheckpointSettings(trusted_schemes=trusted))


def test_verification_off_must_name_what_it_trusts() -> None:
    with pytest.raises(ValueError, match="every claim would be refused"):
        TrustPolicy.from_settings(CheckpointSettings(verify_uris=False))
    with pytest.raises(ValueError, match="every claim would be refused"):
        TrustPolicy.from_settings(
            CheckpointSettings(verify_uris=False, trusted_schemes={"p2-offline": []})
        )

    trust = TrustPolicy.from_settings(
        CheckpointSettings(verify_uris=False, trusted_schemes={"p2-offline": ["file"]})
    )
    assert trust.trusts("p2-offline", "file")


def test_an_unverifiable_claim_counts_only_when_trusted_and_says_what_to_set() -> None:
    trusted = judge_unverifiable("job-1", "s3", "p2-offline", trusted=True)
    refused = judge_unverifiable("job-1", "s3", "p1-normal", trusted=False)
    unknown = judge_unverifiable("job-1", "s3", None, trusted=False)

    assert trusted.check is ClaimCheck.TRUSTED and trusted.counts
    assert refused.check is ClaimCheck.UNTRUSTED and not refused.counts
    assert '{"p1-normal": ["s3"]}' in refused.why
    assert not unknown.counts and "not known" in unknown.why
