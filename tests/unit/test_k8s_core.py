"""The Kubernetes agent's pure core: Node and Pod objects in, decisions out, no I/O."""

from __future__ import annotations

import base64
import copy
import json
from pathlib import Path
from typing import Any

import pytest
from tests.support.kubeapi import json_patch
from tests.support.kubelet import gpu_node, training_pod

from gpusched.agent.kubernetes import labels as L
from gpusched.agent.kubernetes import mig
from gpusched.agent.kubernetes.app import AgentMisconfigured, pod_nats_ca
from gpusched.agent.kubernetes.nodes import (
    Action,
    KnownNode,
    NodeProblem,
    observe,
    reconcile,
)
from gpusched.agent.kubernetes.pods import (
    DraNames,
    GangMismatch,
    PodRefused,
    Progress,
    assign_gang,
    claim_allocation,
    crowd_refusal,
    crowded_controllers,
    gang_outcome,
    job_secret,
    outcome,
    read_pod,
    submission,
    successor,
    successor_suffix,
    team_of_namespace,
)
from gpusched.agent.kubernetes.quantity import QuantityError, count, mebibytes, milli
from gpusched.agent.kubernetes.webhook import review_response, wired
from gpusched.contracts.messages import GpuRef, NodeState, StopReason
from gpusched.infra.tls import TlsSettings


def _pod(name: str = "train", **kw: Any) -> dict[str, Any]:
    pod = training_pod(name, team="vision", priority="p2-offline", gpus=kw.pop("gpus", 4),
                       checkpoint_dir=Path("/ckpt"), extra=kw.pop("labels", None))  # fmt: skip
    pod["metadata"].update({"namespace": "ml", "uid": f"uid-{name}"})
    pod["metadata"]["annotations"].update(kw.pop("annotations", {}))
    return pod


# --- quantities -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "cpu"), [("64", 64000), ("63500m", 63500), ("0.5", 500), ("2e3", 2_000_000)]
)
def test_cpu_quantities_read_as_millicores(text: str, cpu: int) -> None:
    assert milli(text) == cpu


def test_memory_quantities_read_as_mebibytes() -> None:
    assert mebibytes("1056Gi") == 1056 * 1024
    assert mebibytes("131072Ki") == 128
    assert mebibytes("1G") == 953


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "-1", "1.5", "lots", "", None, True])
def test_a_gpu_count_that_is_not_a_whole_number_is_refused(bad: Any) -> None:
    with pytest.raises(QuantityError):
        count(bad)


# --- nodes ----------------------------------------------------------------------------------
def test_a_labelled_gpu_node_becomes_an_inventory_node_with_its_gfd_model() -> None:
    node = observe(gpu_node("g1", "shared", 8), "gpusched.io/pool")
    assert node is not None
    assert node.spec == {
        "name": "g1", "pool": "shared", "gpu_model": "A100-80GB", "gpus": 8,
        "cpu_milli": 127500, "memory_mib": 1048576, "gpu_memory_mib": 81920,
    }  # fmt: skip
    assert node.ready and not node.cordoned and not node.deleting


def test_nodes_without_the_pool_label_or_without_gpus_stay_with_the_default_scheduler() -> None:
    unlabelled = gpu_node("g1", "shared")
    del unlabelled["metadata"]["labels"]["gpusched.io/pool"]
    assert observe(unlabelled, "gpusched.io/pool") is None
    cpu_only = gpu_node("c1", "shared")
    cpu_only["status"]["allocatable"].pop("nvidia.com/gpu")
    cpu_only["metadata"]["labels"].pop("nvidia.com/gpu.count")
    assert observe(cpu_only, "gpusched.io/pool") is None


def test_a_node_in_an_unknown_pool_is_a_problem_that_names_the_node() -> None:
    with pytest.raises(NodeProblem, match="g1"):
        observe(gpu_node("g1", "gaming"), "gpusched.io/pool")


