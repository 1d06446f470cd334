"""The Helm chart in deploy/helm/gpusched.

Where `helm` is installed, `helm lint` and `helm template` run on it and the rendered
objects are checked. `helm` is not packaged by Debian, PyPI or npm (the npm wrappers
download the binary from the Helm project at install time), so where it is missing the
chart is checked without rendering: its values against values.schema.json (what Helm
itself enforces at install), and its templates statically: balanced template blocks,
every `.Values` path present in values.yaml, every `include` defined, every file the
templates read present, every GPUSCHED_* variable a setting.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from tests.unit.test_deploy_files import assert_known_settings

from gpusched.cli.stack import SERVICES

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "gpusched"
TEMPLATES = sorted(
    p for p in (CHART / "templates").iterdir() if p.suffix in (".yaml", ".tpl", ".txt")
)
HELM = shutil.which("helm")
NO_HELM = "helm is not on PATH (not packaged by Debian, PyPI or npm); the static checks run"

ACTION = re.compile(r"\{\{-?\s*(.*?)\s*-?\}\}", re.DOTALL)
OPENERS = ("if", "range", "with", "define", "block")
VALUES_PATH = re.compile(r"\$?\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)")


def values() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    return loaded


def schema() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((CHART / "values.schema.json").read_text())
    return loaded


def with_values(**changes: Any) -> dict[str, Any]:
    """values.yaml with dotted paths changed (`{"services.agent.replicas": 2}`)."""
    result = values()
    for dotted, value in changes.items():
        node = result
        *parents, last = dotted.split(".")
        for key in parents:
            node = node[key]
        node[last] = value
    return result


def actions(path: Path) -> Iterator[str]:
    for match in ACTION.finditer(path.read_text()):
        action = match.group(1).strip()
        if not action.startswith("/*"):
            yield action


# --- the values -----------------------------------------------------------------------------
def test_the_default_values_satisfy_the_chart_schema() -> None:
    jsonschema.validate(values(), schema())


@pytest.mark.parametrize(
    "changes",
    [
        # External NATS without TLS and a database without a CA; more replicas.
        {"nats.url": "nats://nats.messaging:4222", "nats.tls.caSecret": ""},
        {"database.tls.caSecret": "", "services.admission.replicas": 3},
        # An immutable image, metrics for the Prometheus Operator, the team API account.
        {"image.digest": "sha256:" + "ab" * 32, "metrics.podMonitor.enabled": True},
        {"auth.clientsAccount": "A" + "B" * 55, "extraEnv": {"GPUSCHED_LOG_LEVEL": "DEBUG"}},
        # The jobs' checkpoint storage, read by the checkpoint service to verify claims.
        {
            "services.checkpoint.extraVolumes": [
                {"name": "checkpoints", "nfs": {"server": "nfs", "path": "/ckpt"}}
            ],
            "services.checkpoint.extraVolumeMounts": [
                {"name": "checkpoints", "mountPath": "/ckpt", "readOnly": True}
            ],
        },
    ],
)
def test_the_documented_overrides_are_accepted(changes: dict[str, Any]) -> None:
    jsonschema.validate(with_values(**changes), schema())


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"services.agent.replicas": 2}, "replicas"),  # one agent per cluster
        ({"services.admission.replicas": -1}, "replicas"),
        ({"image.digest": "latest"}, "digest"),
        ({"nats.url": "http://nats:4222"}, "url"),
        ({"nats.streamReplicas": 0}, "streamReplicas"),
        ({"nats.streamReplicas": "3"}, "streamReplicas"),
        ({"metrics.port": 80}, "port"),
        ({"extraEnv": {"PATH": "/tmp"}}, "extraEnv"),
        ({"database.urlSecret": ""}, "urlSecret"),
        ({"services.admision": {"replicas": 1}}, "services"),  # a typo is not ignored
        ({"services.checkpoint.extraVolumeMounts": [{"name": "x"}]}, "extraVolumeMounts"),
    ],
)
def test_values_the_chart_cannot_run_with_are_refused_naming_the_field(
    changes: dict[str, Any], field: str
) -> None:
    with pytest.raises(jsonschema.ValidationError) as refused:
        jsonschema.validate(with_values(**changes), schema())
    error = refused.value
    assert field in [*map(str, error.absolute_path), *map(str, error.absolute_schema_path)]


def test_the_chart_runs_every_service_and_the_schema_knows_each() -> None:
    assert tuple(values()["services"]) == SERVICES
    assert set(schema()["properties"]["services"]["required"]) == set(SERVICES)


# --- the templates, statically ---------------------------------------------------------------
@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.name)
def test_every_template_block_is_closed_and_else_is_inside_one(template: Path) -> None:
    open_blocks: list[str] = []
    for action in actions(template):
        word = action.split(None, 1)[0] if action else ""
        if word in OPENERS:
            open_blocks.append(word)
        elif word == "else":
            assert open_blocks and open_blocks[-1] in ("if", "with", "range"), action
        elif word == "end":
            assert open_blocks, f"{template.name}: an end without a block"
            open_blocks.pop()
    assert not open_blocks, f"{template.name}: unclosed {open_blocks}"


def test_every_values_path_the_templates_read_is_in_values_yaml() -> None:
    defaults = values()
    for template in TEMPLATES:
        for action in actions(template):
            for path in VALUES_PATH.findall(action):
                node: Any = defaults
                for key in path.strip(".").split("."):
                    assert isinstance(node, dict) and key in node, (
                        f"{template.name} reads .Values{path}, which values.yaml lacks"
                    )
                    node = node[key]


def test_every_include_is_defined_and_every_file_read_is_in_the_chart() -> None:
    text = "\n".join(a for t in TEMPLATES for a in actions(t))
    defined = set(re.findall(r'define "([^"]+)"', text))
    included = set(re.findall(r'(?:include|template) "([^"]+)"', text))
    assert included <= defined, included - defined
    for name in re.findall(r'\.Files\.Get "([^"]+)"', text):
        assert (CHART / name).is_file(), name


def test_the_chart_alert_rules_are_those_of_deploy_prometheus() -> None:
    shipped = (ROOT / "deploy" / "prometheus" / "alerts.yml").read_text()
    assert (CHART / "files" / "alerts.yml").read_text() == shipped


def test_every_setting_the_chart_sets_is_a_setting_of_gpusched() -> None:
    names = {n for t in TEMPLATES for n in re.findall(r"GPUSCHED_[A-Z0-9_]+", t.read_text())}
    assert "GPUSCHED_METRICS_HOST" in names and "GPUSCHED_NATS_CREDENTIALS" in names
    assert_known_settings(dict.fromkeys(names, ""))


def test_pods_probe_liveness_and_readiness_on_the_health_endpoint() -> None:
    deployments = (CHART / "templates" / "services.yaml").read_text()
    assert re.search(r"startupProbe:\s+httpGet: \{path: /livez, port: metrics\}", deployments)
    assert re.search(r"readinessProbe:\s+httpGet: \{path: /readyz, port: metrics\}", deployments)
    assert re.search(r"livenessProbe:\s+httpGet: \{path: /livez, port: metrics\}", deployments)


# --- rendered, where helm is installed ---------------------------------------------------------
def helm(*args: str) -> subprocess.CompletedProcess[str]:
    if HELM is None:
        pytest.skip(NO_HELM)
    return subprocess.run([HELM, *args], capture_output=True, text=True, timeout=120, check=False)


def test_helm_lint_passes() -> None:
    done = helm("lint", str(CHART), "--strict")
    assert done.returncode == 0, done.stdout + done.stderr


def test_helm_renders_a_deployment_with_probes_for_every_service() -> None:
    done = helm("template", "gs", str(CHART), "--set", "metrics.podMonitor.enabled=true")
    assert done.returncode == 0, done.stderr
    objects = [d for d in yaml.safe_load_all(done.stdout) if d]
    deployments = {d["metadata"]["name"]: d for d in objects if d["kind"] == "Deployment"}
    assert set(deployments) == {f"gs-{s}" for s in SERVICES}
    for deployment in deployments.values():
        [container] = deployment["spec"]["template"]["spec"]["containers"]
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert any(d["kind"] == "PodMonitor" for d in objects)


def test_helm_mounts_the_checkpoint_storage_given_in_the_checkpoint_pods_only(
    tmp_path: Path,
) -> None:
    overrides = tmp_path / "values.yaml"
    overrides.write_text(
        yaml.safe_dump(
            {
                "services": {
                    "checkpoint": {
                        "extraVolumes": [{"name": "ckpt", "nfs": {"server": "n", "path": "/x"}}],
                        "extraVolumeMounts": [
                            {"name": "ckpt", "mountPath": "/ckpt", "readOnly": True}
                        ],
                    }
                }
            }
        )
    )
    done = helm("template", "gs", str(CHART), "-f", str(overrides))
    assert done.returncode == 0, done.stderr
    objects = [d for d in yaml.safe_load_all(done.stdout) if d]
    for d in objects:
        if d["kind"] != "Deployment":
            continue
        pod = d["spec"]["template"]["spec"]
        mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
        volumes = {v["name"] for v in pod["volumes"]}
        if d["metadata"]["name"] == "gs-checkpoint":
            assert mounts["ckpt"] == {"name": "ckpt", "mountPath": "/ckpt", "readOnly": True}
            assert "ckpt" in volumes and "data" in volumes
        else:
            assert "ckpt" not in mounts and "ckpt" not in volumes
