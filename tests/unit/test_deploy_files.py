"""The deployment artefacts agree with the code: one image, six services, one settings object.

These read files only. The checks that run a tool (promtool, kubectl, docker-compose)
skip, saying so, where the tool is not installed.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from gpusched.admission import parking
from gpusched.cli.stack import SERVICES
from gpusched.infra import metrics
from gpusched.infra.settings import Settings
from gpusched.preemption import handlers as preemption_handlers
from gpusched.preemption import inputs as preemption_inputs

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
PROMETHEUS = DEPLOY / "prometheus"
GRAFANA = DEPLOY / "grafana"
METRICS_PORT = 9100
# Every process that talks to the bus and the database: the services and the one-shot.
BUS_AND_DB_USERS = (*SERVICES, "migrate")
CORE_ALERT_METRICS = {
    "GpuIdleFragmentation": "gpusched_gpu_utilization",
    "GpuMemoryHigh": "gpusched_gpu_memory_used_ratio",
    "InferenceP99NearSlo": "gpusched_inference_p99_ms",
    "TrainingQueueWaitLong": "gpusched_queue_wait_seconds",
}
SERVICE_ALERTS = {
    "GpuschedServiceAbsent",
    "GpuschedServiceDown",
    "GpuschedTargetDown",
    "GpuschedDeadLetters",
    "GpuschedOutboxLagHigh",
    "GpuschedHandlerFailures",
    "GpuschedHandlerRetries",
    "GpuschedOutboxStalled",
    "GpuschedDependencyUnreachable",
    "GpuschedJobsParked",
    "GpuschedControllerFailing",
}


# --- reading the files ------------------------------------------------------------------
def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def compose() -> dict[str, Any]:
    doc: dict[str, Any] = load_yaml(ROOT / "docker-compose.yml")
    return doc


def compose_default(value: str) -> str:
    """Resolve `${VAR:-default}` as compose does with VAR unset."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


def k8s_documents() -> Iterator[dict[str, Any]]:
    kustomization = load_yaml(K8S / "kustomization.yaml")
    for resource in kustomization["resources"]:
        for doc in yaml.safe_load_all((K8S / resource).read_text()):
            if doc:
                yield doc


def k8s_objects(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in k8s_documents() if d["kind"] == kind}


def alert_rules() -> dict[str, dict[str, Any]]:
    groups = load_yaml(PROMETHEUS / "alerts.yml")["groups"]
    return {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines = [ln for ln in (ROOT / "Dockerfile").read_text().splitlines() if ln.strip()]
    joined = "\n".join(ln for ln in lines if not ln.lstrip().startswith("#"))
    joined = joined.replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        word, _, rest = line.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def exported_metric_names() -> set[str]:
    """Sample names the services' registry exposes (counter _total, histogram _bucket...)."""
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count")}
    names: set[str] = set()
    modules = (metrics, parking, preemption_handlers, preemption_inputs)
    for collector in (value for module in modules for value in vars(module).values()):
        if isinstance(collector, MetricWrapperBase):
            for family in collector.describe():
                names.add(family.name)
                names.update(family.name + s for s in suffixes.get(family.type, ()))
    return names


def metric_names_in(expr: str) -> set[str]:
    return set(re.findall(r"\bgpusched_[a-z0-9_]+", expr))


# Where each tool comes from, for the skip reason.
TOOL_SOURCES = {
    "promtool": "the Debian package `prometheus`",
    "docker-compose": "the Debian package `docker-compose` or the compose CLI plugin",
    "kubectl": "the Kubernetes client",
}


def run_tool(*argv: str) -> subprocess.CompletedProcess[str]:
    if shutil.which(argv[0]) is None:
        pytest.skip(f"{argv[0]} is not on PATH; it comes with {TOOL_SOURCES[argv[0]]}")
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)


