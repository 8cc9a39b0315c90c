"""A small kustomize-compatible renderer for the project's deploy/kubernetes overlays (no kubectl here).

Owns the kustomization features those overlays use, with kustomize's semantics: `resources`
(files and kustomization folders), `images` (newName/newTag), `patches` (a file or inline patch:
a strategic merge patch naming its target by kind/name, or a JSON 6902 operation list with a
`target`). Anything else in a kustomization is refused, so an overlay cannot silently use a
feature rendered differently from `kubectl kustomize`. Knows nothing about what is deployed.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

SUPPORTED_FIELDS = {"apiVersion", "kind", "resources", "images", "patches"}
# Strategic-merge keys of the list fields these manifests patch (Kubernetes' patchMergeKey);
# any other list is replaced, as kustomize does for lists without a merge key.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
    "imagePullSecrets": "name",
}


class KustomizeError(ValueError):
    """The kustomization uses something this renderer does not implement, or does not apply."""


def render(folder: Path) -> list[dict[str, Any]]:
    """The resources of kustomization `folder`, as kustomize builds them (in resource order)."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unsupported = set(kustomization) - SUPPORTED_FIELDS
    if unsupported:
        raise KustomizeError(f"{folder}: kustomization fields not supported here: {sorted(unsupported)}")
    documents: list[dict[str, Any]] = []
    for entry in kustomization.get("resources", []):
        path = folder / entry
        if path.is_dir():
            documents.extend(render(path))
        else:
            documents.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    for patch in kustomization.get("patches", []):
        _apply_patch(documents, folder, patch)
    for image in kustomization.get("images", []):
        _set_image(documents, image)
    return documents


def _apply_patch(documents: list[dict[str, Any]], folder: Path, patch: dict[str, Any]) -> None:
    text = (folder / patch["path"]).read_text() if "path" in patch else patch["patch"]
    body = yaml.safe_load(text)
    if isinstance(body, list):  # JSON 6902
        if "target" not in patch:
            raise KustomizeError(f"{folder}: a JSON 6902 patch needs a target")
        targets = _matching(documents, patch["target"])
        for document in targets:
            for operation in body:
                _json6902(document, operation)
        return
    target = patch.get("target") or {"kind": body["kind"], "name": body["metadata"]["name"]}
    for document in _matching(documents, target):
        merged = strategic_merge(document, body)
        document.clear()
        document.update(merged)


def _matching(documents: list[dict[str, Any]], target: dict[str, Any]) -> list[dict[str, Any]]:
    unsupported = set(target) - {"kind", "name"}
    if unsupported:
        raise KustomizeError(f"patch target fields not supported here: {sorted(unsupported)}")
    found = [
        d
        for d in documents
        if d.get("kind") == target.get("kind", d.get("kind"))
        and d["metadata"]["name"] == target.get("name", d["metadata"]["name"])
    ]
    if not found:
        raise KustomizeError(f"no resource matches patch target {target}")
    return found


def strategic_merge(original: Any, patch: Any, field: str | None = None) -> Any:
    """Kubernetes' strategic merge for the fields in MERGE_KEYS; maps merge, `null` deletes, lists replace."""
    if isinstance(original, dict) and isinstance(patch, dict):
        merged = copy.deepcopy(original)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            elif key in merged:
                merged[key] = strategic_merge(merged[key], value, key)
            else:
                merged[key] = copy.deepcopy(value)
        return merged
    key = MERGE_KEYS.get(field or "")
    if isinstance(original, list) and isinstance(patch, list) and key:
        merged_list = copy.deepcopy(original)
        for item in patch:
            index = next((i for i, old in enumerate(merged_list) if old.get(key) == item.get(key)), None)
            if index is None:
                merged_list.append(copy.deepcopy(item))
            else:
                merged_list[index] = strategic_merge(merged_list[index], item)
        return merged_list
    return copy.deepcopy(patch)


def _json6902(document: dict[str, Any], operation: dict[str, Any]) -> None:
    """RFC 6902 add/replace/remove (the operations these overlays use)."""
    op = operation["op"]
    if op not in ("add", "replace", "remove"):
        raise KustomizeError(f"JSON 6902 operation {op!r} not supported here")
    parts = [p.replace("~1", "/").replace("~0", "~") for p in operation["path"].lstrip("/").split("/")]
    parent: Any = document
    for part in parts[:-1]:
        parent = parent[int(part)] if isinstance(parent, list) else parent[part]
    last = parts[-1]
    if isinstance(parent, list):
        if op == "add":
            parent.insert(len(parent) if last == "-" else int(last), copy.deepcopy(operation["value"]))
        elif op == "replace":
            parent[int(last)] = copy.deepcopy(operation["value"])
        else:
            del parent[int(last)]
        return
    if op == "remove" or (op == "replace" and last not in parent):
        if last not in parent:
            raise KustomizeError(f"JSON 6902 {op}: {operation['path']} does not exist")
        if op == "remove":
            del parent[last]
            return
    parent[last] = copy.deepcopy(operation["value"])


def _set_image(documents: list[dict[str, Any]], image: dict[str, Any]) -> None:
    for document in documents:
        spec = document.get("spec", {}).get("template", {}).get("spec", {})
        for container in [*spec.get("containers", []), *spec.get("initContainers", [])]:
            reference = container["image"]
            # A tag follows the last ":" after the last "/" (a registry host may have a port).
            name, tag = reference, ""
            if ":" in reference.rsplit("/", 1)[-1]:
                name, tag = reference.rsplit(":", 1)
            if name != image["name"]:
                continue
            new_tag = image.get("newTag", tag)
            container["image"] = image.get("newName", name) + (f":{new_tag}" if new_tag else "")


def find(documents: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """The one resource of `kind` among `documents`."""
    (found,) = [d for d in documents if d["kind"] == kind]
    return found
