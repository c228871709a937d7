"""Helpers for tests/test_kubernetes_manifests.py: render deploy/kubernetes/ kustomizations,
validate objects against Kubernetes' schemas (kubernetes-validate) or the CRD schemas kept in
tests/k8s_crd_schemas/, and simulate what the LeaderWorkerSet controller and the kubelet give
each pod of a group (its environment, then its args with $(VAR) expanded).

Rendering here applies only what these kustomizations use (resources, images) and refuses any
other key, so a kustomization this reader cannot follow fails loudly; where `kubectl` is on
PATH the tests also compare with `kubectl kustomize`. Nothing here talks to a cluster.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy" / "kubernetes"
CRD_SCHEMAS = Path(__file__).resolve().parent / "k8s_crd_schemas"
KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "images"}
# Kubernetes versions validated against: the oldest this directory claims, and the newest
# kubernetes-validate has.
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())
POD_TEMPLATE_MARKER = "x-jaxserve-pod-template-spec"


def render(directory: Path) -> list[dict]:
    """The objects `kustomize build directory` would emit (unordered)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - KUSTOMIZATION_KEYS
    if unknown:
        raise ValueError(f"{directory}/kustomization.yaml: keys {sorted(unknown)} are not "
                         f"applied by this reader (it knows {sorted(KUSTOMIZATION_KEYS)})")
    objects = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            objects += render(path)
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for image in kustomization.get("images", []):
        for container in _containers(objects):
            name = container["image"].split("@")[0].rsplit(":", 1)[0]
            if name == image["name"]:
                container["image"] = (image.get("newName", name)
                                      + (f":{image['newTag']}" if "newTag" in image else ""))
    return objects


def kubectl_render(directory: Path) -> list[dict] | None:
    """`kubectl kustomize directory`'s objects, or None without kubectl."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return None
    out = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def by_kind(objects: list[dict]) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def pod_templates(obj: dict) -> dict[str, dict]:
    """The PodTemplateSpecs an object holds, by where they sit."""
    spec = obj.get("spec", {})
    if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return {"spec.template": spec["template"]}
    if obj["kind"] == "LeaderWorkerSet":
        lwt = spec["leaderWorkerTemplate"]
        return {f"spec.leaderWorkerTemplate.{k}": lwt[k]
                for k in ("leaderTemplate", "workerTemplate") if k in lwt}
    return {}


def _containers(objects: list[dict]):
    for obj in objects:
        for template in pod_templates(obj).values():
            yield from template["spec"]["containers"]


# --- validation ----------------------------------------------------------------------------

def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the kept CRD schema, made strict (see strict)."""
    out = {}
    for path in sorted(CRD_SCHEMAS.glob("*.json")):
        kept = json.loads(path.read_text())
        out[(f"{kept['group']}/{kept['version']}", kept["kind"])] = strict(kept["schema"])
    return out


def strict(schema):
    """The schema with unknown fields rejected, as `kubectl apply` (strict field validation)
    rejects them: every object schema that lists properties and neither allows extra ones
    nor preserves unknown fields gets additionalProperties: false."""
    schema = copy.deepcopy(schema)

    def close(node):
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)

    close(schema)
    return schema


def validate(obj: dict, crds: dict) -> str:
    """Raise when obj breaks its schema; returns what it was checked against."""
    key = (obj["apiVersion"], obj["kind"])
    if key in crds:
        jsonschema.Draft7Validator(crds[key]).validate(obj)
        for where, template in pod_templates(obj).items():
            validate_pod_template(template, where)
        return f"CRD schema {key[0]} {key[1]}"
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)
    return f"kubernetes-validate {', '.join(K8S_VERSIONS)} (strict)"


def validate_pod_template(template: dict, where: str) -> None:
    """A PodTemplateSpec inside a custom resource, against Kubernetes' own PodTemplate."""
    wrapper = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "check"},
               "template": template}
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(wrapper, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{where}: {exc.message} at "
                                 f"{'.'.join(map(str, exc.path))}") from exc


# --- what a LeaderWorkerSet pod gets --------------------------------------------------------

def lws_pods(lws: dict, size: int, group: int = 0, namespace: str = "default") -> list[dict]:
    """One group's pods as the LeaderWorkerSet controller makes them (default shared subdomain:
    the LWS name): name, worker index, labels, and every container's env, the LWS variables
    first (LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, LWS_WORKER_INDEX) and, in containers that
    request google.com/tpu, the TPU variables JAX's GKE detection reads (TPU_WORKER_HOSTNAMES,
    TPU_WORKER_ID), as the controller's pod webhook computes them."""
    name = lws["metadata"]["name"]
    lwt = lws["spec"]["leaderWorkerTemplate"]
    leader = f"{name}-{group}"
    subdomain = name
    hostnames = [f"{leader}.{subdomain}"] + [f"{leader}-{i}.{subdomain}"
                                             for i in range(1, size)]
    pods = []
    for index in range(size):
        template = lwt["leaderTemplate"] if index == 0 and "leaderTemplate" in lwt \
            else lwt["workerTemplate"]
        labels = dict(template.get("metadata", {}).get("labels", {}))
        labels.update({"leaderworkerset.sigs.k8s.io/name": name,
                       "leaderworkerset.sigs.k8s.io/group-index": str(group),
                       "leaderworkerset.sigs.k8s.io/worker-index": str(index)})
        containers = []
        for container in template["spec"]["containers"]:
            env = {"LWS_LEADER_ADDRESS": f"{leader}.{subdomain}.{namespace}",
                   "LWS_GROUP_SIZE": str(size), "LWS_WORKER_INDEX": str(index)}
            if "google.com/tpu" in container.get("resources", {}).get("limits", {}):
                env.update({"TPU_WORKER_HOSTNAMES": ",".join(hostnames),
                            "TPU_WORKER_ID": str(index)})
            for var in container.get("env", []):
                if "value" in var and var["name"] not in env:
                    env[var["name"]] = expand(var["value"], env)
            containers.append({"name": container["name"], "env": env,
                               "args": [expand(a, env) for a in container.get("args", [])]})
        pods.append({"name": leader if index == 0 else f"{leader}-{index}",
                     "worker_index": index, "labels": labels, "containers": containers})
    return pods


_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion of a container's command, args and env values: $(VAR)
    becomes VAR's value when VAR is defined and stays as written otherwise; $$ is a $."""
    def one(match):
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))
    return _REFERENCE.sub(one, text)


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())
