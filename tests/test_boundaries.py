"""Each heavy dependency is imported by one part of kcache only (see STYLE.md)."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kcache"

# module prefix -> the only places (relative to kcache/) allowed to import it
ALLOWED = {
    "boto3": ("store/s3.py",),
    "botocore": ("store/s3.py",),
    "sqlalchemy": ("index/",),
    "alembic": ("index/",),
    "click": ("cli/",),
    "rich": ("cli/progress_bars.py",),  # imported only when stderr is a terminal
    "torch": ("sources/", "torch/"),
    "triton": ("sources/", "torch/"),
    "aiohttp": ("proxy/",),
    "multidict": ("proxy/",),
    "redis": ("proxy/",),
}


def imports(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name.split(".")[0], node
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module.split(".")[0], node


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_dependency_boundaries(path):
    rel = path.relative_to(PACKAGE).as_posix()
    for top, node in imports(path):
        allowed = ALLOWED.get(top)
        if allowed is not None:
            assert rel.startswith(allowed), f"{rel}:{node.lineno} imports {top}; only {allowed} may"


def test_restore_and_the_cli_never_import_the_proxy_stack():
    # The init container runs `kcache restore`; its image need not even ship aiohttp or redis.
    code = (
        "import sys, kcache.cli, kcache.restore; from kcache.cli import main; main.commands['proxy'].get_help; "
        "print(sorted(m for m in ('aiohttp', 'redis', 'kcache.proxy.server') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_plain_restore_leaves_the_node_cache_unloaded():
    """The init container pays for every module `kcache restore` loads before the model does: the
    node cache's (~4 ms) only with --node-cache."""
    code = (
        "import sys, kcache.cli, kcache.restore, kcache.cli.restore_cmd; "
        "print(sorted(m for m in ('kcache.store.nodecache',) if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_torch_facing_modules_import_torch_lazily():
    for path in PACKAGE.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:  # module level only
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not any(n.split(".")[0] in ("torch", "triton") for n in names), (
                f"{path} imports torch at import time"
            )


def test_library_never_prints():
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("cli/") or rel == "torch/workload.py":  # a child-process entry point
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in ("print", "exit"), f"{rel}:{node.lineno} calls {node.func.id}"


# Writes to $KCACHE_TEST_IMPORT_LOG, as the process exits, the torch and triton modules it loaded (a
# find_spec that only locates a package loads nothing, and is not counted).
IMPORT_LOGGER = """
import atexit, os, sys

def _loaded():
    names = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "triton"))
    with open(os.environ["KCACHE_TEST_IMPORT_LOG"], "a") as log:
        log.write("exit " + " ".join(names) + "\\n")

if os.environ.get("KCACHE_TEST_IMPORT_LOG"):
    atexit.register(_loaded)
"""


@pytest.mark.torch
def test_a_restore_with_every_torch_layer_never_imports_torch(tmp_path):
    """The init container's image need not ship torch, and importing it costs a second of the pod's
    start: `kcache restore` lays out Inductor, its headers and Triton by their names and paths alone,
    also with --fallback layers and --run-as (whose header directory is torch's naming)."""
    pytest.importorskip("torch")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(IMPORT_LOGGER)
    log = tmp_path / "imports.log"
    env = {**os.environ, "PYTHONPATH": str(site), "KCACHE_HOME": str(tmp_path / "home"),
           "KCACHE_TEST_IMPORT_LOG": str(log)}  # fmt: skip
    src = tmp_path / "src"
    for rel in ("inductor/fx/k.py", "triton/abc/k.cubin", "tmp/torchinductor_root/precompiled_headers/x.h.gch"):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(b"kernel")
    kcache = [sys.executable, "-m", "kcache"]
    publish_env = {k: v for k, v in env.items() if k != "KCACHE_TEST_IMPORT_LOG"}
    subprocess.run([*kcache, "publish", "--from", str(src), "--model", "m"], env=publish_env, check=True,
                   capture_output=True)  # fmt: skip
    # --fallback layers under another model: a hit never reaches the donors, their layer keys and headers.
    for model, extra, status in (("m", (), "hit"), ("m2", ("--fallback", "layers"), "partial"),
                                 ("m", ("--run-as", "1000"), "hit")):  # fmt: skip
        done = subprocess.run([*kcache, "restore", "--into", str(tmp_path / f"root{len(extra)}{extra[:1]}"),
                               "--model", model, "--json", *extra], env=env, capture_output=True,
                              text=True)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["status"] == status
    assert log.read_text().splitlines() == ["exit "] * 3
