"""The one typed settings object, read once from GPUSCHED_* environment variables.

Nested sections use a double underscore: GPUSCHED_PREEMPTION__EXPAND_ABOVE=0.85.
Defaults are the field numbers of DESIGN §7.
"""

from __future__ import annotations

from datetime import time
from decimal import Decimal
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# TlsSettings is re-exported: a section like the others, defined beside its contexts.
from gpusched.infra.tls import TlsSettings as TlsSettings
from gpusched.infra.tls import check_files


class Section(BaseModel):
    # NaN and Infinity are no setting: an infinite interval would be a loop that never runs.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class BusSettings(Section):
    max_deliver: int = Field(default=5, ge=1, description="deliveries before dead-lettering")
    ack_wait_s: float = Field(default=30.0, gt=0)
    fetch_batch: int = Field(default=64, ge=1)
    nak_delay_s: float = Field(default=0.5, ge=0)
    consumer_concurrency: int = Field(
        default=8,
        ge=1,
        description=(
            "messages a keyed consumer applies at once (one at a time per key); a "
            "consumer without a key applies one at a time"
        ),
    )
    stream_replicas: int = Field(
        default=1, ge=1, le=5, description="JetStream replicas per stream (3 on a NATS cluster)"
    )
    max_clock_skew_s: float = Field(
        default=300.0,
        gt=0,
        description=(
            "how far ahead of this service's clock a message or sample may be stamped "
            "before it is dead-lettered (the past is bounded by the stream's max age)"
        ),
    )


class OutboxSettings(Section):
    batch: int = Field(default=1000, ge=1)
    poll_interval_s: float = Field(default=0.5, gt=0, description="fallback when NOTIFY is missed")
    max_pending_acks: int = Field(default=4000, ge=1)


class AdmissionSettings(Section):
    # Where the GPU inventory comes from: `file` (inventory_path, read at the very first
    # start and by `gpusched node reload`) or `agent` (no file: admission starts with no
    # nodes and the cluster agent adds the cluster's, e.g. the Kubernetes agent's Nodes).
    inventory_source: Literal["file", "agent"] = "file"
    inventory_path: Path = Path("deploy/inventory/demo.yaml")
    schedule_interval_s: float = Field(default=1.0, gt=0)
    # Teams, quotas and max priority classes (docs/admission-operator.md); None: no quotas.
    quotas_path: Path | None = None
    # Without a quotas file no team may submit `process` workloads unless this is on
    # (with one, its per-team allow_process decides).
    allow_process_workloads_without_quotas: bool = False
    # A gang waiting this long holds the freeing GPUs of its best node (a reservation).
    reserve_after_s: float = Field(default=300.0, ge=0)
    # Waiting longer: offered fewer GPUs if it allows (min_count), else its reservation
    # lapses so it cannot hold the cluster hostage (DESIGN §7).
    starve_after_s: float = Field(default=1800.0, ge=0)
    # GPU sharing (docs/admission-operator.md): how far fractional tenants' memory caps
    # may exceed a GPU's memory, and how often one GPU's MIG layout may change (a change
    # resets the GPU).
    overcommit_inference: float = Field(default=1.2, ge=1.0)
    overcommit_training: float = Field(default=1.0, ge=1.0)
    mig_change_interval_s: float = Field(default=3600.0, ge=0)
    # Time-of-day MIG modes (UTC): by day empty MIG GPUs get many small slices for
    # inference, by night they go back to whole GPUs for training. Off by default.
    mig_modes: bool = False
    mig_day_start: time = time(8, 0)
    mig_day_end: time = time(20, 0)
    mig_reconcile_interval_s: float = Field(default=60.0, gt=0)
    # A failed inference replica's replacement waits this long, doubling with each
    # failure in a row up to the longest (docs/admission-user.md).
    replica_restart_first_s: float = Field(default=10.0, gt=0)
    replica_restart_longest_s: float = Field(default=300.0, gt=0)
    # A layout change the cluster agent has not reported applied (or failed) by then
    # is treated as failed: a lost command or report must not keep the GPU pending.
    mig_apply_timeout_s: float = Field(default=300.0, gt=0)


