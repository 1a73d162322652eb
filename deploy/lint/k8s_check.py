"""Renders sdhive's kustomizations and validates every manifest against Kubernetes' schemas, offline.

Run by `cargo xtask k8s` in its own venv (kubernetes-validate brings PyYAML and jsonschema); not meant to be
run by hand, though it can be:

    k8s_check.py check ROOT --overlay overlays/autoscale --extra secret.example.yaml --out DIR -k 1.33.0 -k 1.37.0
    k8s_check.py files FILE... -k 1.33.0
    k8s_check.py commands RENDERED.yaml... --hive target/debug/hive

`check` renders ROOT's kustomization and each overlay's into DIR/<name>.yaml (what checkov then scans), validates
every resource, and fails when a YAML file under ROOT is neither used by a kustomization nor named by --extra (a
manifest nobody validates). `files` validates plain manifest files. `commands` runs every
hive container's command line through the real binary (`hive config`, which takes `serve`'s flags) with its
environment, downward-API values and Secret keys stood in for, so a misspelt flag or an undefined `$(VAR)` fails
here rather than in a crash-looping pod. Exit status 1 names each failure.

There is no kubectl or kustomize here, so this renders the subset of kustomize the manifests use: `resources`
(files and folders with a kustomization.yaml) and `patches` that delete a resource (`$patch: delete`). Any other
kustomization key is refused rather than ignored, so a manifest change that needs more cannot pass unchecked.

Kinds without a built-in schema (CRDs) are validated against the JSON schemas in --schemas, named
`<kind>-<group>-<version>.json` (lower case); a kind with neither is an error, never a silent skip.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import jsonschema
import kubernetes_validate
import kubernetes_validate.utils as kv_utils
import yaml

KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "patches"}


class Failure(Exception):
    pass


def load_documents(path):
    try:
        docs = list(yaml.safe_load_all(path.read_text()))
    except (OSError, yaml.YAMLError) as e:
        raise Failure(f"{path}: cannot read YAML: {e}") from e
    out = []
    for i, doc in enumerate(docs):
        if doc is None:
            continue
        if not isinstance(doc, dict) or "kind" not in doc or "apiVersion" not in doc:
            raise Failure(f"{path}: document {i + 1} is not a Kubernetes object (no kind/apiVersion)")
        out.append(doc)
    return out


def identity(resource):
    meta = resource.get("metadata") or {}
    return (resource["kind"], meta.get("namespace", ""), meta.get("name", ""))


def render(directory, used_files):
    """The resources `kubectl kustomize directory` would print (for the supported subset), with their files."""
    kfile = directory / "kustomization.yaml"
    if not kfile.is_file():
        raise Failure(f"{directory}: no kustomization.yaml")
    used_files.add(kfile.resolve())
    try:
        k = yaml.safe_load(kfile.read_text()) or {}
    except yaml.YAMLError as e:
        raise Failure(f"{kfile}: cannot read YAML: {e}") from e
    unknown = set(k) - KUSTOMIZATION_KEYS
    if unknown:
        raise Failure(f"{kfile}: keys {sorted(unknown)} are not supported by this renderer (only "
                      f"{sorted(KUSTOMIZATION_KEYS)}): extend deploy/lint/k8s_check.py first")
    resources = []
    for entry in k.get("resources") or []:
        path = (directory / entry).resolve()
        if path.is_dir():
            resources.extend(render(path, used_files))
        elif path.is_file():
            used_files.add(path)
            resources.extend((path, doc) for doc in load_documents(path))
        else:
            raise Failure(f"{kfile}: resource {entry!r} does not exist")
    for i, p in enumerate(k.get("patches") or []):
        if set(p) != {"patch"}:
            raise Failure(f"{kfile}: patches[{i}]: only inline `patch:` deletions are supported")
        patch = yaml.safe_load(p["patch"])
        if not isinstance(patch, dict) or patch.get("$patch") != "delete":
            raise Failure(f"{kfile}: patches[{i}]: only `$patch: delete` is supported")
        target = identity(patch)
        kept = [(f, r) for f, r in resources if identity(r) != target]
        if len(kept) == len(resources):
            raise Failure(f"{kfile}: patches[{i}] deletes {target}, which no resource is")
        resources = kept
    seen = set()
    for f, r in resources:
        if identity(r) in seen:
            raise Failure(f"{kfile}: {identity(r)} appears twice (last from {f})")
        seen.add(identity(r))
    return resources


def crd_schema(resource, schemas):
    group, _, version = resource["apiVersion"].rpartition("/")
    name = f"{resource['kind']}-{group}-{version}.json".lower()
    path = schemas / name
    return json.loads(path.read_text()) if path.is_file() else None


def validate(source, resource, versions, schemas):
    """Error messages for one resource (empty when it is valid for every version)."""
    what = f"{source}: {resource['kind']}/{(resource.get('metadata') or {}).get('name', '?')}"
    errors = []
    for version in versions:
        try:
            kubernetes_validate.validate(resource, version, strict=True)
        except kv_utils.ValidationError as e:
            path = ".".join(str(p) for p in e.path) or "(root)"
            errors.append(f"{what}: Kubernetes {version}: {path}: {e.message}")
        except kv_utils.SchemaNotFoundError:
            schema = crd_schema(resource, schemas)
            if schema is None:
                errors.append(f"{what}: no schema for {resource['apiVersion']} {resource['kind']} in Kubernetes "
                              f"{version} nor in {schemas}")
                continue
            for e in sorted(jsonschema.Draft202012Validator(schema).iter_errors(resource), key=str):
                path = ".".join(str(p) for p in e.path) or "(root)"
                errors.append(f"{what}: CRD schema: {path}: {e.message}")
            break  # the CRD's schema does not depend on the Kubernetes version
    return errors


def cross_check(resources):
    """What no schema sees: Services and budgets that select no pod, Secret keys that don't exist."""
    errors = []
    pods = []
    secret_keys = {}
    for source, r in resources:
        spec = r.get("spec") or {}
        template = spec.get("template") or {}
        if "containers" in (template.get("spec") or {}):
            pods.append((source, r, (template.get("metadata") or {}).get("labels") or {}, template["spec"]))
        if r["kind"] == "Secret":
            keys = set((r.get("data") or {})) | set((r.get("stringData") or {}))
            secret_keys[r["metadata"]["name"]] = keys

    def selects(selector):
        return [p for p in pods if all(p[2].get(k) == v for k, v in selector.items())]

    for source, r in resources:
        spec = r.get("spec") or {}
        name = f"{source}: {r['kind']}/{r['metadata']['name']}"
        if r["kind"] == "Service" and not selects(spec.get("selector") or {}):
            errors.append(f"{name}: its selector matches no pod template")
        if r["kind"] in ("PodDisruptionBudget", "NetworkPolicy"):
            key = "selector" if r["kind"] == "PodDisruptionBudget" else "podSelector"
            if not selects((spec.get(key) or {}).get("matchLabels") or {}):
                errors.append(f"{name}: its {key} matches no pod template")
    for source, r, _, pod in pods:
        for c in pod.get("containers", []):
            for env in c.get("env") or []:
                ref = (env.get("valueFrom") or {}).get("secretKeyRef")
                if ref and ref["name"] in secret_keys and ref["key"] not in secret_keys[ref["name"]]:
                    errors.append(f"{source}: {r['kind']}/{r['metadata']['name']}: env {env['name']} reads key "
                                  f"{ref['key']!r}, which Secret {ref['name']} does not have")
    return errors


