"""The TLS settings and the contexts made from them, without servers: what each
GPUSCHED_*_TLS__* variable means, and one error naming the setting that cannot be used."""

from __future__ import annotations

import logging
import re
import ssl
from pathlib import Path

import pytest
import trustme
from pydantic import ValidationError

from gpusched.cli.main import main
from gpusched.infra.settings import Settings
from gpusched.infra.tls import (
    DATABASE_TLS,
    NATS_TLS,
    TlsConfigError,
    TlsSettings,
    client_context,
    server_name,
)
from gpusched.sdk.environment import EnvVar, JobEnvironment
from gpusched.sdk.errors import JobClientError


@pytest.fixture
def ca_file(tmp_path: Path) -> Path:
    path = tmp_path / "ca.pem"
    trustme.CA().cert_pem.write_to_path(path)
    return path


@pytest.fixture
def client_files(tmp_path: Path) -> tuple[Path, Path]:
    cert = trustme.CA().issue_cert("gpusched-test-client")
    cert_file, key_file = tmp_path / "client.pem", tmp_path / "client.key"
    cert.cert_chain_pems[0].write_to_path(cert_file)
    cert.private_key_pem.write_to_path(key_file)
    return cert_file, key_file


def test_the_tls_sections_are_read_from_nested_environment_variables(
    monkeypatch: pytest.MonkeyPatch, ca_file: Path, client_files: tuple[Path, Path]
) -> None:
    cert_file, key_file = client_files
    monkeypatch.setenv("GPUSCHED_NATS_TLS__CA_FILE", str(ca_file))
    monkeypatch.setenv("GPUSCHED_NATS_TLS__CERT_FILE", str(cert_file))
    monkeypatch.setenv("GPUSCHED_NATS_TLS__KEY_FILE", str(key_file))
    monkeypatch.setenv("GPUSCHED_NATS_TLS__SERVER_NAME", "nats.internal")
    monkeypatch.setenv("GPUSCHED_DATABASE_TLS__VERIFY", "false")

    settings = Settings()

    assert settings.nats_tls == TlsSettings(
        ca_file=ca_file, cert_file=cert_file, key_file=key_file, server_name="nats.internal"
    )
    assert settings.database_tls == TlsSettings(verify=False)


def test_without_tls_variables_there_is_no_tls_section() -> None:
    settings = Settings()
    assert settings.nats_tls is None and settings.database_tls is None
    assert client_context(settings.nats_tls, NATS_TLS) is None


def test_a_file_setting_naming_no_file_is_one_error_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    missing = tmp_path / "nowhere" / "client.pem"
    monkeypatch.setenv("GPUSCHED_DATABASE_TLS__CERT_FILE", str(missing))

    with pytest.raises(ValidationError) as raised:
        Settings()
    assert f"GPUSCHED_DATABASE_TLS__CERT_FILE={missing}: no such file" in str(raised.value)


