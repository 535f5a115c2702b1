"""`kcache` imports a command's module only when that command is looked up: an init container's
`kcache restore` must not pay for the proxy, the server, warmup or the others."""

import subprocess
import sys

from kcache.cli import COMMANDS, main


def modules_after(argv: list[str], env_home) -> set[str]:
    code = (
        "import sys\nfrom kcache.cli import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('kcache.cli.'))))\n"
    )
    env = {"KCACHE_HOME": str(env_home), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return set(out.stdout.splitlines()[-1].split())  # the last line; restore's JSON comes before it


def test_restore_imports_only_its_own_command_module(tmp_path):
    loaded = modules_after(["restore", "--into", str(tmp_path / "root"), "--model", "m", "--json"], tmp_path / "home")
    command_modules = {m for m in loaded if m.endswith("_cmd")}
    assert command_modules == {"kcache.cli.restore_cmd"}


def test_every_command_is_listed_and_loads_under_its_name():
    assert sorted(main.list_commands(None)) == sorted(COMMANDS)
    for name in COMMANDS:
        assert main.commands[name].name == name
    assert main.commands.get("no-such-command") is None


def test_restore_does_not_import_warmup_to_describe_its_errors(tmp_path):
    """The error table names classes by module: describing an error costs restore no imports."""
    code = (
        "import sys\nfrom kcache.cli import main\n"
        f"try:\n    main(['restore', '--into', {str(tmp_path / 'root')!r}, '--model', 'm', '--index', 'none'])\n"
        "except SystemExit:\n    pass\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('kcache.'))))\n"
    )
    env = {"KCACHE_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    loaded = set(out.stdout.splitlines()[-1].split())
    assert "kcache.cli.restore_cmd" in loaded  # the run really happened
    assert not loaded & {"kcache.warmup", "kcache.prebake", "kcache.http_client", "kcache.profiles"}, loaded
