"""The node-tier examples (prefetch and image pre-pull DaemonSets) agree with the real CLI and the Deployment."""

from __future__ import annotations

import json
import re

import pytest
from test_examples import EXAMPLES, FINGERPRINT_FLAGS, deployment, kcache_calls, option, resolve

yaml = pytest.importorskip("yaml")

PREFETCH = EXAMPLES / "prefetch-daemonset.yaml"
PREPULL = EXAMPLES / "image-prepull-daemonset.yaml"
SNIPPET = re.compile(r"^# --- restore-node-cache-snippet\n(.*?)^# --- end$", re.MULTILINE | re.DOTALL)


def docs(path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def daemonset(path):
    (doc,) = [d for d in docs(path) if d["kind"] == "DaemonSet"]
    assert doc["apiVersion"] == "apps/v1"
    return doc


def facts() -> dict:
    (configmap,) = [d for d in docs(EXAMPLES / "deployment.yaml") if d["metadata"]["name"] == "llm-kcache-facts"]
    return json.loads(configmap["data"]["facts.json"])["facts"]


def all_containers(spec):
    return spec.get("initContainers", []) + spec["containers"]


def prefetch_container():
    spec = daemonset(PREFETCH)["spec"]["template"]["spec"]
    (container,) = [c for c in spec["containers"] if kcache_calls(c)]
    (args,) = kcache_calls(container)
    return spec, container, args


def snippet():
    """The restore init container that prefetch-daemonset.yaml's comments tell deployment.yaml to use."""
    (text,) = SNIPPET.findall(PREFETCH.read_text())
    return yaml.safe_load("\n".join(line.removeprefix("# ").removeprefix("#") for line in text.splitlines()))


def check_flags(args):
    path, command, rest = resolve(args)
    assert command is not None, f"no command kcache {' '.join(path)}"
    known = {opt for param in command.params for opt in param.opts}
    flags = [a.split("=", 1)[0] for a in rest if a.startswith("--")]
    assert flags and set(flags) <= known, f"unknown {set(flags) - known}"
    command.make_context(" ".join(path), list(rest), resilient_parsing=False).close()  # types, ranges, required
    return path


def env_of(container) -> dict:
    return {e["name"]: e.get("value") or e["valueFrom"]["secretKeyRef"]["key"] for e in container.get("env", [])}


def node_cache_volume(spec, container, path: str) -> dict:
    """The hostPath volume the container mounts read-write at `path`."""
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == path]
    assert not mount.get("readOnly"), "the node cache is filled by whoever fetched a pack"
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    return volume["hostPath"]


@pytest.mark.parametrize("path", [PREFETCH, PREPULL], ids=lambda p: p.name)
def test_daemonsets_run_on_the_gpu_nodes_the_facts_describe(path):
    doc = daemonset(path)
    spec = doc["spec"]["template"]["spec"]
    assert doc["spec"]["selector"]["matchLabels"].items() <= doc["spec"]["template"]["metadata"]["labels"].items()
    labels = spec["nodeSelector"]
    assert labels["nvidia.com/gpu.product"] == facts()["gpu.name"].replace(" ", "-")
    dspec, _, _, _ = deployment()
    assert dspec.get("nodeSelector", {}).get("nvidia.com/gpu.product", labels["nvidia.com/gpu.product"]) == labels[
        "nvidia.com/gpu.product"]  # fmt: skip
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    for container in all_containers(spec):
        assert "nvidia.com/gpu" not in str(container.get("resources")), "a DaemonSet must not take the model's GPU"


def test_prefetch_runs_only_where_the_facts_file_matches_the_node():
    spec, _, _ = prefetch_container()
    labels, dspec = spec["nodeSelector"], deployment()[0]
    driver = ".".join(labels[f"nvidia.com/cuda.driver.{part}"] for part in ("major", "minor", "rev"))
    assert driver == facts()["gpu.driver"], "elsewhere every round would be a miss"
    assert dspec.get("nodeSelector", {}).items() <= labels.items(), "at least where the Deployment's pods may land"


@pytest.mark.parametrize("path", [PREFETCH, PREPULL], ids=lambda p: p.name)
def test_daemonsets_are_locked_down(path):
    spec = daemonset(path)["spec"]["template"]["spec"]
    pod = spec["securityContext"]
    assert pod["runAsNonRoot"] is True and pod["runAsUser"] != 0
    assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
    for container in all_containers(spec):
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False and context["readOnlyRootFilesystem"] is True
        assert context["capabilities"]["drop"] == ["ALL"], container["name"]
        resources = container["resources"]
        assert {"cpu", "memory"} <= set(resources["requests"]) and {"cpu", "memory"} <= set(resources["limits"])
        image = container["image"]
        assert re.fullmatch(r"[\w./-]+(:[\w.-]+|@sha256:[0-9a-f]{64})", image) and not image.endswith(":latest")
        if context.get("runAsUser") == 0:  # the one root step: chown the hostPath, with CAP_CHOWN only
            assert context["capabilities"].get("add") == ["CHOWN"] and container["command"][0] == "chown"
            assert container["name"] in {c["name"] for c in spec.get("initContainers", [])}
        else:
            assert context.get("capabilities", {}).get("add") is None, container["name"]