def write_rendered(out, name, resources):
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump_all([r for _, r in resources], sort_keys=False))
    return path


def cmd_check(args):
    root = Path(args.root).resolve()
    used = set()
    errors = []
    rendered = {"base": render(root, used)}
    for overlay in args.overlay:
        rendered[overlay.strip("/").replace("/", "-")] = render(root / overlay, used)
    extras = []
    for extra in args.extra:
        path = (root / extra).resolve()
        used.add(path)
        extras.extend((path, doc) for doc in load_documents(path))
    for f in sorted(root.rglob("*.y*ml")):
        if f.resolve() not in used:
            errors.append(f"{f}: not used by any kustomization nor listed as an extra: nothing would validate it")
    for name, resources in rendered.items():
        for source, r in resources:
            errors.extend(validate(source.relative_to(root), r, args.kubernetes_version, Path(args.schemas)))
        errors.extend(cross_check(resources + extras))
        path = write_rendered(Path(args.out), name, resources)
        print(f"k8s_check: {name}: {len(resources)} resources rendered to {path}")
    for source, r in extras:
        errors.extend(validate(source.relative_to(root), r, args.kubernetes_version, Path(args.schemas)))
    return report(errors)


def cmd_files(args):
    errors = []
    for f in args.files:
        path = Path(f)
        for r in load_documents(path):
            errors.extend(validate(path, r, args.kubernetes_version, Path(args.schemas)))
    return report(errors)


