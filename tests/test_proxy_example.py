"""examples/k8s/proxy-sidecar.yaml fits the pod in deployment.yaml, the real `kcache proxy` accepts its
arguments, and the container runs locked down."""

import re
from pathlib import Path

import pytest
from test_examples import EXAMPLES, deployment, kcache_calls, mount_of, option, resolve

yaml = pytest.importorskip("yaml")

SIDECAR = EXAMPLES / "proxy-sidecar.yaml"


def sidecar_docs() -> dict[str, dict]:
    """Each document as KIND/NAME, and as KIND for the first of its kind."""
    docs: dict[str, dict] = {}
    for doc in yaml.safe_load_all(SIDECAR.read_text()):
        if doc:
            docs.setdefault(doc["kind"], doc)
            docs[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
    return docs


def merged_pod():
    """deployment.yaml's pod with the patch's containers merged in by name, as a strategic merge does."""
    spec, _, restore_args, model = deployment()
    patch = sidecar_docs()["Deployment"]
    (proxy,) = patch["spec"]["template"]["spec"]["containers"]
    assert proxy["name"] not in {c["name"] for c in spec["containers"]}, "the patch must add, not replace"
    return spec, restore_args, model, proxy


def test_the_patch_targets_the_example_deployment():
    patch = sidecar_docs()["Deployment"]
    (name,) = {doc["metadata"]["name"] for _, doc in _deployments()}
    assert patch["metadata"]["name"] == name


def _deployments():
    for path in sorted(EXAMPLES.glob("*.yaml")):
        if path != SIDECAR:
            for doc in yaml.safe_load_all(path.read_text()):
                if doc and doc["kind"] == "Deployment":
                    yield path, doc


def test_kcache_proxy_accepts_the_arguments(monkeypatch):
    _, _, _, proxy = merged_pod()
    (args,) = kcache_calls(proxy)
    path, command, rest = resolve(args)
    assert path == ["proxy"] and command is not None
    known = {opt for param in command.params for opt in param.opts}
    assert {a for a in rest if a.startswith("--")} <= known
    env = {e["name"]: e for e in proxy["env"]}
    assert "secretKeyRef" in env["KCACHE_PROXY_REDIS"]["valueFrom"], "the Redis password belongs in a Secret"
    monkeypatch.setenv("KCACHE_PROXY_REDIS", "redis://example:6379/0")
    command.make_context("proxy", list(rest), resilient_parsing=False).close()


def test_the_proxy_reads_the_restore_state_and_fronts_the_model():
    spec, restore_args, model, proxy = merged_pod()
    (args,) = kcache_calls(proxy)
    (root,) = option(restore_args, "--into")
    assert option(args, "--root") == [root]
    volume = next(m for m in proxy["volumeMounts"] if m["mountPath"] == root)
    assert volume["readOnly"] is True and mount_of(model, volume["name"]) == root
    assert volume["name"] in {v["name"] for v in spec["volumes"]}
    model_port = next(p["containerPort"] for p in model["ports"] if p["name"] == "http")
    assert option(args, "--upstream") == [f"http://127.0.0.1:{model_port}"]
    assert option(args, "--host") == ["0.0.0.0"]
    service = sidecar_docs()["Service"]
    (port,) = service["spec"]["ports"]
    named = {p["name"]: p["containerPort"] for p in proxy["ports"]}
    assert str(named[port["targetPort"]]) == option(args, "--port")[0]
    labels = next(doc for _, doc in _deployments())["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()


def test_clients_reach_the_proxy_port_and_prometheus_the_metrics_port():
    """/metrics on the clients' port told any client whether another tenant had sent a prompt."""
    _, _, _, proxy = merged_pod()
    (args,) = kcache_calls(proxy)
    named = {p["name"]: str(p["containerPort"]) for p in proxy["ports"]}
    assert option(args, "--metrics-port") == [named["metrics"]] and named["metrics"] != named["proxy"]
    docs = sidecar_docs()
    (client_port,) = docs["Service"]["spec"]["ports"]
    assert client_port["targetPort"] == "proxy"
    services = [doc for name, doc in docs.items() if name.startswith("Service/")]
    assert {p["targetPort"] for doc in services if doc is not docs["Service"] for p in doc["spec"]["ports"]} == {
        "metrics"
    }
    (scraped,) = [doc for doc in services if doc["metadata"].get("annotations", {}).get("prometheus.io/scrape")]
    assert scraped["metadata"]["annotations"]["prometheus.io/port"] == named["metrics"]
    assert proxy["readinessProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}


def test_clients_reach_no_port_of_the_pod_but_the_proxys():
    """vLLM binds 0.0.0.0: any client in the cluster reached the engine on its own port, uncached and with its
    /metrics, whose prefix-cache hit counters tell whether another tenant sent a prompt (why the proxy keeps
    /metrics off its clients' port), and the proxy's own counters on the metrics port too. The example said the
    engine's port stayed inside the pod, and left the policy that would keep it there to the reader."""
    spec, _, model, proxy = merged_pod()
    labels = next(doc for _, doc in _deployments())["spec"]["template"]["metadata"]["labels"]
    policies = [doc for name, doc in sidecar_docs().items() if name.startswith("NetworkPolicy/")]
    (policy,) = [p for p in policies if p["spec"]["podSelector"]["matchLabels"].items() <= labels.items()]
    assert "Ingress" in policy["spec"]["policyTypes"]
    named = {p["name"]: p["containerPort"] for c in [*spec["containers"], proxy] for p in c.get("ports", [])}
    rules = policy["spec"]["ingress"]
    assert all(rule.get("ports") for rule in rules), "a rule without ports admits every port"

    def admitted(rule) -> set[int]:
        return {named.get(p["port"], p["port"]) for p in rule["ports"]}

    assert set().union(*(admitted(r) for r in rules if not r.get("from"))) == {named["proxy"]}
    engine = next(p["containerPort"] for p in model["ports"] if p["name"] == "http")
    assert not any(engine in admitted(rule) for rule in rules)
    scraped = {named["metrics"], named["kcache"]}  # the proxy's and the kcache sidecar's (the pod's annotations)
    assert any(scraped <= admitted(rule) and rule.get("from") for rule in rules), "Prometheus still scrapes both"


def test_the_secret_holds_what_the_proxy_reads():
    _, _, _, proxy = merged_pod()
    ref = next(e for e in proxy["env"] if e["name"] == "KCACHE_PROXY_REDIS")["valueFrom"]["secretKeyRef"]
    secret = sidecar_docs()["Secret"]
    assert secret["metadata"]["name"] == ref["name"] and ref["key"] in secret["stringData"]


def test_the_entry_key_comes_from_the_secret_mounted_read_only():
    """Without --entry-key-file each replica tags answers with a key of its own: none reads another's."""
    spec, _, _, proxy = merged_pod()
    (args,) = kcache_calls(proxy)
    (path,) = option(args, "--entry-key-file")
    mount = next(m for m in proxy["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/"))
    assert mount["readOnly"] is True
    patch_volumes = sidecar_docs()["Deployment"]["spec"]["template"]["spec"]["volumes"]
    (volume,) = [v for v in patch_volumes if v["name"] == mount["name"]]
    assert volume["name"] not in {v["name"] for v in spec["volumes"]}, "the patch must add, not replace"
    secret = sidecar_docs()["Secret"]
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    (item,) = volume["secret"]["items"]  # only the key: the Redis URL stays out of the file system
    assert path == mount["mountPath"].rstrip("/") + "/" + item["path"] and item["key"] in secret["stringData"]
    assert volume["secret"]["defaultMode"] & 0o077 == 0o040, "readable by the pod's group (fsGroup), no one else"


def test_the_memory_limit_covers_the_documented_worst_case():
    """docs/proxy.md: ~50 MiB at rest, ~30 x --max-request-bytes for the body being parsed, a request's
    body and an answer per request in flight, ~150 B a remembered prefix. A 60 MiB body had taken 1.7 GiB
    against a limit of 512Mi."""
    _, _, _, proxy = merged_pod()
    (args,) = kcache_calls(proxy)
    _, command, rest = resolve(args)
    params = command.make_context("proxy", list(rest) + ["--redis", "redis://x:6379/0"]).params
    per_request = params["max_request_bytes"] + params["max_entry_bytes"]
    worst = (50 << 20) + 30 * params["max_request_bytes"] + 150 * params["prefix_entries"] + 32 * per_request
    limit = proxy["resources"]["limits"]["memory"]
    assert _bytes(limit) >= worst, f"{limit} is under the worst case with 32 large requests in flight"


def test_the_proxy_exits_on_sigterm_before_the_kubelet_kills_it():
    """aiohttp's default had the proxy take 124 s to exit with a request held by a wedged engine."""
    spec, _, _, proxy = merged_pod()
    (args,) = kcache_calls(proxy)
    _, command, rest = resolve(args)
    params = command.make_context("proxy", list(rest) + ["--redis", "redis://x:6379/0"]).params
    assert params["shutdown_timeout"] + 5 <= spec["terminationGracePeriodSeconds"]


def _bytes(quantity: str) -> int:
    units = {"Mi": 1 << 20, "Gi": 1 << 30}
    return int(quantity[:-2]) * units[quantity[-2:]]


def test_the_sidecar_runs_locked_down_with_a_pinned_image():
    _, _, _, proxy = merged_pod()
    ctx = proxy["securityContext"]
    assert ctx["runAsNonRoot"] is True and ctx["readOnlyRootFilesystem"] is True
    assert ctx["allowPrivilegeEscalation"] is False and ctx["capabilities"]["drop"] == ["ALL"]
    assert ctx["seccompProfile"]["type"] == "RuntimeDefault"
    image, _, tag = proxy["image"].rpartition(":")
    assert image and tag and tag != "latest" and "/" not in tag
    assert {"cpu", "memory"} <= proxy["resources"]["requests"].keys() and "memory" in proxy["resources"]["limits"]
    dockerfile = (Path(__file__).resolve().parents[1] / "Dockerfile").read_text()
    assert "AS proxy" in dockerfile and '"aiohttp' in dockerfile, "the proxy image is built with the proxy extra"


def test_the_docs_build_the_sidecar_image_the_dockerfile_builds():
    """docs/proxy.md said to build the sidecar's image with --build-arg KCACHE_EXTRAS=postgres,gpu,proxy, an
    argument the Dockerfile never had: that image was the init image, without aiohttp and redis, and the
    sidecar crash-looped (keeping the pod unready)."""
    root = Path(__file__).resolve().parents[1]
    dockerfile = (root / "Dockerfile").read_text()
    build_args = set(re.findall(r"^ARG (\w+)", dockerfile, re.MULTILINE))
    stages = set(re.findall(r"^FROM \S+ AS (\S+)", dockerfile, re.MULTILINE))
    for text in ((root / "docs" / "proxy.md").read_text(), SIDECAR.read_text()):
        assert set(re.findall(r"--build-arg (\w+)=", text)) <= build_args
        assert set(re.findall(r"--target (\S+)", text)) <= stages
        assert "--target proxy" in text and "proxy" in stages