def test_the_cli_says_which_tls_setting_names_no_file_in_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "ca.pem"
    monkeypatch.setenv("GPUSCHED_NATS_TLS__CA_FILE", str(missing))
    monkeypatch.setenv("GPUSCHED_NATS_URL", "tls://127.0.0.1:4222")

    assert main(["get", "job-000000000000"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"gpusched: invalid nats_tls: GPUSCHED_NATS_TLS__CA_FILE={missing}: no such file"


def test_a_key_without_its_certificate_is_refused(tmp_path: Path) -> None:
    key = tmp_path / "client.key"
    key.write_text("not used")
    with pytest.raises(ValidationError, match="GPUSCHED_NATS_TLS__KEY_FILE is set without"):
        Settings(nats_tls=TlsSettings(key_file=key))


def test_a_file_that_is_no_certificate_is_an_error_naming_the_setting(tmp_path: Path) -> None:
    garbage = tmp_path / "ca.pem"
    garbage.write_text("this is not PEM\n")
    expected = re.escape(f"{DATABASE_TLS}__CA_FILE={garbage}: cannot be used")
    with pytest.raises(TlsConfigError, match=f"^{expected}"):
        client_context(TlsSettings(ca_file=garbage), DATABASE_TLS)


def test_verify_is_the_default_and_checks_certificate_and_name(
    ca_file: Path, client_files: tuple[Path, Path]
) -> None:
    cert_file, key_file = client_files
    context = client_context(
        TlsSettings(ca_file=ca_file, cert_file=cert_file, key_file=key_file), NATS_TLS
    )
    assert context is not None
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert context.minimum_version >= ssl.TLSVersion.TLSv1_2
    assert len(context.get_ca_certs()) == 1  # ours only, not the system's as well
    assert server_name(context) is None


def test_verify_false_trusts_any_server_and_logs_a_warning_naming_the_setting(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="gpusched.infra.tls"):
        context = client_context(TlsSettings(verify=False), NATS_TLS)
    assert context is not None
    assert context.verify_mode == ssl.CERT_NONE and not context.check_hostname
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "GPUSCHED_NATS_TLS__VERIFY=false"
    ]


def test_a_jobs_environment_carries_its_nats_ca_both_ways(ca_file: Path) -> None:
    env = JobEnvironment.from_environ(
        {
            EnvVar.NATS_URL: "tls://nats:4222",
            EnvVar.JOB_ID: "job-1",
            EnvVar.NATS_TLS_CA_FILE: str(ca_file),
            "GPUSCHED_NATS_TLS__SERVER_NAME": "nats.internal",
        }
    )
    assert env.nats_tls == TlsSettings(ca_file=ca_file, server_name="nats.internal")
    assert JobEnvironment.from_environ(env.to_environ()) == env
    context = env.nats_tls_context()
    assert context is not None and server_name(context) == "nats.internal"


def test_a_job_without_tls_variables_connects_as_its_url_says() -> None:
    env = JobEnvironment.from_environ({EnvVar.NATS_URL: "nats://x:4222", EnvVar.JOB_ID: "job-1"})
    assert env.nats_tls is None and env.nats_tls_context() is None
    assert not any(name.startswith("GPUSCHED_NATS_TLS") for name in env.to_environ())


@pytest.mark.parametrize(
    ("variable", "value", "error"),
    [
        ("GPUSCHED_NATS_TLS__VERIFY", "maybe", "GPUSCHED_NATS_TLS__VERIFY: Input should be"),
        ("GPUSCHED_NATS_TLS__CA_FILE", "no-such-dir/ca.pem", "CA_FILE=no-such-dir/ca.pem:"),
    ],
)
def test_a_job_with_an_unusable_tls_variable_is_told_which(
    variable: str, value: str, error: str
) -> None:
    with pytest.raises(JobClientError, match=error):
        JobEnvironment.from_environ(
            {EnvVar.NATS_URL: "tls://x:4222", EnvVar.JOB_ID: "job-1", variable: value}
        )


@pytest.mark.parametrize(
    ("variable", "value", "said"),
    [
        ("GPUSCHED_INGEST__REPLICA", "5", "replica 5 of 2: number the replicas 0..1"),
        ("GPUSCHED_INGEST__FLUSH_INTERVAL_S", "inf", "Input should be a finite number"),
        ("GPUSCHED_BUS__MAX_CLOCK_SKEW_S", "NaN", "Input should be a finite number"),
        ("GPUSCHED_CHECKPOINT__FILE_ROOTS", '["ckpt"]', "'ckpt' is no absolute path"),
    ],
)
def test_a_service_refuses_a_bad_setting_in_one_line_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    variable: str,
    value: str,
    said: str,
) -> None:
    monkeypatch.setenv("GPUSCHED_INGEST__REPLICAS", "2")
    monkeypatch.setenv(variable, value)

    assert main(["service", "ingest"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"gpusched: {variable}: {said}; ")


def test_a_service_without_its_servers_says_which_variables_to_set(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("GPUSCHED_NATS_URL", raising=False)
    monkeypatch.delenv("GPUSCHED_DATABASE_URL", raising=False)

    assert main(["service", "ingest"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("gpusched: GPUSCHED_NATS_URL and GPUSCHED_DATABASE_URL must be set")
