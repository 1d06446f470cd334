"""Where `gpusched up` lets the checkpoint service read file:// claims (Stack's child
environment), without starting anything."""

from __future__ import annotations

import json
from pathlib import Path

from gpusched.cli.stack import Stack
from gpusched.infra.settings import CheckpointSettings, Settings


def roots(stack: Stack) -> list[str] | None:
    value = stack._file_roots().get("GPUSCHED_CHECKPOINT__FILE_ROOTS")
    return None if value is None else list(json.loads(value))


def test_the_simulated_clusters_claims_are_read_in_its_agents_workdir_only(
    tmp_path: Path,
) -> None:
    # A relative data dir: the root is absolute, where the agent's workdir resolves.
    stack = Stack(Settings(data_dir=Path(".gpusched-test") / "data"))
    assert roots(stack) == [str((Path.cwd() / ".gpusched-test" / "data" / "agent").resolve())]
    stack = Stack(Settings(data_dir=tmp_path / "data"))
    assert roots(stack) == [str((tmp_path / "data" / "agent").resolve())]


def test_roots_the_settings_name_are_kept(tmp_path: Path) -> None:
    chosen = Settings(
        data_dir=tmp_path, checkpoint=CheckpointSettings(file_roots=[Path("/srv/ckpt")])
    )
    assert roots(Stack(chosen)) == ["/srv/ckpt"]


def test_a_kubernetes_agents_pods_save_on_their_own_storage_so_none_is_assumed(
    tmp_path: Path,
) -> None:
    stack = Stack(Settings(data_dir=tmp_path), env={"GPUSCHED_AGENT__CLUSTER": "kubernetes"})
    assert roots(stack) is None
