"""Extract the openAPIV3Schema of one version of a CustomResourceDefinition into the JSON file
tests/test_kubernetes_manifests.py validates deploy/kubernetes/ against (kubernetes-validate
carries only Kubernetes' own kinds).

Descriptions are dropped (size); every other keyword is kept as the CRD has it. A schema under
--pod-template (a dotted path of property names, e.g.
spec.leaderWorkerTemplate.workerTemplate) is replaced by a marker object: the test checks those
PodTemplateSpecs against Kubernetes' own schema instead of the CRD's copy of it. This script
reads local files only and changes nothing but OUT.

  python scripts/k8s_crd_schemas.py CRD.yaml v1 OUT.json --source "owner/repo TAG path"
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

POD_TEMPLATE_MARKER = {"type": "object", "x-jaxserve-pod-template-spec": True}


def strip_descriptions(node):
    if isinstance(node, dict):
        return {key: strip_descriptions(value) for key, value in node.items()
                if not (key == "description" and isinstance(value, str))}
    if isinstance(node, list):
        return [strip_descriptions(value) for value in node]
    return node


def replace_at(schema: dict, dotted: str, marker: dict) -> None:
    node = schema
    names = dotted.split(".")
    for name in names[:-1]:
        node = node["properties"][name]
    if names[-1] not in node.get("properties", {}):
        raise KeyError(f"--pod-template {dotted}: no property {names[-1]!r} there")
    node["properties"][names[-1]] = marker


def extract(crd: dict, version: str, source: str, pod_templates: list[str]) -> dict:
    if crd.get("kind") != "CustomResourceDefinition":
        raise ValueError(f"not a CustomResourceDefinition: kind {crd.get('kind')!r}")
    spec = crd["spec"]
    found = [v for v in spec["versions"] if v["name"] == version]
    if not found:
        raise ValueError(f"version {version!r} not in {[v['name'] for v in spec['versions']]}")
    schema = strip_descriptions(found[0]["schema"]["openAPIV3Schema"])
    for dotted in pod_templates:
        replace_at(schema, dotted, POD_TEMPLATE_MARKER)
    schema["$comment"] = (f"openAPIV3Schema of {spec['names']['kind']} "
                          f"{spec['group']}/{version}, from {source}; descriptions dropped"
                          + (f"; PodTemplateSpecs at {', '.join(pod_templates)} replaced by a "
                             "marker" if pod_templates else ""))
    return {"group": spec["group"], "version": version, "kind": spec["names"]["kind"],
            "schema": schema}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("crd", type=Path, help="the CRD's YAML file")
    parser.add_argument("version", help="the version to extract, e.g. v1")
    parser.add_argument("out", type=Path, help="the JSON file to write")
    parser.add_argument("--source", required=True,
                        help="where the CRD came from (repository, tag, path), kept in the file")
    parser.add_argument("--pod-template", action="append", default=[],
                        help="a dotted property path holding a PodTemplateSpec (repeatable)")
    args = parser.parse_args(argv)
    crd = next(doc for doc in yaml.safe_load_all(args.crd.read_text()) if doc)
    out = extract(crd, args.version, args.source, args.pod_template)
    args.out.write_text(json.dumps(out, sort_keys=True, separators=(",", ":")) + "\n")
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