def test_a_node_with_mig_resources_is_a_mig_node() -> None:
    node = gpu_node("g1", "inference")
    node["status"]["allocatable"]["nvidia.com/mig-1g.10gb"] = "7"
    observed = observe(node, "gpusched.io/pool")
    assert observed is not None and observed.spec["mig"] is True


def test_a_mig_layout_that_moves_gpus_to_slice_resources_keeps_the_nodes_gpu_count() -> None:
    # The MIG manager's mixed strategy: GPU 0 in MIG mode, seven whole GPUs advertised.
    node = gpu_node("g1", "inference")
    node["status"]["allocatable"].update(
        {"nvidia.com/gpu": "7", "nvidia.com/mig-2g.20gb": "3", "nvidia.com/mig-1g.10gb": "1"}
    )
    observed = observe(node, "gpusched.io/pool")
    assert observed is not None and observed.gpus == 8
    assert reconcile({"g1": observed}, {"g1": _known(NodeState.UP, pool="inference")}) == []


def test_a_node_gpu_feature_discovery_says_is_not_mig_capable_is_not_a_mig_node() -> None:
    node = gpu_node("g1", "inference")
    node["metadata"]["labels"][L.GFD_MIG_CAPABLE] = "false"
    observed = observe(node, "gpusched.io/pool")
    assert observed is not None and observed.spec["mig"] is False


def _known(state: NodeState, gpus: int = 8, pool: str = "shared") -> KnownNode:
    return KnownNode({"pool": pool, "gpu_model": "A100-80GB", "gpus": gpus}, state)


def _observed(
    name: str, *, ready: bool = True, cordoned: bool = False, pool: str = "shared"
) -> Any:
    node = gpu_node(name, pool, ready=ready)
    node["spec"]["unschedulable"] = cordoned
    return observe(node, "gpusched.io/pool")


@pytest.mark.parametrize(
    ("observed", "state", "expected"),
    [
        (dict(), None, Action.ADD),
        (dict(cordoned=True), NodeState.UP, Action.DRAIN),
        (dict(), NodeState.DRAINED, Action.UNDRAIN),
        (dict(ready=False), NodeState.UP, Action.FAIL),
        (dict(ready=False), NodeState.DRAINED, Action.FAIL),
        (dict(), NodeState.FAILED, Action.RECOVER),
        (dict(pool="inference"), NodeState.UP, Action.DRAIN),
        (dict(pool="inference"), NodeState.DRAINED, Action.REMOVE),
    ],
)
def test_each_node_condition_becomes_the_lifecycle_change_admission_understands(
    observed: dict[str, Any], state: NodeState | None, expected: Action
) -> None:
    cluster = {"g1": _observed("g1", **observed)}
    admission = {} if state is None else {"g1": _known(state)}
    [step] = reconcile(cluster, admission)
    assert step.action is expected and step.node == "g1"


def test_a_deleted_node_is_failed_first_then_removed() -> None:
    [first] = reconcile({}, {"g1": _known(NodeState.UP)})
    [second] = reconcile({}, {"g1": _known(NodeState.FAILED)})
    assert (first.action, second.action) == (Action.FAIL, Action.REMOVE)


def test_nodes_that_agree_need_nothing() -> None:
    assert reconcile({"g1": _observed("g1")}, {"g1": _known(NodeState.UP)}) == []
    cordoned = {"g1": _observed("g1", cordoned=True)}
    assert reconcile(cordoned, {"g1": _known(NodeState.DRAINED)}) == []


