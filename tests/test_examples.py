"""The Kubernetes examples are wired the way kcache needs them: one volume, one root, one fingerprint."""

import json
import re
import shlex
from pathlib import Path

import click
import pytest

from kcache import envfile, sources
from kcache.cli import main
from kcache.refs import RefCatalog
from kcache.restore import restore
from kcache.store.local import LocalStore

yaml = pytest.importorskip("yaml")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "k8s"
FILES = sorted(p for p in EXAMPLES.glob("*.yaml") if p.name != "proxy-sidecar.yaml")  # a patch: test_proxy_example.py
FINGERPRINT_FLAGS = ("--model", "--model-config", "--fact", "--facts-file", "--extra")
PENDING = {"warmup", "prebake"}  # commands a parallel change adds; checked as soon as they are registered
KEY_TAG = "TORCH_COMPILE_CACHE_KEY_TAG"


def documents():
    return [(path.name, doc) for path in FILES for doc in yaml.safe_load_all(path.read_text()) if doc]


def pod_specs():
    for name, doc in documents():
        if doc["kind"] in ("Deployment", "Job"):
            yield name, doc["kind"], doc["spec"]["template"]["spec"]


def containers(spec):
    return spec.get("initContainers", []) + spec["containers"]


def kcache_calls(container) -> list[list[str]]:
    """The argument lists of every `kcache ...` the container runs (directly or in `sh -c`)."""
    command, args = container.get("command"), [str(a) for a in container.get("args", [])]
    if command is None and "kcache" in container["image"]:  # the image's ENTRYPOINT is kcache
        return [args]
    if command == ["kcache"]:
        return [args]
    if command in (["sh", "-c"], ["/bin/sh", "-c"]):
        return _shell_calls(" ".join(args))
    return []


def _shell_calls(script: str) -> list[list[str]]:
    calls = []
    for line in script.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        segment: list[str] = []
        for token in list(lexer) + [";"]:
            if token in (";", "&&", "||", "&", "|"):
                if segment and segment[0] == "exec":
                    segment = segment[1:]
                if segment and segment[0] == "kcache":
                    calls.append(segment[1:])
                segment = []
            else:
                segment.append(token)
    return calls


def resolve(args: list[str]) -> tuple[list[str], click.Command | None, list[str]]:
    """(command path, click command or None if unknown, remaining args)."""
    command, path = main, []
    while isinstance(command, click.Group) and args and not args[0].startswith("-"):
        path.append(args[0])
        command, args = command.commands.get(args[0]), args[1:]
        if command is None:
            return path, None, args
    return path, command, args


def option(args: list[str], flag: str) -> list[str]:
    values = [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]
    return values + [a.split("=", 1)[1] for a in args if a.startswith(flag + "=")]


def mount_of(container, volume: str) -> str | None:
    return next((m["mountPath"] for m in container.get("volumeMounts", []) if m["name"] == volume), None)


def deployment():
    (spec,) = [spec for _, kind, spec in pod_specs() if kind == "Deployment"]
    (init,) = [c for c in spec["initContainers"] if any(resolve(a)[0] == ["restore"] for a in kcache_calls(c))]
    (restore_args,) = [a for a in kcache_calls(init) if resolve(a)[0] == ["restore"]]
    (model,) = [c for c in spec["containers"] if not kcache_calls(c)]
    return spec, init, restore_args, model


def test_every_document_parses_and_is_a_known_kind():
    docs = documents()
    assert {doc["kind"] for _, doc in docs} >= {"Deployment", "Job", "Secret", "ConfigMap"}
    for name, doc in docs:
        assert doc["apiVersion"] and doc["metadata"]["name"], name


def test_init_and_model_containers_share_the_restore_root():
    spec, init, restore_args, model = deployment()
    (root,) = option(restore_args, "--into")
    volume = next(m["name"] for m in init["volumeMounts"] if m["mountPath"] == root)
    assert "emptyDir" in next(v for v in spec["volumes"] if v["name"] == volume)
    for container in spec["containers"]:
        assert mount_of(container, volume) == root, container["name"]
    assert option(restore_args, "--timeout") == ["120"]