class IngestSettings(Section):
    window_s: float = Field(default=30.0, gt=0)
    snapshot_interval_s: float = Field(default=2.0, gt=0)
    stale_after_s: float = Field(default=60.0, gt=0)
    # Horizontal scale (docs/ingest.md): replica i of n folds the telemetry partitions
    # p with p % n == i; every replica must be given the same n.
    replicas: int = Field(default=1, ge=1, le=16, description="ingest replicas in all")
    replica: int = Field(default=0, ge=0, le=15, description="this replica's number, 0..n-1")
    flush_interval_s: float = Field(
        default=1.0, gt=0, description="how often a replica writes its pool aggregates"
    )
    fetch_batch: int = Field(default=1000, ge=1, le=10_000)
    unknown_node_grace_s: float = Field(
        default=10.0,
        ge=0,
        description="how long a node outside the inventory may report before it is refused",
    )

    # dcgm-exporter scraping (docs/dcgm-input.md): targets from a file, or one per
    # inventory node from a URL template such as http://{node}:9400/metrics.
    scrape_targets_file: Path | None = None
    scrape_url_template: str | None = None
    scrape_interval_s: float = Field(default=5.0, gt=0)
    scrape_timeout_s: float = Field(default=2.0, gt=0, description="per target")
    scrape_concurrency: int = Field(default=64, ge=1, description="targets fetched at once")
    scrape_max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    # A Prometheus that already scrapes the exporters: its /api/v1/query instead.
    prometheus_url: str | None = None
    prometheus_selector: str = Field(default="", description='e.g. cluster="prod"')
    prometheus_node_label: str = "Hostname"
    prometheus_interval_s: float = Field(default=5.0, gt=0)
    prometheus_timeout_s: float = Field(default=3.0, gt=0)
    prometheus_max_age_s: float = Field(default=30.0, gt=0, description="newest sample age")
    # gpusched_gpu_utilization and gpusched_gpu_memory_used_ratio: two series per GPU
    # (node and GPU labels), counted at each scrape. Where dcgm-exporter's own series are
    # scraped anyway, a very large cluster may turn them off (docs/operating.md).
    gpu_metrics: bool = Field(default=True, description="per-GPU gauges on /metrics")

    @field_validator("replica")
    @classmethod
    def _replica_within(cls, v: int, info: ValidationInfo) -> int:
        replicas = info.data.get("replicas", 1)
        if v >= replicas:
            raise ValueError(f"replica {v} of {replicas}: number the replicas 0..{replicas - 1}")
        return v

    @model_validator(mode="after")
    def _one_target_source(self) -> IngestSettings:
        if self.scrape_targets_file is not None and self.scrape_url_template is not None:
            raise ValueError(
                "set scrape_targets_file or scrape_url_template, not both "
                "(a file may name every target, inventory nodes included)"
            )
        return self

    @field_validator("scrape_url_template")
    @classmethod
    def _template_names_node(cls, value: str | None) -> str | None:
        if value is not None and "{node}" not in value:
            raise ValueError("must contain {node}, e.g. http://{node}:9400/metrics")
        return value

    @field_validator("prometheus_selector")
    @classmethod
    def _selector_is_bare(cls, value: str) -> str:
        if any(c in value for c in "{}"):
            raise ValueError('give the matchers without braces, e.g. cluster="prod",pool=~"a|b"')
        return value

    @field_validator("scrape_timeout_s")
    @classmethod
    def _timeout_within_interval(cls, value: float, info: ValidationInfo) -> float:
        interval = info.data.get("scrape_interval_s")
        if interval is not None and value >= interval:
            raise ValueError(f"must be shorter than scrape_interval_s ({interval})")
        return value

    @field_validator("prometheus_timeout_s")
    @classmethod
    def _query_within_interval(cls, value: float, info: ValidationInfo) -> float:
        interval = info.data.get("prometheus_interval_s")
        if interval is not None and value >= interval:
            raise ValueError(f"must be shorter than prometheus_interval_s ({interval})")
        return value