# --- pods -----------------------------------------------------------------------------------
def test_a_pod_reads_as_a_job_with_its_team_class_and_gpus() -> None:
    pod = read_pod(_pod(gpus=4))
    assert (pod.team, pod.priority_class.value, pod.gpus, pod.checkpointable) == (
        "vision", "p2-offline", 4, True,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda p: p["metadata"]["labels"].pop(L.TEAM), "gpusched.io/team is missing"),
        (lambda p: p["metadata"]["labels"].update({L.PRIORITY_CLASS: "p9"}), "not one of"),
        (lambda p: p["metadata"]["labels"].update({L.GANG: "g", L.GANG_SIZE: "-1"}), "whole"),
        (lambda p: p["metadata"]["labels"].update({L.GANG_SIZE: "2"}), "needs gpusched.io/gang"),
        (lambda p: p["metadata"]["annotations"].update({L.CHECKPOINT_SECONDS: "NaN"}), "decimal"),
        (lambda p: p["metadata"]["annotations"].update({L.CHECKPOINT_SECONDS: "1e400"}), "decimal"),
        (lambda p: p["metadata"]["annotations"].update({L.CHECKPOINTABLE: "yes"}), '"true"'),
        (lambda p: p["spec"]["containers"][0]["resources"].clear(), "no GPUs asked"),
        (lambda p: p["spec"]["containers"][0]["resources"]["limits"].update(
            {"nvidia.com/gpu": "Infinity"}), "not a quantity"),
    ],
)  # fmt: skip
def test_a_pod_gpusched_cannot_run_is_refused_with_the_label_to_fix(
    change: Any, message: str
) -> None:
    pod = _pod()
    change(pod)
    with pytest.raises(PodRefused, match=message):
        read_pod(pod)


def test_a_gang_is_one_job_of_all_its_pods_gpus_and_a_stable_key() -> None:
    objs = [_pod(f"w{i}", labels={L.GANG: "llm", L.GANG_SIZE: "2"}) for i in range(2)]
    job = submission([read_pod(o) for o in objs], objs)
    assert (job.name, job.gpus.count, job.gang) == ("llm", 8, True)
    assert job.workload.kind == "pod" and job.workload.pod is not None
    assert len(job.workload.pod["pods"]) == 2
    again = submission([read_pod(o) for o in reversed(objs)], objs)
    assert again.idempotency_key == job.idempotency_key


def test_a_jobs_pods_share_the_key_of_their_controller_across_attempts() -> None:
    first, second = _pod("job-abc"), _pod("job-def")
    for p in (first, second):
        p["metadata"]["ownerReferences"] = [
            {"kind": "Job", "name": "job", "uid": "J1", "controller": True}
        ]
    assert (
        submission([read_pod(first)], [first]).idempotency_key
        == submission([read_pod(second)], [second]).idempotency_key
        == "k8s/J1"
    )


def test_a_controllers_several_pods_outside_a_gang_are_refused_saying_how_to_write_them() -> None:
    def owned(name: str, uid: str, **labels: str) -> Any:
        pod = _pod(name, labels=labels)
        pod["metadata"]["ownerReferences"] = [
            {"kind": "ReplicaSet", "name": f"rs-{uid}", "uid": uid, "controller": True}
        ]
        return read_pod(pod)

    crowded = crowded_controllers(
        [owned("web-1", "R1"), owned("web-2", "R1"), owned("job-1", "J1"),
         owned("w-0", "S1", **{L.GANG: "g", L.GANG_SIZE: "2"}),
         owned("w-1", "S1", **{L.GANG: "g", L.GANG_SIZE: "2"}), read_pod(_pod("alone"))]
    )  # fmt: skip
    assert set(crowded) == {"R1"}
    message = crowd_refusal(crowded["R1"])
    assert "ReplicaSet rs-R1" in message and L.REPLICAS in message and L.GANG in message


def _status(phase: str, **extra: Any) -> dict[str, Any]:
    return {"status": {"phase": phase, **extra}}


def _terminated(code: int, reason: str) -> dict[str, Any]:
    return {
        "containerStatuses": [
            {"name": "train", "state": {"terminated": {"exitCode": code, "reason": reason}}}
        ]
    }