def settings_from(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Settings:
    for key in [k for k in os.environ if k.startswith("GPUSCHED_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return Settings()


def assert_known_settings(env: dict[str, str]) -> None:
    """Every GPUSCHED_* name is a Settings field (the top level ignores unknown names)."""
    for key in (k for k in env if k.startswith("GPUSCHED_")):
        path = key.removeprefix("GPUSCHED_").lower().split("__")
        assert path[0] in Settings.model_fields, f"{key} is not a Settings field"
        if len(path) == 2:
            section = Settings.model_fields[path[0]].annotation
            assert section is not None and path[1] in section.model_fields, f"{key} unknown"


# --- every file parses ------------------------------------------------------------------
def test_every_yaml_and_json_deploy_file_parses() -> None:
    yaml_files = [ROOT / "docker-compose.yml", *DEPLOY.rglob("*.yml"), *DEPLOY.rglob("*.yaml")]
    for path in yaml_files:
        docs = list(yaml.safe_load_all(path.read_text()))
        assert docs and all(d is not None for d in docs), f"{path} is empty"
    for path in GRAFANA.rglob("*.json"):
        assert json.loads(path.read_text())["panels"], f"{path} has no panels"


# --- the image ----------------------------------------------------------------------------
def test_image_is_slim_python_run_as_a_non_root_user_with_gpusched_as_entry_point() -> None:
    steps = dockerfile_instructions()
    assert steps[0] == ("FROM", "python:3.11-slim")
    users = [args for op, args in steps if op == "USER"]
    assert users and users[-1].split(":")[0] not in {"root", "0"}
    assert [json.loads(a) for op, a in steps if op == "ENTRYPOINT"] == [["gpusched"]]
    assert [json.loads(a) for op, a in steps if op == "CMD"] == [["service", "admission"]]


def test_image_copies_the_wheel_inputs_before_installing_and_the_deploy_files_after() -> None:
    steps = dockerfile_instructions()
    install = next(i for i, (op, a) in enumerate(steps) if op == "RUN" and "pip install" in a)
    assert "--no-cache-dir ." in steps[install][1]
    copied_before = {
        src for op, a in steps[:install] if op == "COPY" for src in shlex.split(a)[:-1]
    }
    assert {"pyproject.toml", "README.md", "libs", "services"} <= copied_before
    # The default settings paths (deploy/inventory/demo.yaml) are relative to WORKDIR.
    copied_after = [shlex.split(a) for op, a in steps[install:] if op == "COPY"]
    assert ["deploy", "./deploy"] in copied_after


def test_everything_the_image_copies_exists_and_is_not_dockerignored() -> None:
    ignored = [
        ln.strip()
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    for op, args in dockerfile_instructions():
        if op != "COPY":
            continue
        for src in shlex.split(args)[:-1]:
            assert (ROOT / src).exists(), f"COPY {src}: no such path in the repo"
            hits = [p for p in ignored if fnmatch.fnmatch(src, p.rstrip("/"))]
            assert not hits, f"COPY {src} is excluded by .dockerignore {hits}"
    assert ".venv" in ignored and ".gpusched" in ignored


def test_the_credentials_bundle_is_neither_committed_nor_built_into_the_image() -> None:
    dockerignore = (ROOT / ".dockerignore").read_text().splitlines()
    gitignore = (ROOT / ".gitignore").read_text().splitlines()
    assert "deploy/secrets" in dockerignore, "COPY deploy would put the credentials in the image"
    assert "deploy/secrets/" in gitignore


def test_the_image_leaves_the_metrics_interface_to_the_deployment() -> None:
    env = " ".join(args for op, args in dockerfile_instructions() if op == "ENV")
    assert "GPUSCHED_METRICS_HOST" not in env  # the settings default: 127.0.0.1
    assert Settings.model_fields["metrics_host"].default == "127.0.0.1"


# --- docker compose -------------------------------------------------------------------------
def test_every_service_has_a_compose_service_running_it_from_the_image() -> None:
    services = compose()["services"]
    for name in SERVICES:
        assert services[name]["command"] == ["service", name]
        assert "entrypoint" not in services[name]  # the image's: gpusched
        assert services[name]["build"]["context"] == "."
    assert services["migrate"]["command"] == ["migrate"]


def test_compose_services_reach_nats_and_postgres_of_the_stack(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    services = compose()["services"]
    pg_env = services["postgres"]["environment"]
    for name in BUS_AND_DB_USERS:
        env = {k: compose_default(str(v)) for k, v in services[name]["environment"].items()}
        assert_known_settings(env)
        settings = settings_from(env, monkeypatch)
        nats_url, db_url = settings.require_urls()
        assert urlsplit(nats_url).hostname == "nats" and urlsplit(nats_url).port == 4222
        db = urlsplit(db_url)
        assert db.scheme == "postgresql+asyncpg" and db.hostname == "postgres"
        assert db.username == pg_env["POSTGRES_USER"]
        assert db.path.lstrip("/") == pg_env["POSTGRES_DB"]
        assert settings.metrics_port == METRICS_PORT and settings.metrics_host == "0.0.0.0"
        assert (ROOT / settings.admission.inventory_path).is_file()
        assert (ROOT / settings.billing.price_book_path).is_file()


def test_compose_services_start_after_migrate_which_waits_for_healthy_servers() -> None:
    services = compose()["services"]
    for name in SERVICES:
        assert services[name]["depends_on"] == {
            "migrate": {"condition": "service_completed_successfully"}
        }
    assert services["migrate"]["depends_on"] == {
        "nats": {"condition": "service_healthy"},
        "postgres": {"condition": "service_healthy"},
    }
    assert services["migrate"]["restart"] == "no"
    assert "-js" in services["nats"]["command"]
    assert services["nats"]["image"].startswith("nats:2.10")
    assert services["postgres"]["image"] == "postgres:16"
    for server in ("nats", "postgres"):
        assert services[server]["healthcheck"]["test"]
        assert services[server]["volumes"]


def test_compose_prometheus_and_grafana_load_the_deploy_configuration() -> None:
    services = compose()["services"]
    prom = services["prometheus"]
    assert "./deploy/prometheus:/etc/prometheus:ro" in prom["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    mounts = {v.split(":")[0]: v.split(":")[1] for v in services["grafana"]["volumes"]}
    provider = load_yaml(GRAFANA / "provisioning/dashboards/gpusched.yml")["providers"][0]
    assert mounts["./deploy/grafana/dashboards"] == provider["options"]["path"]
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"


def test_compose_file_is_valid_for_docker_compose() -> None:
    result = run_tool("docker-compose", "-f", "docker-compose.yml", "config", "-q")
    assert result.returncode == 0, result.stderr


# --- Kubernetes -------------------------------------------------------------------------------
def test_every_service_has_a_k8s_deployment_running_it() -> None:
    deployments = k8s_objects("Deployment")
    for name in SERVICES:
        container = deployments[f"gpusched-{name}"]["spec"]["template"]["spec"]["containers"][0]
        assert [*container["command"], *container["args"]] == ["gpusched", "service", name]


def test_k8s_replicas_follow_the_scale_out_plan() -> None:
    deployments = k8s_objects("Deployment")
    replicas = {n.removeprefix("gpusched-"): d["spec"]["replicas"] for n, d in deployments.items()}
    assert replicas == {s: 1 if s == "agent" else 2 for s in SERVICES}
    assert deployments["gpusched-agent"]["spec"]["strategy"]["type"] == "Recreate"
    budgets = k8s_objects("PodDisruptionBudget")
    assert {f"gpusched-{s}" for s in SERVICES if s != "agent"} <= set(budgets)


def test_k8s_pods_get_their_settings_from_the_configmap_and_the_secret(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env: dict[str, str] = dict(k8s_objects("ConfigMap")["gpusched-env"]["data"])
    env.update(k8s_objects("Secret")["gpusched-database"]["stringData"])
    assert_known_settings(env)
    settings = settings_from(env, monkeypatch)
    nats_url, db_url = settings.require_urls()
    assert urlsplit(db_url).scheme == "postgresql+asyncpg"
    assert urlsplit(nats_url).hostname in k8s_objects("Service")
    assert settings.metrics_port == METRICS_PORT and settings.metrics_host == "0.0.0.0"

    pods = [d["spec"]["template"]["spec"] for d in k8s_objects("Deployment").values()]
    pods.append(k8s_objects("Job")["gpusched-migrate"]["spec"]["template"]["spec"])
    for pod in pods:
        sources = pod["containers"][0]["envFrom"]
        assert {"configMapRef": {"name": "gpusched-env"}} in sources
        assert {"secretRef": {"name": "gpusched-database"}} in sources
        assert pod["securityContext"]["runAsNonRoot"] is True


def test_k8s_mounts_the_inventory_and_price_book_the_settings_point_at() -> None:
    env = k8s_objects("ConfigMap")["gpusched-env"]["data"]
    files = k8s_objects("ConfigMap")["gpusched-files"]["data"]
    for deployment in k8s_objects("Deployment").values():
        pod = deployment["spec"]["template"]["spec"]
        volume = next(v["name"] for v in pod["volumes"] if "configMap" in v)
        mount = next(
            m["mountPath"] for m in pod["containers"][0]["volumeMounts"] if m["name"] == volume
        )
        for key in ("GPUSCHED_ADMISSION__INVENTORY_PATH", "GPUSCHED_BILLING__PRICE_BOOK_PATH"):
            path = Path(env[key])
            assert path.parent == Path(mount) and path.name in files


def test_k8s_configmap_carries_the_inventory_and_prices_of_deploy() -> None:
    files = k8s_objects("ConfigMap")["gpusched-files"]["data"]
    assert yaml.safe_load(files["inventory.yaml"]) == load_yaml(DEPLOY / "inventory/demo.yaml"), (
        "deploy/k8s/configmap-files.yaml is out of date with deploy/inventory/demo.yaml"
    )
    assert yaml.safe_load(files["prices.yaml"]) == load_yaml(DEPLOY / "prices.yaml"), (
        "deploy/k8s/configmap-files.yaml is out of date with deploy/prices.yaml"
    )


def test_k8s_metrics_are_exposed_to_prometheus_on_every_service_pod() -> None:
    services = k8s_objects("Service")
    for name, deployment in k8s_objects("Deployment").items():
        template = deployment["spec"]["template"]
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(METRICS_PORT)
        ports = template["spec"]["containers"][0]["ports"]
        assert {"name": "metrics", "containerPort": METRICS_PORT} in ports
        selector = services[name]["spec"]["selector"]
        assert selector.items() <= template["metadata"]["labels"].items()
    monitor = load_yaml(K8S / "monitoring/podmonitor.yaml")
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"


def test_k8s_migrate_job_and_nats_with_jetstream_are_part_of_the_install() -> None:
    job = k8s_objects("Job")["gpusched-migrate"]["spec"]["template"]["spec"]["containers"][0]
    assert [*job["command"], *job["args"]] == ["gpusched", "migrate"]
    nats = k8s_objects("StatefulSet")["nats"]
    assert nats["spec"]["replicas"] == 3
    config = k8s_objects("ConfigMap")["nats-config"]["data"]["nats.conf"]
    assert "jetstream" in config and config.count("nats://nats-") == 3


def test_kustomize_renders_the_manifests() -> None:
    result = run_tool("kubectl", "kustomize", "deploy/k8s")
    assert result.returncode == 0, result.stderr
    rendered = [d for d in yaml.safe_load_all(result.stdout) if d]
    assert sum(d["kind"] == "Deployment" for d in rendered) == len(SERVICES)
    assert all(d["metadata"].get("namespace") == "gpusched" for d in rendered[1:])


# --- Prometheus and Grafana -------------------------------------------------------------------
def test_prometheus_scrapes_every_compose_service_on_the_metrics_port() -> None:
    config = load_yaml(PROMETHEUS / "prometheus.yml")
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "gpusched")
    sd = job["dns_sd_configs"][0]
    assert set(sd["names"]) == set(SERVICES) and sd["port"] == METRICS_PORT
    for rule_file in config["rule_files"]:
        assert (PROMETHEUS / rule_file).is_file()


def test_alert_rules_cover_service_health_and_the_four_core_alerts() -> None:
    rules = alert_rules()
    assert SERVICE_ALERTS | set(CORE_ALERT_METRICS) <= set(rules)
    for alert, metric in CORE_ALERT_METRICS.items():
        assert metric in rules[alert]["expr"]
    for rule in rules.values():
        assert rule["labels"]["severity"] and rule["annotations"]["summary"]


def test_service_absent_alert_names_every_service() -> None:
    expr = alert_rules()["GpuschedServiceAbsent"]["expr"]
    assert set(re.findall(r'absent\(gpusched_up\{service="([a-z]+)"\}\)', expr)) == set(SERVICES)


def test_service_alerts_and_dashboard_use_metric_names_the_services_export() -> None:
    exported = exported_metric_names()
    core = set(CORE_ALERT_METRICS.values()) | {"gpusched_inference_slo_ms"}
    for name, rule in alert_rules().items():
        unknown = metric_names_in(rule["expr"]) - exported - core
        assert not unknown, f"{name} uses metrics no service exports: {unknown}"
    dashboard = json.loads((GRAFANA / "dashboards/gpusched-control-plane.json").read_text())
    datasource = load_yaml(GRAFANA / "provisioning/datasources/prometheus.yml")["datasources"][0]
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == datasource["uid"]
        for target in panel["targets"]:
            unknown = metric_names_in(target["expr"]) - exported
            assert not unknown, f"panel {panel['title']!r} uses unknown metrics {unknown}"


def test_alert_rules_pass_promtool_check() -> None:
    result = run_tool("promtool", "check", "rules", "deploy/prometheus/alerts.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_alert_rules_fire_as_their_promtool_unit_tests_expect() -> None:
    result = run_tool("promtool", "test", "rules", "deploy/prometheus/alerts_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_config_passes_promtool_check() -> None:
    result = run_tool("promtool", "check", "config", "deploy/prometheus/prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