class PreemptionSettings(Section):
    expand_above: float = Field(default=0.80, gt=0, le=1)
    target: float = Field(default=0.70, gt=0, le=1)
    shrink_below: float = Field(default=0.40, ge=0, le=1)
    shared_below: float = Field(default=0.60, ge=0, le=1)
    cooldown_s: float = Field(default=300.0, ge=0)
    # Windows a condition must hold for before it acts (docs/elastic-controller.md).
    expand_hold_s: float = Field(default=30.0, ge=0)
    shrink_hold_s: float = Field(default=600.0, ge=0)
    slo_ms: dict[str, float] = Field(default_factory=dict, description="P99 SLO per service")
    slo_fraction: float = Field(default=0.80, gt=0, le=1)
    queue_above: int | None = Field(default=None, ge=0)
    min_lend_s: float = Field(default=900.0, ge=0)
    min_runtime_s: float = Field(default=1800.0, ge=0)
    max_evictions_per_min: int | None = Field(default=10, ge=0)
    decide_interval_s: float = Field(default=1.0, gt=0)


class CheckpointSettings(Section):
    grace_s: float = Field(default=300.0, gt=0, description="deadline for checkpoint.confirmed")
    sweep_interval_s: float = Field(default=1.0, gt=0)
    # Per priority class: which stage eviction waits for, and what the deadline does.
    stage_required: dict[str, str] = Field(
        default_factory=lambda: {
            "p0-urgent": "persisted",
            "p1-normal": "persisted",
            "p2-offline": "snapshotted",
        }
    )
    deadline_policy: dict[str, str] = Field(
        default_factory=lambda: {"p0-urgent": "abort", "p1-normal": "abort", "p2-offline": "force"}
    )
    # Check file:// claims (exists, size, sha256) before evicting on them. Off (the
    # service cannot see the jobs' storage), it verifies nothing: only schemes named in
    # trusted_schemes are then accepted, so it must name at least one.
    verify_uris: bool = True
    # The URI schemes it reads to verify claims, through fsspec with each store's usual
    # credentials (AWS_*, GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_*): "file", and
    # "s3", "gs", "az" where s3fs, gcsfs, adlfs are installed. Others are unverifiable.
    verify_schemes: list[str] = Field(default_factory=lambda: ["file"])
    # How long one verification may take: a base plus so much per GB the claim lists;
    # what is not verified in time is refused (docs/checkpoint-operations.md).
    verify_budget_s: float = Field(default=30.0, gt=0, le=86_400)
    verify_budget_s_per_gb: float = Field(default=30.0, ge=0, le=86_400)
    verify_parallelism: int = Field(default=8, ge=1, le=256)
    # Per priority class: URI schemes taken on trust, unverified, e.g. {"p2-offline":
    # ["s3"]}. A claim the service cannot verify whose scheme its job's class does not
    # trust is refused (docs/checkpoint-operations.md). Default: none.
    trusted_schemes: dict[str, list[str]] = Field(default_factory=dict)
    retention_per_job: int = Field(
        default=5, ge=1, description="confirmed checkpoints kept per job in the catalogue"
    )
    # The directories file:// claims must lie in (their directories' links resolved): a
    # claim elsewhere is refused unread, so a job cannot make the service read (and say
    # the size of) any other file it can see. Empty: anywhere readable here. `gpusched up`
    # sets the simulated cluster's agent workdir; compose and deploy/k8s/shared-agent-workdir too.
    file_roots: list[Path] = Field(default_factory=list)

    @field_validator("file_roots")
    @classmethod
    def _absolute_roots(cls, roots: list[Path]) -> list[Path]:
        for root in roots:
            if not root.is_absolute():
                raise ValueError(f"{str(root)!r} is no absolute path")
        return roots