def test_pod_phases_and_terminations_become_workload_outcomes() -> None:
    assert outcome(_status("Pending")).progress is Progress.WAITING
    assert outcome(_status("Running")).progress is Progress.RUNNING
    assert outcome(_status("Succeeded")).reason is StopReason.COMPLETED
    oom = outcome(_status("Failed", **_terminated(137, "OOMKilled")))
    assert (oom.reason, oom.exit_code) == (StopReason.FAILED, 137) and "OOM" in (oom.error or "")
    crash = outcome(_status("Failed", **_terminated(3, "Error")))
    assert (crash.reason, crash.exit_code) == (StopReason.FAILED, 3)
    lost = outcome(_status("Failed", reason="NodeLost", message="node vanished"))
    assert lost.reason is StopReason.INTERRUPTED
    disrupted = outcome(_status("Failed", conditions=[
        {"type": "DisruptionTarget", "status": "True", "reason": "DeletionByTaintManager"}
    ], **_terminated(143, "Error")))  # fmt: skip
    assert disrupted.reason is StopReason.INTERRUPTED


def test_a_gang_runs_when_all_run_and_fails_when_one_fails() -> None:
    running, waiting = outcome(_status("Running")), outcome(_status("Pending"))
    failed = outcome(_status("Failed", **_terminated(1, "Error")))
    done = outcome(_status("Succeeded"))
    assert gang_outcome([running, waiting]).progress is Progress.WAITING
    assert gang_outcome([running, running]).progress is Progress.RUNNING
    assert gang_outcome([running, failed]).reason is StopReason.FAILED
    assert gang_outcome([done, done]).reason is StopReason.COMPLETED


def _gpus(*refs: tuple[str, int]) -> list[GpuRef]:
    return [GpuRef(node=n, index=i, model="A100-80GB") for n, i in refs]


def test_a_gangs_pods_each_get_whole_gpus_of_one_node_from_admissions_choice() -> None:
    pods = [read_pod(_pod(f"w{i}", gpus=4)) for i in range(2)]
    placed = assign_gang(
        pods, _gpus(*[("a", i) for i in range(4)], *[("b", i) for i in range(4, 8)])
    )
    assert sorted(placed.values()) == [("a", (0, 1, 2, 3)), ("b", (4, 5, 6, 7))]


def test_a_placement_that_splits_a_pod_across_nodes_is_a_mismatch() -> None:
    pods = [read_pod(_pod(f"w{i}", gpus=4)) for i in range(2)]
    with pytest.raises(GangMismatch, match="on one node"):
        assign_gang(pods, _gpus(*[("a", i) for i in range(6)], ("b", 0), ("b", 1)))
    with pytest.raises(GangMismatch, match="ask for 8"):
        assign_gang(pods, _gpus(("a", 0)))


def test_the_claim_names_exactly_the_devices_admission_chose() -> None:
    status = claim_allocation(_pod(), "a", (2, 5), None, DraNames())
    devices = [r["device"] for r in status["allocation"]["devices"]["results"]]
    assert devices == ["gpu-2", "gpu-5"]
    assert status["reservedFor"][0]["uid"] == "uid-train"


def test_a_later_attempt_is_the_same_pod_without_its_node_and_handle() -> None:
    pod = wired(_pod(), "gpusched-aaaa")
    pod["spec"]["nodeName"] = "a"
    nxt = successor(pod, "a3", "job-1")
    assert nxt["metadata"]["name"] == "train-a3" and "uid" not in nxt["metadata"]
    assert "nodeName" not in nxt["spec"]
    assert nxt["metadata"]["annotations"][L.JOB_ID] == "job-1"
    assert successor(nxt, "a4", "job-1")["metadata"]["name"] == "train-a4"
    assert successor(nxt, "r7", "job-1")["metadata"]["name"] == "train-r7"


def test_a_replica_pod_is_named_after_its_allocation_and_a_later_attempt_after_its_number() -> None:
    assert successor_suffix("job-abc-r12", 1, replicas=True) == "r12"
    assert successor_suffix("job-abc-r12", 3, replicas=False) == "a3"
    odd = successor_suffix("alloc-xyz", 1, replicas=True)
    assert odd.startswith("r") and odd == successor_suffix("alloc-xyz", 2, replicas=True)


