"""The `kcache` process ends cheaply: the objects a command leaves are frozen before the interpreter's
final collections, which would otherwise walk all of them (boto3's alone are ~0.05 s of a restore)."""

import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: kcache depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
# Runs the CLI as the script does; an exit hook registered first runs last, after the command.
AFTER_EXIT = (
    "import atexit, gc, sys\n"
    "atexit.register(lambda: print('frozen', gc.get_freeze_count()))\n"
    "from kcache.cli import run\n"
    "sys.argv = ['kcache', *sys.argv[1:]]\n"
    "run()\n"
)


def frozen_at_exit(args: list[str], home: Path) -> tuple[int, int]:
    env = {"KCACHE_HOME": str(home), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", AFTER_EXIT, *args], env=env, capture_output=True, text=True)
    line = proc.stdout.splitlines()[-1]
    assert line.startswith("frozen "), proc.stdout + proc.stderr
    return proc.returncode, int(line.split()[1])


@pytest.mark.parametrize("args, code", [(["--version"], 0), (["restore", "--into", "ROOT", "--model", "m",
                                                               "--index", "none"], 0), (["no-such-command"], 2)])
def test_whatever_the_command_and_its_exit_code_the_objects_are_frozen_before_the_interpreter_ends(tmp_path, args,
                                                                                                   code):
    args = [str(tmp_path / "root") if a == "ROOT" else a for a in args]
    returncode, frozen = frozen_at_exit(args, tmp_path / "home")
    assert returncode == code
    assert frozen > 1000  # every module's objects, not a handful


def test_the_script_and_python_m_kcache_both_end_through_run():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["kcache"] == "kcache.cli:run"
    main_module = (ROOT / "kcache" / "__main__.py").read_text()
    assert "run()" in main_module