def test_model_container_env_matches_what_kcache_env_exports(tmp_path, fp):
    _, _, restore_args, model = deployment()
    (root,) = option(restore_args, "--into")
    env = {e["name"]: e.get("value") for e in model.get("env", [])}
    for name, value in sources.all_exports(Path(root)).items():
        assert env.get(name) == value, f"{model['name']} should set {name}={value}"
    # What a real restore writes (a miss here) is the source of truth.
    restore(LocalStore(tmp_path / "store"), RefCatalog(LocalStore(tmp_path / "store")), fp, tmp_path / "root")
    written = envfile.read(tmp_path / "root" / envfile.NAME)
    for name, value in written.items():
        assert env.get(name) == value.replace(str(tmp_path / "root"), root), name
    assert KEY_TAG not in written, "restore sets no key tag: a bundle published without one would miss"
    script = " ".join(model.get("command", []) + model.get("args", []))
    sourced, started = script.find(f". {root}/{envfile.NAME}"), script.find("exec vllm serve")
    assert 0 <= sourced < started, "the model must source kcache.env before the server starts"


def test_readiness_probe_asks_kcache_about_the_same_root():
    spec, _, restore_args, model = deployment()
    (root,) = option(restore_args, "--into")
    probe = model["readinessProbe"]
    if "exec" in probe:
        args = probe["exec"]["command"]
        assert args[:2] == ["kcache", "ready"] and option(args, "--root") == [root]
        return
    assert probe["httpGet"]["path"] == "/readyz"
    servers = [args for c in spec["containers"] for args in kcache_calls(c)
               if resolve(args)[0] in (["serve"], ["watch"]) and option(args, "--port")]  # fmt: skip
    (server,) = [a for a in servers if option(a, "--port") == [str(probe["httpGet"]["port"])]]
    assert option(server, "--root") == [root]
    assert option(server, "--host") == ["0.0.0.0"], "the kubelet probes the pod IP, not the sidecar's loopback"


def test_watch_sidecar_publishes_under_the_restore_fingerprint():
    spec, _, restore_args, _ = deployment()
    (watch,) = [a for c in spec["containers"] for a in kcache_calls(c) if resolve(a)[0] == ["watch"]]
    assert option(watch, "--publish-every") and option(watch, "--root") == option(restore_args, "--into")
    calls = [a for _, _, s in pod_specs() for c in containers(s) for a in kcache_calls(c)]
    publishing = [a for a in calls if resolve(a)[0] in (["restore"], ["watch"], ["prebake"])]
    assert len(publishing) == 3

    def fingerprint_args(args):
        return sorted((flag, value) for flag in FINGERPRINT_FLAGS for value in option(args, flag))

    assert fingerprint_args(restore_args)
    for args in publishing:
        assert fingerprint_args(args) == fingerprint_args(restore_args), resolve(args)[0]


def _gibibytes(quantity: str) -> float:
    number, unit = re.fullmatch(r"([0-9.]+)([KMGT]i)?", quantity).groups()
    return float(number) * {"Ki": 2**-20, "Mi": 2**-10, "Gi": 1, "Ti": 2**10, None: 2**-30}[unit]


def test_the_publishing_sidecars_temp_dir_holds_what_the_cache_does():
    """Publish builds packs in TMPDIR, up to --jobs at once, each as big as a large file's compressed
    size; an emptyDir over its sizeLimit gets the whole pod evicted, model included (no ENOSPC)."""
    spec, _, restore_args, _ = deployment()
    (sidecar,) = [c for c in spec["containers"] if any(resolve(a)[0] == ["watch"] for a in kcache_calls(c))]
    tmp = env_of(sidecar).get("TMPDIR", "/tmp")
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = sorted(((m["mountPath"], m["name"]) for m in sidecar["volumeMounts"]
                     if tmp == m["mountPath"] or tmp.startswith(m["mountPath"].rstrip("/") + "/")), reverse=True)
    (cache,) = [m["name"] for m in sidecar["volumeMounts"] if m["mountPath"] == option(restore_args, "--into")[0]]
    size = _gibibytes(volumes[mounts[0][1]]["emptyDir"]["sizeLimit"])
    assert size >= _gibibytes(volumes[cache]["emptyDir"]["sizeLimit"])