def test_an_inference_pod_with_replicas_is_a_service_of_that_many_replicas() -> None:
    pod = _pod("web", gpus=1, labels={L.KIND: "inference", L.REPLICAS: "2:4"})
    pod["metadata"]["labels"][L.PRIORITY_CLASS] = "inference"
    job = submission([read_pod(pod)], [pod])
    assert job.replicas is not None and (job.replicas.min, job.replicas.max) == (2, 4)
    assert job.workload.pod is not None and job.workload.pod["replicas"] is True
    fixed = _pod("web", gpus=1, labels={L.KIND: "inference", L.REPLICAS: "3"})
    assert read_pod(fixed).replicas == (3, 3)


@pytest.mark.parametrize(
    ("labels", "message"),
    [
        ({L.REPLICAS: "2"}, "for inference services"),
        ({L.KIND: "inference", L.REPLICAS: "4:2"}, "MIN must not exceed MAX"),
        ({L.KIND: "inference", L.REPLICAS: "0"}, "between 1 and 1024"),
        ({L.KIND: "inference", L.REPLICAS: "1:2:3"}, "MIN:MAX"),
        ({L.KIND: "inference", L.REPLICAS: "2", L.GANG: "g", L.GANG_SIZE: "2"}, "gang"),
    ],
)
def test_replicas_that_make_no_sense_are_refused_with_the_label_to_fix(
    labels: dict[str, str], message: str
) -> None:
    with pytest.raises(PodRefused, match=message):
        read_pod(_pod("web", gpus=1, labels=labels))


def test_a_namespaces_team_is_the_operators_mapping_else_its_label_else_none() -> None:
    assert team_of_namespace("ml", {"ml": "vision"}, "nlp") == "vision"
    assert team_of_namespace("ml", {}, "nlp") == "nlp"
    with pytest.raises(PodRefused, match=r"kubectl label namespace ml gpusched\.io/team=<team>"):
        team_of_namespace("ml", {"other": "vision"}, None)


# --- the webhook ----------------------------------------------------------------------------
def test_the_webhook_wires_secret_env_credentials_and_claim_without_any_secret_value() -> None:
    pod = _pod(gpus=4)
    out = wired(pod, "gpusched-abc")
    container = out["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in container["resources"]["limits"]
    assert container["resources"]["claims"] == [{"name": L.POD_GPU_CLAIM}]
    assert out["spec"]["resourceClaims"] == [
        {"name": L.POD_GPU_CLAIM, "resourceClaimName": "gpusched-abc"}
    ]
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]}
    assert env["GPUSCHED_JOB_ID"] == {
        "name": "gpusched-abc",
        "key": "GPUSCHED_JOB_ID",
        "optional": True,
    }
    assert out["metadata"]["annotations"][L.GPUS] == "4"
    # Wiring a wired pod (a later attempt) gives the same shape under the new handle.
    again = wired(out, "gpusched-def")
    assert json.dumps(again).count("gpusched-abc") == 0
    assert again["metadata"]["annotations"][L.GPUS] == "4"


def test_the_webhook_labels_the_pod_a_nats_client_and_mounts_the_ca_with_the_credentials() -> None:
    out = wired(_pod(), "gpusched-abc")
    # The install's NetworkPolicy admits pods with this label to NATS (deploy/k8s).
    assert out["metadata"]["labels"][L.NATS_CLIENT] == "true"
    assert out["metadata"]["labels"][L.TEAM] == "vision"
    [volume] = [v for v in out["spec"]["volumes"] if v["name"] == "gpusched"]
    assert volume["secret"]["optional"] is True  # the CA key is there only with TLS
    assert {i["key"]: i["path"] for i in volume["secret"]["items"]} == {
        L.CREDENTIALS_KEY: L.CREDENTIALS_KEY,
        L.NATS_CA_KEY: L.NATS_CA_KEY,
    }
    env = {e["name"] for e in out["spec"]["containers"][0]["env"]}
    assert "GPUSCHED_NATS_TLS__CA_FILE" in env


