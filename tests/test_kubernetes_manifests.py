"""deploy/kubernetes/: every kustomization renders; every object validates against its schema
(Kubernetes kinds with kubernetes-validate, strict; the LeaderWorkerSet, InferencePool,
InferenceObjective and HTTPRoute against their CRDs' schemas in tests/k8s_crd_schemas/); and
the pieces agree with each other and with jaxserve: the args parse with jaxserve's own CLI
parser, every pod of a LeaderWorkerSet group gets a distinct JAX process id and the leader's
address as scripts/tpu/serve.sh's `--distributed auto` would on GKE, probes and drain times
match the server's shutdown, and selectors find the pods they are meant to.

No cluster is involved: what a CRD's CEL rules or a controller's webhook would reject on
admission is not checked here.
"""

from __future__ import annotations

import copy
import os
import shlex
import subprocess

import jsonschema
import kubernetes_validate
import pytest
import yaml
from k8s_manifests import (DEPLOY, ROOT, by_kind, crd_schemas, kubectl_render, lws_pods,
                           pod_templates, render, selects, validate)

from jaxserve.entrypoints import distributed
from jaxserve.entrypoints.cli import build_parser

BASES = ("gpu", "tpu-multihost", "inference-pool", "autoscaling")
OVERLAYS = ("overlays/gpu", "overlays/tpu")
# jaxserve's worst case after SIGTERM beyond --shutdown-timeout (entrypoints/serve.py): 5 s
# for aborted requests to end, then up to 10 s for the engine thread to stop.
ENGINE_STOP_S = 15
CLUSTER_FLAGS = ("distributed", "coordinator_address", "num_processes", "process_id")


@pytest.fixture(scope="module")
def crds():
    return crd_schemas()


@pytest.fixture(scope="module")
def gpu():
    return by_kind(render(DEPLOY / "overlays/gpu"))


@pytest.fixture(scope="module")
def tpu():
    return by_kind(render(DEPLOY / "overlays/tpu"))


def serve_args(container: dict):
    """A container's args as jaxserve's CLI parses them (the image's entrypoint is jaxserve)."""
    return build_parser().parse_args(container["args"])


def prestop_seconds(container: dict) -> float:
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep", command
    return float(command[1])


@pytest.mark.parametrize("directory", BASES + OVERLAYS)
def test_every_kustomization_renders_and_validates(directory, crds):
    objects = render(DEPLOY / directory)
    assert objects, f"{directory} renders to nothing"
    for obj in objects:
        try:
            validate(obj, crds)
        except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as exc:
            pytest.fail(f"{directory}: {obj['kind']}/{obj['metadata']['name']}: {exc.message} "
                        f"at {'.'.join(map(str, exc.path))}")