def env_of(container) -> dict[str, str]:
    """name -> value, or "secret:NAME/KEY" for a value from a Secret."""
    env = {}
    for e in container.get("env", []):
        ref = (e.get("valueFrom") or {}).get("secretKeyRef")
        env[e["name"]] = f"secret:{ref['name']}/{ref['key']}" if ref else str(e.get("value"))
    return env


def kcache_users():
    """(verb, container) for each container that runs kcache: restore, watch or prebake."""
    for _, _, spec in pod_specs():
        for container in containers(spec):
            verbs = [resolve(a)[0] for a in kcache_calls(container)]
            for verb in ("restore", "watch", "prebake"):
                if [verb] in verbs:
                    yield verb, container


def test_store_is_one_and_credentials_are_least_privilege():
    users = dict(kcache_users())
    assert sorted(users) == ["prebake", "restore", "watch"]

    def store(container):
        flag = [v for a in kcache_calls(container) for v in option(a, "--store")]
        return flag[0] if flag else env_of(container).get("KCACHE_STORE")

    assert len({store(c) for c in users.values()}) == 1 and store(users["restore"]).startswith("s3://")
    restore_env = env_of(users["restore"])
    assert restore_env["KCACHE_INDEX"] == "none", "restore reads refs/: no database credentials in the init container"
    assert restore_env["AWS_ROLE_ARN"].endswith("role/kcache-reader")
    for verb in ("watch", "prebake"):
        env = env_of(users[verb])
        assert env["AWS_ROLE_ARN"].endswith("role/kcache-writer"), verb
        assert env["KCACHE_INDEX"] == "secret:kcache-index/writer-url", verb


def test_no_pod_uses_static_keys_and_the_fallback_secret_says_so():
    secrets = {doc["metadata"]["name"]: doc for _, doc in documents() if doc["kind"] == "Secret"}
    assert "fallback" in secrets["kcache-static-keys"]["metadata"]["annotations"]["kcache.example/fallback"]
    for _, _, spec in pod_specs():
        for container in containers(spec):
            env = env_of(container)
            assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} & set(env), container["name"]
            assert not any(v.startswith("secret:kcache-static-keys/") for v in env.values()), container["name"]


def test_pods_use_a_service_account_with_workload_identity():
    accounts = {doc["metadata"]["name"]: doc for _, doc in documents() if doc["kind"] == "ServiceAccount"}
    for name, _, spec in pod_specs():
        account = accounts[spec["serviceAccountName"]]
        assert account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].startswith("arn:aws:iam::"), name
        assert spec["automountServiceAccountToken"] is False, f"{name}: no Kubernetes API token in the pod"
        tokens = {v["name"]: v for v in spec["volumes"] if "projected" in v}
        for container in containers(spec):
            env = env_of(container)
            if "AWS_ROLE_ARN" not in env:
                assert not kcache_calls(container) or container["name"] == "model", container["name"]
                continue
            (volume,) = [m for m in container["volumeMounts"] if env["AWS_WEB_IDENTITY_TOKEN_FILE"].startswith(
                m["mountPath"] + "/")]  # fmt: skip
            source = tokens[volume["name"]]["projected"]["sources"][0]["serviceAccountToken"]
            assert source["audience"] == "sts.amazonaws.com" and volume["readOnly"], container["name"]


def test_the_model_container_has_no_cache_credentials():
    spec, _, _, model = deployment()
    env = env_of(model)
    assert not [n for n in env if n.startswith("AWS_") or n == "KCACHE_INDEX"]


def test_the_eks_webhook_gives_no_role_to_a_container_that_names_none():
    """A ServiceAccount's eks.amazonaws.com/role-arn makes the EKS pod identity webhook add that role
    (AWS_ROLE_ARN and a token) to every container of the pod that names none, except those the pod lists
    under eks.amazonaws.com/skip-containers: the model container, which the example promises no cache
    credentials, ran with the reader role, and so did the DaemonSet's root chown step."""
    accounts = {d["metadata"]["name"]: d for _, d in documents() if d["kind"] == "ServiceAccount"}
    checked = 0
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            template = (doc or {}).get("spec", {}).get("template", {})
            spec = template.get("spec")
            account = accounts.get((spec or {}).get("serviceAccountName"))
            if account is None or "eks.amazonaws.com/role-arn" not in account["metadata"].get("annotations", {}):
                continue  # no webhook mutation
            listed = template.get("metadata", {}).get("annotations", {}).get("eks.amazonaws.com/skip-containers", "")
            skipped = {name.strip() for name in listed.split(",")}
            for container in containers(spec):
                if "AWS_ROLE_ARN" not in env_of(container):
                    checked += 1
                    assert container["name"] in skipped, f"{path.name}:{container['name']} gets the webhook's role"
    assert checked >= 2  # the model container and the DaemonSet's chown step


