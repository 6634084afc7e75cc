#!/usr/bin/env python3
"""Validates Kubernetes manifests offline and strictly.

    .tools/venv/bin/python scripts/validate-kubernetes.py config/kubernetes

Run it with the virtualenv that scripts/install-validators.sh makes. Each argument is a
manifest file or a directory of them (*.yaml, *.yml). Every document must pass, or the exit
status is 1 and each problem is printed as `file: kind/name: field.path: message`.

- Built-in kinds are checked with kubernetes-validate's bundled JSON schemas in strict mode
  (unknown fields are errors), against every Kubernetes version in KUBERNETES_VERSIONS.
- ServiceMonitor and PrometheusRule (monitoring.coreos.com/v1) are checked with the pydantic
  models that cloudcoil-models-prometheus-operator generates from the prometheus-operator
  CRDs, with extra fields forbidden and field names only as spelled in the CRD.
- A kind with no schema here is an error, not a warning.
- kustomization.yaml: only Kustomization fields, every listed resource exists once, and every
  manifest beside it is listed, except *.example.yaml (examples are never applied).
- YAML with a key twice in one mapping is an error (PyYAML would keep the last silently).
"""

import argparse
import os
import sys

import yaml
import kubernetes_validate
from kubernetes_validate.utils import SchemaNotFoundError, ValidationError
import pydantic
from cloudcoil.models.prometheus_operator import v1 as monitoring_v1

# The oldest and the newest version kubernetes-validate 1.37.0 ships: a manifest that passes
# both uses no field that was added after 1.25 or removed since.
KUBERNETES_VERSIONS = ["1.25.0", "1.37.0"]

CUSTOM_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): monitoring_v1.ServiceMonitor,
    ("monitoring.coreos.com/v1", "PrometheusRule"): monitoring_v1.PrometheusRule,
}

# The fields of kustomize's Kustomization (sigs.k8s.io/kustomize/api/types).
KUSTOMIZATION_FIELDS = {
    "apiVersion", "kind", "metadata", "openapi", "namePrefix", "nameSuffix", "namespace",
    "commonLabels", "labels", "commonAnnotations", "buildMetadata", "patches",
    "patchesStrategicMerge", "patchesJson6902", "images", "replacements", "replicas", "vars",
    "sortOptions", "resources", "components", "crds", "bases", "configMapGenerator",
    "secretGenerator", "helmGlobals", "helmCharts", "generatorOptions", "configurations",
    "generators", "transformers", "validators",
}
KUSTOMIZATION_NAMES = ("kustomization.yaml", "kustomization.yml", "Kustomization")


class StrictLoader(yaml.SafeLoader):
    """A SafeLoader that rejects a key given twice in one mapping."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"found duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def manifest_files(path):
    if os.path.isdir(path):
        return sorted(os.path.join(path, f) for f in os.listdir(path)
                      if f.endswith((".yaml", ".yml")))
    return [path]


def load_documents(path):
    with open(path, encoding="utf-8") as f:
        return [d for d in yaml.load_all(f, Loader=StrictLoader) if d is not None]


def name_of(doc):
    meta = doc.get("metadata") if isinstance(doc.get("metadata"), dict) else {}
    return f"{doc.get('kind', '?')}/{meta.get('name', '?')}"


def check_kustomization(path, doc):
    problems = []
    if doc.get("apiVersion") != "kustomize.config.k8s.io/v1beta1":
        problems.append("apiVersion: must be kustomize.config.k8s.io/v1beta1")
    if doc.get("kind") != "Kustomization":
        problems.append("kind: must be Kustomization")
    for key in sorted(set(doc) - KUSTOMIZATION_FIELDS):
        problems.append(f"{key}: not a Kustomization field")
    resources = doc.get("resources", [])
    if not isinstance(resources, list) or not all(isinstance(r, str) for r in resources):
        return problems + ["resources: must be a list of file names"]
    here = os.path.dirname(path)
    for r in sorted({r for r in resources if resources.count(r) > 1}):
        problems.append(f"resources: {r} is listed more than once")
    for r in resources:
        if not os.path.isfile(os.path.join(here, r)):
            problems.append(f"resources: {r} does not exist")
    listed = {os.path.normpath(r) for r in resources}
    for f in manifest_files(here):
        base = os.path.basename(f)
        if base in KUSTOMIZATION_NAMES or base.endswith((".example.yaml", ".example.yml")):
            continue
        if base not in listed:
            problems.append(f"resources: {base} is in the directory but not listed")
    return problems


def check_resource(doc):
    """Problems of one resource, as (field path, message)."""
    for key in ("apiVersion", "kind"):
        if not isinstance(doc.get(key), str):
            return [(key, "missing")]
    model = CUSTOM_KINDS.get((doc["apiVersion"], doc["kind"]))
    if model is not None:
        try:
            model.model_validate(doc, strict=True, extra="forbid", by_alias=True, by_name=False)
        except pydantic.ValidationError as e:
            return [(".".join(str(p) for p in err["loc"]), err["msg"]) for err in e.errors()]
        return []
    problems = []
    for version in KUBERNETES_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            problems.append((path, f"{e.message} (Kubernetes {version})"))
        except SchemaNotFoundError as e:
            return [("kind", e.message)]
    return problems


def validate(paths):
    errors = []
    checked = 0
    for path in paths:
        for file in manifest_files(path):
            try:
                docs = load_documents(file)
            except (OSError, yaml.YAMLError) as e:
                errors.append(f"{file}: {' '.join(str(e).split())}")
                continue
            if not docs:
                errors.append(f"{file}: no YAML document")
            for doc in docs:
                checked += 1
                if not isinstance(doc, dict):
                    errors.append(f"{file}: a document is not a mapping")
                elif os.path.basename(file) in KUSTOMIZATION_NAMES:
                    errors += [f"{file}: {p}" for p in check_kustomization(file, doc)]
                else:
                    errors += [f"{file}: {name_of(doc)}: {p}: {m}"
                               for p, m in check_resource(doc)]
    return checked, errors


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="+", metavar="PATH", help="manifest file or directory")
    args = parser.parse_args()
    checked, errors = validate(args.paths)
    for e in errors:
        print(e)
    if errors:
        print(f"{len(errors)} problem(s) in {checked} document(s)")
        return 1
    if checked == 0:
        print("no manifests found")
        return 1
    versions = ", ".join(v.rsplit(".", 1)[0] for v in KUBERNETES_VERSIONS)
    print(f"ok: {checked} document(s), strict, Kubernetes {versions}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