def test_a_jobs_secret_holds_the_nats_ca_only_when_there_is_one() -> None:
    pod = _pod()
    pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    environ = {"GPUSCHED_NATS_TLS__CA_FILE": f"{L.SECRET_MOUNT}/{L.NATS_CA_KEY}"}
    secret = job_secret(pod, "gpusched-abc", environ, "creds", pem)
    assert base64.b64decode(secret["data"][L.NATS_CA_KEY]).decode() == pem
    assert base64.b64decode(secret["data"]["GPUSCHED_NATS_TLS__CA_FILE"]).decode() == (
        "/var/run/gpusched/nats-ca.crt"
    )
    assert L.NATS_CA_KEY not in job_secret(pod, "gpusched-abc", {}, "creds")["data"]


def test_the_pods_nats_ca_is_the_one_given_else_the_agents_own_and_must_be_a_pem(
    tmp_path: Path,
) -> None:
    pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    given, own = tmp_path / "pods-ca.crt", tmp_path / "ca.crt"
    given.write_text(pem + "given")
    own.write_text(pem)
    assert pod_nats_ca(given, TlsSettings(ca_file=own)) == pem + "given"
    assert pod_nats_ca(None, TlsSettings(ca_file=own)) == pem
    assert pod_nats_ca(None, None) is None
    assert pod_nats_ca(None, TlsSettings()) is None
    own.write_text("not a certificate")
    with pytest.raises(AgentMisconfigured, match=r"GPUSCHED_NATS_TLS__CA_FILE: .* no PEM"):
        pod_nats_ca(None, TlsSettings(ca_file=own))
    with pytest.raises(AgentMisconfigured, match=r"POD_NATS_CA_FILE: cannot read the CA"):
        pod_nats_ca(tmp_path / "missing.crt", None)
    with pytest.raises(AgentMisconfigured, match=r"POD_NATS_CA_FILE: cannot read .*device"):
        pod_nats_ca(Path("/dev/zero"), None)


def test_the_admission_review_patch_turns_the_pod_into_the_wired_pod() -> None:
    pod = _pod()
    review = {"request": {"uid": "u1", "operation": "CREATE", "object": copy.deepcopy(pod)}}
    answer = review_response(review, "gpusched")["response"]
    assert answer["allowed"] and answer["uid"] == "u1" and answer["patchType"] == "JSONPatch"
    patched = json_patch(pod, json.loads(base64.b64decode(answer["patch"])))
    handle = patched["metadata"]["annotations"][L.HANDLE]
    assert patched == wired(pod, handle)


def test_the_webhook_refuses_a_bad_gpusched_pod_and_ignores_other_schedulers() -> None:
    bad = _pod()
    del bad["metadata"]["labels"][L.TEAM]
    answer = review_response(
        {"request": {"uid": "u", "operation": "CREATE", "object": bad}}, "gpusched"
    )
    assert not answer["response"]["allowed"]
    assert "gpusched.io/team" in answer["response"]["status"]["message"]
    other = _pod()
    other["spec"]["schedulerName"] = "default-scheduler"
    answer = review_response(
        {"request": {"uid": "u", "operation": "CREATE", "object": other}}, "gpusched"
    )
    assert answer["response"] == {"uid": "u", "allowed": True}


# --- MIG ------------------------------------------------------------------------------------
def test_a_node_layout_becomes_one_named_mig_parted_config() -> None:
    layouts = {0: ["1g.10gb"] * 7, 1: []}
    assert mig.config_name(layouts) == mig.config_name({1: [], 0: ["1g.10gb"] * 7})
    assert mig.config_name(layouts) != mig.config_name({0: [], 1: []})
    assert mig.mig_parted(layouts) == [
        {"devices": [0], "mig-enabled": True, "mig-devices": {"1g.10gb": 7}},
        {"devices": [1], "mig-enabled": False},
    ]
