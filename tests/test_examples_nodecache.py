"""The node-tier examples (prefetch and image pre-pull DaemonSets) agree with the real CLI and the Deployment."""

from __future__ import annotations

import re

import pytest
from test_examples import EXAMPLES, FINGERPRINT_FLAGS, deployment, kcache_calls, option, resolve

yaml = pytest.importorskip("yaml")

PREFETCH = EXAMPLES / "prefetch-daemonset.yaml"
PREPULL = EXAMPLES / "image-prepull-daemonset.yaml"
SNIPPET = re.compile(r"^# --- restore-node-cache-snippet\n(.*?)^# --- end$", re.MULTILINE | re.DOTALL)


def daemonset(path):
    (doc,) = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert (doc["apiVersion"], doc["kind"]) == ("apps/v1", "DaemonSet")
    return doc


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
def test_daemonsets_run_on_gpu_nodes_and_select_their_own_pods(path):
    doc = daemonset(path)
    spec = doc["spec"]["template"]["spec"]
    assert doc["spec"]["selector"]["matchLabels"].items() <= doc["spec"]["template"]["metadata"]["labels"].items()
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    for container in all_containers(spec):
        assert "nvidia.com/gpu" not in str(container.get("resources")), "a DaemonSet must not take the model's GPU"


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
        assert resources["requests"]["cpu"] and resources["requests"]["memory"] and resources["limits"]["memory"]
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
    restore_env, prefetch_env = env_of(init), env_of(container)
    for name in ("KCACHE_STORE", "KCACHE_INDEX", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert prefetch_env[name] == restore_env[name], name
    (facts,) = option(args, "--facts-file")
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    (mounted,) = [name for path, name in mounts.items() if facts.startswith(path.rstrip("/") + "/")]
    volumes = {v["name"]: v for v in daemonset(PREFETCH)["spec"]["template"]["spec"]["volumes"]}
    dvolumes = {v["name"]: v for v in dspec["volumes"]}
    (restore_facts,) = [m["name"] for m in init["volumeMounts"] if facts.startswith(m["mountPath"].rstrip("/") + "/")]
    assert volumes[mounted]["configMap"] == dvolumes[restore_facts]["configMap"], "the same facts ConfigMap"


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