DOWNWARD_API = {"status.podIP": "10.0.0.7", "spec.nodeName": "gpu-node-1", "metadata.name": "sdhive-pod-1"}


def container_env(container):
    env = {}
    for var in container.get("env") or []:
        source = var.get("valueFrom") or {}
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "fieldRef" in source:
            env[var["name"]] = DOWNWARD_API[source["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in source:
            env[var["name"]] = "stand-in-" + source["secretKeyRef"]["key"]
        else:
            raise Failure(f"env {var['name']}: a source this check does not know: {source}")
    return env


def cmd_commands(args):
    errors = []
    checked = 0
    with tempfile.TemporaryDirectory() as home:
        for f in args.rendered:
            for r in load_documents(Path(f)):
                pod = ((r.get("spec") or {}).get("template") or {}).get("spec") or {}
                for c in pod.get("containers") or []:
                    what = f"{f}: {r['kind']}/{r['metadata']['name']}: container {c['name']}"
                    if c.get("command") or not (c.get("args") or [None])[0] == "serve":
                        errors.append(f"{what}: expected the image's entrypoint (hive) with args `serve …`")
                        continue
                    env = container_env(c)
                    undefined = set(re.findall(r"\$\((\w+)\)", " ".join(c["args"]))) - set(env)
                    if undefined:
                        errors.append(f"{what}: args use undefined variables {sorted(undefined)} (Kubernetes "
                                      "would pass them literally)")
                        continue
                    argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in c["args"][1:]]
                    run_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env, "HOME": home}
                    done = subprocess.run([args.hive, "config", *argv], env=run_env, capture_output=True,
                                          text=True, timeout=60)
                    checked += 1
                    if done.returncode != 0:
                        errors.append(f"{what}: `hive config {' '.join(argv)}` failed: {done.stderr.strip()}")
    if checked == 0:
        errors.append("no hive container found in " + " ".join(args.rendered))
    else:
        print(f"k8s_check: ran {checked} hive command lines through {args.hive}")
    return report(errors)


def report(errors):
    # A file used by the base and an overlay fails the same way in both.
    errors = list(dict.fromkeys(errors))
    for e in errors:
        print(f"ERROR {e}")
    if errors:
        print(f"k8s_check: {len(errors)} errors")
        return 1
    print("k8s_check: no errors")
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check")
    check.add_argument("root")
    check.add_argument("--overlay", action="append", default=[])
    check.add_argument("--extra", action="append", default=[])
    check.add_argument("--out", required=True)
    files = sub.add_parser("files")
    files.add_argument("files", nargs="+")
    for p in (check, files):
        p.add_argument("-k", "--kubernetes-version", action="append", required=True)
        p.add_argument("--schemas", default=str(Path(__file__).parent / "schemas"))
    commands = sub.add_parser("commands")
    commands.add_argument("rendered", nargs="+")
    commands.add_argument("--hive", required=True)
    args = parser.parse_args()
    handlers = {"check": cmd_check, "files": cmd_files, "commands": cmd_commands}
    try:
        return handlers[args.command](args)
    except Failure as e:
        print(f"ERROR {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