def test_prefetch_flags_are_real_and_its_node_cache_is_the_hostpath():
    spec, container, args = prefetch_container()
    assert check_flags(args) == ["prefetch"]
    (node_cache,) = option(args, "--node-cache")
    host = node_cache_volume(spec, container, node_cache)
    assert host["type"] == "DirectoryOrCreate"
    (owner,) = [c for c in spec["initContainers"] if c["command"][0] == "chown"]
    assert owner["command"][-1] == node_cache and str(spec["securityContext"]["runAsUser"]) in owner["command"][1]
    assert option(args, "--every") and not option(args, "--once"), "a DaemonSet's container must keep running"


def test_prefetch_fingerprints_as_the_deployment_restores():
    _, container, args = prefetch_container()
    dspec, init, restore_args, _ = deployment()

    def fingerprint_args(call):
        return sorted((flag, value) for flag in FINGERPRINT_FLAGS for value in option(call, flag))

    assert fingerprint_args(args) == fingerprint_args(restore_args)
    (path,) = option(args, "--facts-file")
    volumes = {v["name"]: v for v in daemonset(PREFETCH)["spec"]["template"]["spec"]["volumes"]}
    dvolumes = {v["name"]: v for v in dspec["volumes"]}
    assert volumes[mounted(container, path)]["configMap"] == dvolumes[mounted(init, path)]["configMap"]


def mounted(container, path: str) -> str:
    """The volume the container reads `path` from."""
    (name,) = [m["name"] for m in container["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
    return name


def test_prefetch_only_reads_the_store_restore_reads():
    spec, container, _ = prefetch_container()
    _, init, _, _ = deployment()
    env, restore_env = env_of(container), env_of(init)
    assert env["KCACHE_STORE"] == restore_env["KCACHE_STORE"]
    assert env["KCACHE_INDEX"] == "none", "bundles through refs/: no index credentials on every node"
    assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} & set(env), "a role, not static keys"
    assert env["AWS_ROLE_ARN"].endswith("role/kcache-reader") and env["AWS_ROLE_ARN"] == restore_env.get(
        "AWS_ROLE_ARN", env["AWS_ROLE_ARN"])  # fmt: skip
    token = {v["name"]: v for v in spec["volumes"]}[mounted(container, env["AWS_WEB_IDENTITY_TOKEN_FILE"])]
    assert token["projected"]["sources"][0]["serviceAccountToken"]["audience"] == "sts.amazonaws.com"
    (account,) = [d for d in docs(PREFETCH) if d["kind"] == "ServiceAccount"]
    assert spec["serviceAccountName"] == account["metadata"]["name"] and spec["automountServiceAccountToken"] is False
    assert account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"] == env["AWS_ROLE_ARN"]


def test_the_restore_snippet_uses_the_same_node_cache_and_cap():
    spec, container, args = prefetch_container()
    (node_cache,) = option(args, "--node-cache")
    part = snippet()
    (init,) = part["initContainers"]
    restore_args = [str(a) for a in init["args"]]
    assert check_flags(restore_args) == ["restore"]
    assert option(restore_args, "--node-cache") == [node_cache]
    assert node_cache_volume(part, init, node_cache) == node_cache_volume(spec, container, node_cache)
    cap = "KCACHE_NODE_CACHE_MAX_BYTES"
    assert env_of(init)[cap] == env_of(container)[cap], "restore evicts to its own cap: give both the same"
    _, _, deployed_args, _ = deployment()
    without = [a for i, a in enumerate(restore_args) if "--node-cache" not in restore_args[max(0, i - 1) : i + 1]]
    assert sorted(without) == sorted(deployed_args), "the snippet is deployment.yaml's restore plus --node-cache"


def test_every_example_pod_that_reads_a_node_cache_shares_the_daemonsets():
    """Once deployment.yaml takes the snippet, its restore must mount the same hostPath with the same cap."""
    spec, container, args = prefetch_container()
    (node_cache,) = option(args, "--node-cache")
    readers = 0
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            pod = (doc or {}).get("spec", {}).get("template", {}).get("spec")
            for c in all_containers(pod) if pod else ():
                for call in kcache_calls(c):
                    given = option(call, "--node-cache") or [env_of(c).get("KCACHE_NODE_CACHE")] * bool(
                        env_of(c).get("KCACHE_NODE_CACHE")
                    )
                    if given:
                        readers += 1
                        assert given == [node_cache], f"{path.name}:{c['name']}"
                        assert node_cache_volume(pod, c, node_cache) == node_cache_volume(spec, container, node_cache)
                        cap = "KCACHE_NODE_CACHE_MAX_BYTES"
                        assert env_of(c).get(cap) == env_of(container)[cap], f"{path.name}:{c['name']}"
    assert readers >= 1  # the prefetch DaemonSet itself


def test_prepull_pulls_the_deployments_model_image_and_exits():
    spec = daemonset(PREPULL)["spec"]["template"]["spec"]
    (pull,) = spec["initContainers"]
    _, _, _, model = deployment()
    assert pull["image"].rsplit(":", 1)[0] == model["image"].rsplit(":", 1)[0], "the image the model runs"
    assert pull["imagePullPolicy"] == "IfNotPresent"
    assert pull["command"][-1] in ("exit 0", "true") and not pull.get("args")
    (pause,) = spec["containers"]
    assert pause["image"].startswith("registry.k8s.io/pause:")
    assert spec["automountServiceAccountToken"] is False