def test_every_container_is_locked_down():
    for name, _, spec in pod_specs():
        pod = spec.get("securityContext", {})
        assert pod.get("runAsNonRoot") is True and pod["seccompProfile"]["type"] == "RuntimeDefault", name
        for container in containers(spec):
            where, ctx = f"{name}:{container['name']}", container.get("securityContext", {})
            assert ctx.get("runAsNonRoot", pod.get("runAsNonRoot")) is True, where
            assert ctx.get("runAsUser", 1) != 0, where
            assert ctx.get("readOnlyRootFilesystem") is True, where
            assert ctx.get("allowPrivilegeEscalation") is False, where
            assert ctx.get("capabilities", {}).get("drop") == ["ALL"] and not ctx["capabilities"].get("add"), where
            assert ctx.get("seccompProfile", pod["seccompProfile"])["type"] == "RuntimeDefault", where
            assert not ctx.get("privileged"), where


def writable_mounts(spec, container) -> list[str]:
    empty = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
    return [m["mountPath"] for m in container.get("volumeMounts", []) if m["name"] in empty and not m.get("readOnly")]


def test_every_path_a_container_writes_is_an_emptydir():
    for name, _, spec in pod_specs():
        for container in containers(spec):
            env, mounts = env_of(container), writable_mounts(spec, container)
            wanted = [env[v] for v in ("TMPDIR", "HOME", "KCACHE_HOME", "HF_HOME") if v in env]
            for args in kcache_calls(container):
                wanted += option(args, "--root") + option(args, "--into")
                # Publish builds its packs in the temp dir whatever KCACHE_HOME says (kcache.workdir), and
                # the kcache image's KCACHE_HOME is /tmp/kcache.
                wanted.append(env.get("TMPDIR", "/tmp"))
            for path in wanted:
                assert any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounts), (
                    f"{name}:{container['name']} writes {path} on a read-only root filesystem"
                )


def test_images_are_pinned():
    for name, _, spec in pod_specs():
        for container in containers(spec):
            image = container["image"]
            if "@sha256:" in image:
                continue
            repo, _, tag = image.rpartition(":")
            assert repo and "/" not in tag and re.fullmatch(r"v?\d+(\.\d+)+", tag), f"{name}: {image} is not pinned"


def test_every_container_has_requests_and_limits():
    for name, _, spec in pod_specs():
        for container in containers(spec):
            resources, where = container.get("resources", {}), f"{name}:{container['name']}"
            assert {"cpu", "memory"} <= set(resources.get("requests", {})), where
            assert {"cpu", "memory"} <= set(resources.get("limits", {})), where


def test_the_job_is_bounded_in_time_and_cleaned_up():
    (job,) = [doc for _, doc in documents() if doc["kind"] == "Job"]
    assert 0 < job["spec"]["activeDeadlineSeconds"] <= 6 * 3600
    assert job["spec"]["ttlSecondsAfterFinished"] > 0


def test_pods_land_on_the_node_type_the_facts_describe():
    (configmap,) = [doc for _, doc in documents() if doc["metadata"]["name"] == "llm-kcache-facts"]
    facts = json.loads(configmap["data"]["facts.json"])["facts"]
    for name, _, spec in pod_specs():
        labels = spec["nodeSelector"]
        assert labels["nvidia.com/gpu.product"] == facts["gpu.name"].replace(" ", "-"), name
        driver = ".".join(labels[f"nvidia.com/cuda.driver.{part}"] for part in ("major", "minor", "rev"))
        assert driver == facts["gpu.driver"], name


def test_a_failed_warmup_does_not_stall_a_rollout():
    spec, _, _, _ = deployment()
    (warm,) = [a for c in spec["containers"] for a in kcache_calls(c) if resolve(a)[0] == ["warmup"]]
    assert option(warm, "--on-failure") == ["ready-cold"]
    assert int(option(warm, "--retries")[0]) > 0 and float(option(warm, "--budget")[0]) > 0
    assert float(option(warm, "--budget")[0]) >= float(option(warm, "--wait-timeout")[0])