class BillingSettings(Section):
    price_book_path: Path = Path("deploy/prices.yaml")
    currency: str = "USD"
    default_gpu_hour: Decimal | None = None


class KubernetesSettings(Section):
    """The Kubernetes agent (docs/kubernetes.md); read only when agent.cluster is kubernetes."""

    # None: the pod's service account (in-cluster); else a kubeconfig file.
    kubeconfig: Path | None = None
    scheduler_name: str = Field(default="gpusched", min_length=1, max_length=63)
    pool_label: str = Field(default="gpusched.io/pool", min_length=1, max_length=253)
    # Where the agent keeps its Lease, its MIG ConfigMap and its own Events.
    namespace: str = Field(default="gpusched", min_length=1, max_length=63)
    # namespace -> team: a pod's team is its namespace's (a label naming another team is
    # refused). A namespace not listed has the team of its gpusched.io/team label (set by
    # an operator); with neither, its pods are refused.
    namespace_teams: dict[str, str] = Field(default_factory=dict)
    # The agent's API credential (`gpusched auth issue --agent NAME --teams ...`): its
    # submits and node commands go as a cluster agent, accepted only for those teams.
    # Required when NATS authenticates (the agent service's own identity may not ask).
    api_credentials: Path | None = None
    # GPU feature discovery product names -> gpusched GPU models, beyond the built-in ones.
    gpu_models: dict[str, str] = Field(default_factory=dict)
    # The grace period of an eviction, per priority class (seconds).
    evict_grace_s: dict[str, int] = Field(
        default_factory=lambda: {
            "inference": 30,
            "p0-urgent": 120,
            "p1-normal": 60,
            "p2-offline": 30,
        }
    )
    # How long an eviction a PodDisruptionBudget refuses (429) is retried before the
    # saga is told it failed.
    evict_retry_s: float = Field(default=30.0, ge=0, le=3600)
    dra_driver: str = "gpu.nvidia.com"
    dra_device_class: str = "gpu.nvidia.com"
    dra_device: str = "gpu-{index}"
    dra_mig_device: str = "gpu-{index}-mig-{profile}-{slice}"
    # The mutating webhook (HTTPS); 0: not served by this process.
    webhook_port: int = Field(default=0, ge=0, le=65535)
    webhook_cert_file: Path | None = None
    webhook_key_file: Path | None = None
    # With several replicas, one leads (a coordination.k8s.io Lease); the others wait.
    leader_election: bool = True
    lease_duration_s: float = Field(default=15.0, ge=2, le=600)
    # A watch is re-opened (from its resourceVersion) at least this often.
    watch_timeout_s: int = Field(default=300, ge=1, le=3600)
    # How long a MIG layout change may take on a node before it is reported failed.
    mig_timeout_s: float = Field(default=900.0, gt=0, le=24 * 3600)
    mig_configmap: str = "gpusched-mig-parted-config"
    # The NATS URL pods reach the control plane at (default: the agent's, without its
    # credentials).
    pod_nats_url: str | None = None
    # The CA (PEM) job pods verify the NATS server's certificate with; default: the
    # agent's own (nats_tls.ca_file). It goes into each job's Secret, mounted in the pod
    # at /var/run/gpusched/nats-ca.crt, and the job's GPUSCHED_NATS_TLS__CA_FILE names it.
    pod_nats_ca_file: Path | None = None