def test_every_yaml_file_is_in_a_kustomization_or_a_known_values_file():
    rendered = {yaml.safe_dump(o, sort_keys=True) for d in BASES for o in render(DEPLOY / d)}
    for path in sorted(DEPLOY.rglob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        if path.name == "prometheus-adapter-values.yaml":
            assert all("kind" not in d for d in docs)
            continue
        missing = [d["metadata"]["name"] for d in docs
                   if yaml.safe_dump(d, sort_keys=True) not in rendered]
        assert not missing, f"{path} holds objects no base renders: {missing}"


@pytest.mark.parametrize("directory", BASES + OVERLAYS)
def test_this_reader_renders_what_kubectl_kustomize_does(directory):
    theirs = kubectl_render(DEPLOY / directory)
    if theirs is None:
        pytest.skip("kubectl is not on PATH (the renderer here was checked alone)")
    assert by_kind(render(DEPLOY / directory)) == by_kind(theirs)


def test_every_kind_has_a_schema_and_a_broken_field_fails(crds, gpu, tpu):
    """The validators can fail: a misspelt field is an error for every kind shipped here."""
    for obj in {**gpu, **tpu}.values():
        broken = copy.deepcopy(obj)
        broken["spec"]["replicaz" if "replicas" in obj["spec"] else "selectorr"] = 1
        with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
            validate(broken, crds)
    lws = copy.deepcopy(tpu[("LeaderWorkerSet", "jaxserve-tpu")])
    lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["argz"] = []
    with pytest.raises(AssertionError, match="argz"):
        validate(lws, crds)


def test_gpu_args_parse_and_probes_follow_the_servers_health_and_drain(gpu):
    deployment = gpu[("Deployment", "jaxserve-gpu")]
    pod = deployment["spec"]["template"]
    [container] = pod["spec"]["containers"]
    args = serve_args(container)
    assert args.command == "serve" and args.host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": args.http_port, "grpc": args.port}
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    assert container["livenessProbe"]["tcpSocket"]["port"] == "http"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(args.http_port)
    needed = prestop_seconds(container) + args.shutdown_timeout + ENGINE_STOP_S
    assert pod["spec"]["terminationGracePeriodSeconds"] >= needed
    assert selects(deployment["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    service = gpu[("Service", "jaxserve-gpu")]
    assert selects(service["spec"]["selector"], pod["metadata"]["labels"])
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(ports)


def test_the_overlays_set_each_accelerators_image(gpu, tpu):
    gpu_images = {c["image"] for o in gpu.values() for t in pod_templates(o).values()
                  for c in t["spec"]["containers"]}
    tpu_images = {c["image"] for o in tpu.values() for t in pod_templates(o).values()
                  for c in t["spec"]["containers"]}
    assert gpu_images == {"jaxserve:cuda"} and tpu_images == {"jaxserve:tpu"}


@pytest.mark.parametrize("size", [None, 4, 8])
def test_every_lws_pod_gets_a_distinct_process_id_and_the_leaders_address(tpu, size):
    lws = tpu[("LeaderWorkerSet", "jaxserve-tpu")]
    size = size or lws["spec"]["leaderWorkerTemplate"]["size"]
    pods = lws_pods(lws, size)
    settings = [distributed.settings_from_args(serve_args(pod["containers"][0]))
                for pod in pods]
    leader_address = pods[0]["containers"][0]["env"]["LWS_LEADER_ADDRESS"]
    assert leader_address == "jaxserve-tpu-0.jaxserve-tpu.default"
    assert [s.process_id for s in settings] == list(range(size))
    assert {s.num_processes for s in settings} == {size}
    assert {s.coordinator_address for s in settings} == {f"{leader_address}:8482"}
    assert all(s.enabled and not s.auto for s in settings)
    # Process 0, the one that serves, is the pod the Service and the InferencePool route to.
    service = tpu[("Service", "jaxserve-tpu")]["spec"]["selector"]
    pool = tpu[("InferencePool", "jaxserve")]["spec"]["selector"]["matchLabels"]
    assert [selects(service, p["labels"]) for p in pods] == [True] + [False] * (size - 1)
    assert [selects(pool, p["labels"]) for p in pods] == [True] + [False] * (size - 1)


def test_lws_cluster_settings_are_what_distributed_auto_finds_on_gke(tpu, monkeypatch):
    """scripts/tpu/serve.sh starts every host with --distributed auto; on GKE JAX then takes
    process i = TPU_WORKER_ID and the coordinator = the first TPU worker host at JAX's TPU
    coordinator port. Under the TPU variables the LWS controller sets, that is the same
    cluster the manifest spells out from LWS_LEADER_ADDRESS and LWS_WORKER_INDEX."""
    try:
        from jax._src.clusters import cloud_tpu_cluster as gke
        read_id, read_hosts = (gke.GkeTpuCluster._get_process_id_in_slice,
                               gke.GkeTpuCluster._get_worker_list_in_slice)
        port = gke.coordinator_port
    except (ImportError, AttributeError) as exc:
        pytest.skip(f"this jax's GKE TPU cluster detection is not where it was: {exc}")
    lws = tpu[("LeaderWorkerSet", "jaxserve-tpu")]
    for pod in lws_pods(lws, lws["spec"]["leaderWorkerTemplate"]["size"]):
        env = pod["containers"][0]["env"]
        ours = distributed.settings_from_args(serve_args(pod["containers"][0]))
        monkeypatch.delenv("TPU_PROCESS_ADDRESSES", raising=False)
        monkeypatch.setenv("TPU_WORKER_HOSTNAMES", env["TPU_WORKER_HOSTNAMES"])
        monkeypatch.setenv("TPU_WORKER_ID", env["TPU_WORKER_ID"])
        host, our_port = ours.coordinator_address.rsplit(":", 1)
        assert ours.process_id == read_id(), pod["name"]
        assert ours.num_processes == len(read_hosts())
        # The same pod: LWS_LEADER_ADDRESS is the first TPU host's name with its namespace.
        assert host.startswith(read_hosts()[0] + "."), (host, read_hosts())
        assert our_port == port


def test_lws_serve_flags_are_serve_sh_multihost_flags_with_explicit_cluster_flags(tpu,
                                                                                  tmp_path):
    lws = tpu[("LeaderWorkerSet", "jaxserve-tpu")]
    lwt = lws["spec"]["leaderWorkerTemplate"]
    leader = lwt["leaderTemplate"]["spec"]["containers"][0]
    worker = lwt["workerTemplate"]["spec"]["containers"][0]
    assert leader["args"] == worker["args"], "followers must build the leader's engine"
    ours = vars(serve_args(lws_pods(lws, lwt["size"])[0]["containers"][0]))
    script = serve_sh_args(tmp_path, "--multihost", "--model", ours["model"],
                           "--tensor-parallel-size", str(ours["tensor_parallel_size"]),
                           "--port", str(ours["port"]))
    theirs = vars(build_parser().parse_args(script))
    assert theirs["distributed"] == "auto" and ours["distributed"] == "off"
    differ = {k for k in ours if ours[k] != theirs.get(k)}
    assert differ == set(CLUSTER_FLAGS), differ
    chips = leader["resources"]["limits"]["google.com/tpu"]
    assert worker["resources"]["limits"]["google.com/tpu"] == chips
    assert ours["tensor_parallel_size"] == lwt["size"] * chips


def serve_sh_args(tmp_path, *flags: str) -> list[str]:
    """jaxserve's argv in what `scripts/tpu/serve.sh --dry-run FLAGS` would start."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "gcloud").write_text("#!/bin/sh\nexit 1\n")
    (fake_bin / "gcloud").chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if k not in ("MODEL", "TENSOR_PARALLEL_SIZE", "MULTIHOST", "PORT", "DRY_RUN")}
    out = subprocess.run([str(ROOT / "scripts/tpu/serve.sh"), "--dry-run", *flags],
                         capture_output=True, text=True, check=True, timeout=60, cwd=tmp_path,
                         env={**env, "PATH": f"{fake_bin}:{env['PATH']}"}).stdout
    start = next(line for line in out.splitlines() if "nohup" in line)
    remote = next(w for w in shlex.split(start) if w.startswith("--command="))
    words = shlex.split(remote.removeprefix("--command="))
    return words[words.index("jaxserve.entrypoints.cli") + 1:words.index(">")]


def test_tpu_drain_outlasts_on_every_host(tpu):
    lwt = tpu[("LeaderWorkerSet", "jaxserve-tpu")]["spec"]["leaderWorkerTemplate"]
    assert lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader_pod, worker_pod = lwt["leaderTemplate"]["spec"], lwt["workerTemplate"]["spec"]
    leader, worker = leader_pod["containers"][0], worker_pod["containers"][0]
    args = serve_args(lws_pods(tpu[("LeaderWorkerSet", "jaxserve-tpu")], 2)[0]["containers"][0])
    leader_done = prestop_seconds(leader) + args.shutdown_timeout + ENGINE_STOP_S
    assert prestop_seconds(worker) >= leader_done
    assert leader_pod["terminationGracePeriodSeconds"] >= leader_done
    assert worker_pod["terminationGracePeriodSeconds"] >= prestop_seconds(worker)
    assert leader["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert not any(p in worker for p in ("readinessProbe", "livenessProbe", "startupProbe")), \
        "a follower listens on no port"
    assert leader_pod["nodeSelector"] == worker_pod["nodeSelector"]
    assert lwt.get("size", 1) > 1


def test_inference_pool_objective_route_and_hpa_refer_to_each_other(gpu):
    pool = gpu[("InferencePool", "jaxserve")]
    pod = gpu[("Deployment", "jaxserve-gpu")]["spec"]["template"]
    assert selects(pool["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    http_port = serve_args(pod["spec"]["containers"][0]).http_port
    assert pool["spec"]["targetPorts"] == [{"number": http_port}]
    objective = gpu[("InferenceObjective", "jaxserve-interactive")]
    assert objective["spec"]["poolRef"] == {"group": "inference.networking.k8s.io",
                                            "name": "jaxserve"}
    [rule] = gpu[("HTTPRoute", "jaxserve")]["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io",
                                    "kind": "InferencePool", "name": "jaxserve"}]
    hpa = gpu[("HorizontalPodAutoscaler", "jaxserve-gpu")]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                     "name": "jaxserve-gpu"}
    [metric] = hpa["metrics"]
    values = yaml.safe_load((DEPLOY / "autoscaling/prometheus-adapter-values.yaml").read_text())
    [adapter_rule] = values["rules"]["custom"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == adapter_rule["name"]["as"]
    assert adapter_rule["seriesQuery"].startswith("vllm:num_requests_waiting{")
    assert "vllm:num_requests_waiting{<<.LabelMatchers>>}" in adapter_rule["metricsQuery"]
    assert set(adapter_rule["resources"]["overrides"]) == {"namespace", "pod"}