CALLS = [(f"{name}:{c['name']}", args) for name, _, s in pod_specs() for c in containers(s) for args in kcache_calls(c)]


@pytest.mark.parametrize("where, args", CALLS, ids=[w for w, _ in CALLS])
def test_kcache_flags_exist(where, args):
    path, command, rest = resolve(args)
    if command is None and path[0] in PENDING:
        pytest.skip(f"kcache {' '.join(path)} is not registered yet")
    assert command is not None, f"{where}: no command kcache {' '.join(path)}"
    known = {opt for param in command.params for opt in param.opts}
    flags = [a.split("=", 1)[0] for a in rest if a.startswith("--")]
    assert flags and all(f in known for f in flags), f"{where}: unknown {set(flags) - known}"
    # and click accepts the whole line (types, ranges, required options)
    command.make_context(" ".join(path), list(rest), resilient_parsing=False).close()


def test_facts_files_are_mounted_where_kcache_reads_them():
    for name, _, spec in pod_specs():
        for container in containers(spec):
            mounts = [m["mountPath"] for m in container.get("volumeMounts", [])]
            for args in kcache_calls(container):
                for path in option(args, "--facts-file"):
                    assert any(path.startswith(m.rstrip("/") + "/") for m in mounts), f"{name}:{container['name']}"


def test_the_model_probe_waits_longer_than_the_engine_check():
    """/readyz asks the model server with --health-url: the kubelet's default 1 s must not cut it first."""
    from kcache import readiness

    _, _, _, model = deployment()
    assert readiness.ENGINE_TIMEOUT < 1, "faster than the kubelet's default timeoutSeconds, for probes that set none"
    assert model["readinessProbe"]["timeoutSeconds"] >= readiness.ENGINE_TIMEOUT + 1


def _sidecar_script() -> str:
    spec, _, _, _ = deployment()
    (sidecar,) = [c for c in spec["containers"] if any(resolve(a)[0] == ["watch"] for a in kcache_calls(c))]
    assert sidecar["command"] == ["sh", "-c"]
    return " ".join(sidecar["args"])


FAKE_KCACHE = """\
import os, sys, threading
print(sys.argv[1], os.getpid(), flush=True)
if sys.argv[1] == "warmup" and os.environ.get("FAKE_WARMUP") == "hang":
    threading.Event().wait()  # until a signal ends it (the default SIGTERM action)
sys.exit(13 if sys.argv[1] == "warmup" else 0)
"""


def _run_sidecar(tmp_path, warmup: str):
    import subprocess
    import sys

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kcache").write_text(f"#!{sys.executable}\n{FAKE_KCACHE}")
    (bin_dir / "kcache").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_WARMUP": warmup}
    return subprocess.Popen(["sh", "-c", _sidecar_script()], env=env, stdout=subprocess.PIPE, text=True)


def test_the_sidecar_stops_on_sigterm_during_warmup(tmp_path):
    """The sidecar's sh is the container's PID 1, which ignores a signal it has no handler for: without
    its trap the kubelet's SIGTERM would wait out the whole warmup and end in a SIGKILL. Here (not PID 1)
    it shows as the warmup outliving its shell."""
    import os
    import signal
    import subprocess

    shell = _run_sidecar(tmp_path, "hang")
    verb, pid = shell.stdout.readline().split()
    assert verb == "warmup"
    try:
        shell.send_signal(signal.SIGTERM)
        rest, _ = shell.communicate(timeout=10)  # EOF once the warmup, which holds stdout too, is gone
    except subprocess.TimeoutExpired:
        raise AssertionError("the warmup kept running after the sidecar's SIGTERM") from None
    finally:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
        shell.kill()
        shell.wait()
    assert shell.returncode == 128 + signal.SIGTERM and "watch" not in rest


def test_the_sidecar_watches_after_warmup_whatever_its_outcome(tmp_path):
    shell = _run_sidecar(tmp_path, "fail")
    out, _ = shell.communicate(timeout=30)
    assert [line.split()[0] for line in out.splitlines()] == ["warmup", "watch"] and shell.returncode == 0
