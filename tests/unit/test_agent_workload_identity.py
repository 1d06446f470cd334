"""Who the cluster agent runs a process workload as, and the environment it gets."""

from __future__ import annotations

import pwd
from pathlib import Path

import pytest

from gpusched.agent.identity import WorkloadUser, WorkloadUserError, workload_user
from gpusched.agent.workloads import without_credentials, workload_environment
from gpusched.infra.settings import AgentSettings

NOBODY = pwd.getpwnam("nobody")


def test_under_root_process_workloads_run_as_nobody_by_default() -> None:
    assert workload_user(AgentSettings(), euid=0) == WorkloadUser(
        "nobody", NOBODY.pw_uid, NOBODY.pw_gid
    )
    assert workload_user(AgentSettings(run_as=str(NOBODY.pw_uid)), euid=0) == WorkloadUser(
        "nobody", NOBODY.pw_uid, NOBODY.pw_gid
    )


def test_root_as_the_workload_user_needs_the_explicit_setting() -> None:
    for root in ("root", "0"):
        with pytest.raises(WorkloadUserError, match="ALLOW_ROOT_WORKLOADS"):
            workload_user(AgentSettings(run_as=root), euid=0)
    # Allowed: the workloads run as the agent itself, root.
    assert workload_user(AgentSettings(run_as="root", allow_root_workloads=True), euid=0) is None


def test_an_agent_that_is_not_root_runs_workloads_as_itself_whatever_run_as_says() -> None:
    assert workload_user(AgentSettings(), euid=1000) is None
    assert workload_user(AgentSettings(run_as="root"), euid=1000) is None
    assert workload_user(AgentSettings(run_as="no-such-user-here"), euid=1000) is None


def test_a_run_as_that_names_no_user_stops_the_agent_naming_the_setting() -> None:
    with pytest.raises(WorkloadUserError, match="GPUSCHED_AGENT__RUN_AS"):
        workload_user(AgentSettings(run_as="no-such-user-here"), euid=0)


def test_a_workload_gets_its_job_variables_and_only_the_harmless_ones_of_the_agent() -> None:
    agent_env = {
        "PATH": "/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "TZ": "UTC",
        "HOME": "/root",
        "CUDA_HOME": "/usr/local/cuda",
        "GPUSCHED_DATABASE_URL": "postgresql+asyncpg://agent:secret@db/gpusched",
        "GPUSCHED_NATS_CREDENTIALS": "/etc/gpusched/agent.creds",
        "GPUSCHED_SECURITY__OPERATOR_TOKEN": "secret",
        "AWS_SECRET_ACCESS_KEY": "secret",
        "SSH_AUTH_SOCK": "/tmp/ssh-agent.sock",
    }
    job_env = {"GPUSCHED_JOB_ID": "job-1", "GPUSCHED_NATS_URL": "nats://nats:4222"}
    user = WorkloadUser("nobody", NOBODY.pw_uid, NOBODY.pw_gid)

    env = workload_environment(
        agent_env, job_env, home=Path("/data/agent/job-1"), user=user, pass_on=["CUDA_HOME"]
    )

    assert env == {
        "PATH": "/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "TZ": "UTC",
        "CUDA_HOME": "/usr/local/cuda",
        "HOME": "/data/agent/job-1",
        "USER": "nobody",
        "LOGNAME": "nobody",
        "GPUSCHED_JOB_ID": "job-1",
        "GPUSCHED_NATS_URL": "nats://nats:4222",
    }
    # Naming a GPUSCHED_ variable in workload_env does not pass the agent's own on.
    env = workload_environment(
        agent_env, {}, home=Path("/j"), user=None, pass_on=["GPUSCHED_DATABASE_URL"]
    )
    assert "GPUSCHED_DATABASE_URL" not in env
    assert workload_environment({}, {}, home=Path("/j"), user=None)["PATH"]


def test_the_nats_url_a_job_gets_carries_none_of_the_agents_credentials() -> None:
    assert without_credentials("nats://agent:secret@nats:4222") == "nats://nats:4222"
    assert without_credentials("tls://token@a:4222,tls://u:p@b:4222") == "tls://a:4222,tls://b:4222"
    assert without_credentials("nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"