class AgentSettings(Section):
    # sim: the simulated cluster (demo, tests); kubernetes: the Kubernetes agent.
    cluster: Literal["sim", "kubernetes"] = "sim"
    kubernetes: KubernetesSettings = Field(default_factory=KubernetesSettings)
    telemetry_interval_s: float = Field(default=1.0, gt=0)
    time_scale: float = Field(default=1.0, gt=0, description="virtual seconds per real second")
    workdir: Path = Path(".gpusched/agent")
    # Under root, `process` workloads run as this user (name or uid), never as root
    # unless allow_root_workloads; an agent that is not root runs them as itself.
    run_as: str = "nobody"
    allow_root_workloads: bool = False
    # Variables of the agent's environment a process workload also gets (it has PATH,
    # LANG, LC_*, TZ and its job's GPUSCHED_* ones), e.g. ["CUDA_HOME", "HF_HOME"].
    workload_env: list[str] = Field(default_factory=list)


class SecuritySettings(Section):
    # The job credential issuer's seed (admission only): with it admission gives every
    # placed job credentials for its own subjects; without it jobs get none (and on an
    # authenticated NATS cannot connect).
    job_signing_key: Path | None = None
    job_credential_ttl_s: float = Field(
        default=300.0,
        ge=2.0,
        le=7 * 24 * 3600.0,
        description=(
            "lifetime of a job's NATS credentials; admission renews them while the "
            "allocation lives, so they die at most this long after it ends"
        ),
    )
    # The credentials bundle (natsauth.AuthBundle) of an installation: `gpusched up`
    # makes one in <data_dir>/auth for the embedded NATS.
    auth_dir: Path | None = None
    # The public key of the CLIENTS account: a request carrying the server's caller
    # header from that account is a team or an operator (contracts.identity).
    clients_account: str | None = None


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        allow_inf_nan=False,
        env_prefix="GPUSCHED_",
        env_nested_delimiter="__",
        frozen=True,
        extra="ignore",
    )

    nats_url: str | None = Field(default=None, description="external NATS; else embedded")
    nats_credentials: Path | None = Field(
        default=None, description="this process's NATS credentials file (.creds)"
    )
    database_url: str | None = Field(
        default=None, description="external PostgreSQL (postgresql+asyncpg://...); else embedded"
    )
    subject_prefix: str = "gpusched"
    data_dir: Path = Path(".gpusched")
    traces_dir: Path = Path("../shared/traces")
    metrics_host: str = "127.0.0.1"
    metrics_port: int = Field(default=0, ge=0, le=65535, description="0 = no /metrics endpoint")
    trace_file: Path | None = Field(default=None, description="write spans as JSON lines here")
    log_level: str = "INFO"
    db_pool_size: int = Field(default=5, ge=1)
    # GPUSCHED_NATS_TLS__CA_FILE, __CERT_FILE, __KEY_FILE, __VERIFY, __SERVER_NAME (and
    # GPUSCHED_DATABASE_TLS__... the same); unset: the URL alone decides (infra.tls).
    nats_tls: TlsSettings | None = Field(default=None, description="TLS to NATS")
    database_tls: TlsSettings | None = Field(default=None, description="TLS to PostgreSQL")

    bus: BusSettings = BusSettings()
    outbox: OutboxSettings = OutboxSettings()
    admission: AdmissionSettings = AdmissionSettings()
    ingest: IngestSettings = IngestSettings()
    preemption: PreemptionSettings = PreemptionSettings()
    checkpoint: CheckpointSettings = CheckpointSettings()
    billing: BillingSettings = BillingSettings()
    agent: AgentSettings = AgentSettings()
    security: SecuritySettings = SecuritySettings()

    @field_validator("nats_tls", "database_tls")
    @classmethod
    def _tls_files_exist(
        cls, value: TlsSettings | None, info: ValidationInfo
    ) -> TlsSettings | None:
        # At start, one error naming the setting, not a connect failure much later.
        if value is not None and info.field_name is not None:
            check_files(value, f"GPUSCHED_{info.field_name.upper()}")
        return value

    def require_urls(self) -> tuple[str, str]:
        if not self.nats_url or not self.database_url:
            raise RuntimeError(
                "GPUSCHED_NATS_URL and GPUSCHED_DATABASE_URL must be set for a service "
                "(`gpusched up` sets them for the embedded servers)"
            )
        return self.nats_url, self.database_url
