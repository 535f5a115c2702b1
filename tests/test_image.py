"""The init image is reproducible: bounded dependencies, a hashed lock the Dockerfile installs from,
a dependency layer that source changes do not touch, and a version that names its commit."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: kcache depends on tomli there
    import tomli as tomllib
from click.testing import CliRunner
from packaging.requirements import Requirement

from kcache import __version__, buildinfo
from kcache.cli import main

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
IMAGE_LOCK = REPO / "constraints" / "image.txt"
DOCKERFILE = (REPO / "Dockerfile").read_text()


def pins(path: Path) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, hashes) of a pip-compile file with --generate-hashes."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    found = {}
    for line in text.splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)((?:\s+--hash=sha256:[0-9a-f]{64})+)", line)
        assert match, f"{path.name}: not a pinned, hashed requirement: {line[:80]}"
        found[match[1].lower().replace("_", "-")] = (match[2], re.findall(r"sha256:([0-9a-f]{64})", match[3]))
    return found


def image_requirements() -> list[Requirement]:
    reqs = [Requirement(r) for r in PYPROJECT["dependencies"] + PYPROJECT["optional-dependencies"]["postgres"]]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"python_version": "3.11"})]


def test_runtime_dependencies_have_upper_bounds():
    for extra in ("dependencies", "gpu", "postgres"):
        for spec in PYPROJECT[extra] if extra == "dependencies" else PYPROJECT["optional-dependencies"][extra]:
            req = Requirement(spec)
            assert any(s.operator in ("<", "<=", "==", "~=") for s in req.specifier), f"{spec} has no upper bound"


def test_the_lock_pins_every_image_dependency_with_hashes_within_pyproject_bounds():
    locked = pins(IMAGE_LOCK)
    for req in image_requirements():
        name = req.name.lower().replace("_", "-")
        assert name in locked, f"{req.name} is missing from {IMAGE_LOCK.name}"
        version, hashes = locked[name]
        assert req.specifier.contains(version), f"{name}=={version} is outside {req}"
        assert hashes
    assert "nvidia-ml-py" not in locked and "torch" not in locked  # the image never sees a GPU
    assert pins(REPO / "constraints" / "build.txt")["setuptools"][1]


def test_the_dockerfile_installs_only_from_the_lock_and_never_the_gpu_extra():
    assert "[gpu" not in DOCKERFILE and ",gpu" not in DOCKERFILE
    # The proxy sidecar's stage adds aiohttp and redis within pyproject's bounds; the init image is locked.
    stages = re.split(r"^(?=FROM )", DOCKERFILE, flags=re.M)
    init_image = "".join(s for s in stages if " AS proxy" not in s.split("\n")[0])
    installs = [line for line in init_image.splitlines() if "pip install" in line]
    assert installs and all("--require-hashes" in line or "--no-index" in line for line in installs), installs
    assert all("--no-deps" in line for line in installs)
    assert "-r /tmp/image.txt" in DOCKERFILE and "COPY constraints/image.txt" in DOCKERFILE
    assert re.search(r"^ARG PYTHON_IMAGE=python:\d+\.\d+\.\d+-slim", DOCKERFILE, re.M), "pin the base image"


def test_the_dependency_layer_does_not_see_the_source():
    stages = re.split(r"^FROM ", DOCKERFILE, flags=re.M)[1:]
    (deps,) = [s for s in stages if s.split()[2:3] == ["deps"]]
    copies = re.findall(r"^COPY (\S+)", deps, re.M)
    assert copies == ["constraints/image.txt"], "a source change would rebuild the dependencies"
    final = stages[-1]
    assert "COPY --from=deps /opt/kcache /opt/kcache" in final
    assert final.index("--from=deps") < final.index("--from=build"), "dependencies first, then kcache's wheel"


def test_the_commit_is_baked_in_by_a_build_arg():
    assert re.search(r"^ARG KCACHE_COMMIT", DOCKERFILE, re.M)
    assert "kcache/_commit.txt" in DOCKERFILE and DOCKERFILE.index("kcache/_commit.txt") < DOCKERFILE.index("pip wheel")
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "_commit.txt" in package_data["kcache"]


def test_version_shows_a_baked_commit(tmp_path, monkeypatch):
    baked = tmp_path / "_commit.txt"
    baked.write_text("v0.1.0-3-gabc123def456\n")
    monkeypatch.setattr(buildinfo, "COMMIT_FILE", baked)
    result = CliRunner().invoke(main, ["--version"], catch_exceptions=False)
    assert result.output == f"kcache {__version__} (commit v0.1.0-3-gabc123def456)\n"


@pytest.mark.skipif(not (REPO / ".git").exists(), reason="not a git checkout")
def test_version_falls_back_to_git_describe_in_a_checkout(tmp_path, monkeypatch):
    monkeypatch.setattr(buildinfo, "COMMIT_FILE", tmp_path / "absent.txt")
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip
    assert head in buildinfo.commit()
    out = subprocess.run([sys.executable, "-m", "kcache", "--version"], capture_output=True, text=True, check=True)
    assert re.fullmatch(rf"kcache {re.escape(__version__)} \(commit \S+\)\n", out.stdout)


def test_a_hostile_commit_file_is_made_printable(tmp_path, monkeypatch):
    baked = tmp_path / "_commit.txt"
    baked.write_text("abc\x1b]2;x\x07" + "d" * 500)
    monkeypatch.setattr(buildinfo, "COMMIT_FILE", baked)
    assert "\x1b" not in buildinfo.commit() and len(buildinfo.commit()) <= 80
