"""Who a `process` workload runs as, and the directories it may write.

A process workload runs code a team submitted: never with the agent's privileges.
Under root the agent runs it as `agent.run_as` (default `nobody`), with that user's
group and no supplementary groups, and never as root unless
`agent.allow_root_workloads` says so. An agent that is not root cannot switch users:
its workloads run as itself, and `run_as` is ignored (said once in the log).

A workload writes only its job directory (`<workdir>/<job_id>`, its working and
checkpoint directory), which the agent creates and hands to the user. The user needs
to reach it: the workdir is made traversable but not listable for others (o+x), and so
is every directory above it that is not (execute only: nothing becomes readable).
"""

from __future__ import annotations

import logging
import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path

from gpusched.infra.settings import AgentSettings

log = logging.getLogger(__name__)


class WorkloadUserError(RuntimeError):
    """`agent.run_as` names no user, or names root without allow_root_workloads."""


@dataclass(frozen=True, slots=True)
class WorkloadUser:
    """The account process workloads run as (only when the agent is root)."""

    name: str
    uid: int
    gid: int


def workload_user(settings: AgentSettings, euid: int | None = None) -> WorkloadUser | None:
    """The account to run process workloads as; None: as the agent itself."""
    euid = os.geteuid() if euid is None else euid
    if euid != 0:
        log.info(
            "the agent runs as uid %d, not root: process workloads run as that user too "
            "(agent.run_as=%r is ignored)",
            euid,
            settings.run_as,
        )
        return None
    entry = _account(settings.run_as)
    if entry.pw_uid == 0:
        if not settings.allow_root_workloads:
            raise WorkloadUserError(
                f"agent.run_as={settings.run_as!r} is root: process workloads would run as "
                "root; name an unprivileged user (GPUSCHED_AGENT__RUN_AS), or set "
                "GPUSCHED_AGENT__ALLOW_ROOT_WORKLOADS=true to allow it"
            )
        log.warning("process workloads run as root (agent.allow_root_workloads is set)")
        return None
    log.info(
        "process workloads run as %s (uid %d, gid %d)", entry.pw_name, entry.pw_uid, entry.pw_gid
    )
    return WorkloadUser(entry.pw_name, entry.pw_uid, entry.pw_gid)


def _account(run_as: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwuid(int(run_as)) if run_as.isdigit() else pwd.getpwnam(run_as)
    except KeyError:
        raise WorkloadUserError(
            f"agent.run_as={run_as!r}: no such user on this host; create it or name another "
            "unprivileged user (GPUSCHED_AGENT__RUN_AS)"
        ) from None


def prepare_workdir(workdir: Path, user: WorkloadUser | None) -> None:
    """Create the workdir; with a workload user, let it traverse to its job directories."""
    workdir.mkdir(parents=True, exist_ok=True)
    if user is None:
        return
    # The workdir itself: others may pass through to a job directory they own, not list
    # which jobs there are.
    workdir.chmod(stat.S_IMODE(workdir.stat().st_mode) & ~(stat.S_IRGRP | stat.S_IROTH) | 0o711)
    for parent in workdir.parents:
        mode = parent.stat().st_mode
        if mode & stat.S_IXOTH:
            continue
        # Execute only: the user may pass through, not read what else is there.
        parent.chmod(stat.S_IMODE(mode) | stat.S_IXOTH)
        log.warning(
            "made %s traversable for others (o+x) so that process workloads running as %s "
            "reach the agent workdir %s",
            parent,
            user.name,
            workdir,
        )


def prepare_job_dir(directory: Path, user: WorkloadUser | None) -> None:
    """The job's working and checkpoint directory, writable by the workload's user only."""
    directory.mkdir(mode=0o700, exist_ok=True)
    if user is None:
        return
    # Not following a link: the agent made this directory in its own workdir, which
    # no workload may write, but the check costs nothing.
    os.chown(directory, user.uid, user.gid, follow_symlinks=False)
    directory.chmod(0o700)
