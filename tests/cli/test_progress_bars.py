"""Progress bars: drawn on a terminal (a real pseudo-terminal here), nothing extra anywhere else.

Both cases run the real `kcache` in a child process, so what counts is the child's own stderr:
a pipe in one case, the slave side of a pty in the other.
"""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner
from trees import write_tree

from kcache.cli import main

MiB = 1024 * 1024
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# Prints whether rich was imported, after the command ran: a bar nobody sees must cost nothing.
LAUNCHER = (
    "import sys\n"
    "from kcache.cli import main\n"
    "try:\n"
    "    main(sys.argv[1:])\n"
    "except SystemExit as exc:\n"
    "    code = exc.code\n"
    "print('rich-imported' if 'rich' in sys.modules else 'rich-not-imported')\n"
    "sys.exit(code)\n"
)


@pytest.fixture
def published(tmp_path):
    files = {f"inductor/fx/{i:03d}.py": os.urandom(2000) for i in range(40)}
    files["triton/k/big.cubin"] = os.urandom(6 * MiB)
    write_tree(tmp_path / "src", files)
    store = f"file://{tmp_path / 'store'}"
    args = ["publish", "--from", str(tmp_path / "src"), "--model", "m", "--store", store,
            "--index", f"sqlite:///{tmp_path / 'i.db'}"]  # fmt: skip
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return store, tmp_path / "i.db"


def command(verb: str, tmp_path, store: str, db) -> list[str]:
    where = {
        "restore": ["--into", str(tmp_path / "dst")],
        "publish": ["--from", str(tmp_path / "src")],
        "prefetch": ["--node-cache", str(tmp_path / "node"), "--once"],
        "verify": ["--read-data"],
    }[verb]
    model = [] if verb == "verify" else ["--model", "m"]
    return [sys.executable, "-c", LAUNCHER, verb, *where, *model, "--store", store,
            "--index", f"sqlite:///{db}"]  # fmt: skip


def run_on_pty(argv: list[str]) -> tuple[int, str, str]:
    """Run argv with stderr on a pseudo-terminal; (exit code, stdout, what the terminal showed)."""
    master, slave = pty.openpty()
    env = dict(os.environ, COLUMNS="160", TERM="xterm")
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave, env=env)
    os.close(slave)
    shown = bytearray()
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not data:
            break
        shown += data
    os.close(master)
    stdout = proc.stdout.read().decode()
    proc.stdout.close()
    return proc.wait(timeout=60), stdout, shown.decode(errors="replace")


@pytest.mark.parametrize("verb", ["restore", "publish", "prefetch", "verify"])
def test_nothing_extra_on_stderr_when_it_is_not_a_terminal(tmp_path, published, verb):
    store, db = published
    if verb == "publish":  # a second publish of changed files: there is something to upload
        write_tree(tmp_path / "src", {"inductor/fx/new.py": os.urandom(3 * MiB)})
    proc = subprocess.run(command(verb, tmp_path, store, db), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert "rich-not-imported" in proc.stdout
    if verb == "prefetch":  # it did its work: the bundle's packs are in the node cache
        assert "1 packs (" in proc.stdout and "1 fetched" in proc.stdout, proc.stdout


@pytest.mark.parametrize("verb, phase", [("restore", "restoring"), ("publish", "uploading"),
                                         ("prefetch", "prefetching"), ("verify", "verifying")])  # fmt: skip
def test_a_terminal_shows_bytes_files_rate_and_eta(tmp_path, published, verb, phase):
    store, db = published
    if verb == "publish":
        write_tree(tmp_path / "src", {"inductor/fx/new.py": os.urandom(3 * MiB)})
    code, stdout, shown = run_on_pty(command(verb, tmp_path, store, db))
    assert code == 0, shown
    assert "rich-imported" in stdout
    drawn = [ANSI.sub("", line) for line in shown.replace("\r", "\n").splitlines() if phase in line]
    assert drawn, shown
    line = drawn[-1]  # the last frame: the phase finished
    files = {"restore": "41/41 files", "publish": "1/1 files", "prefetch": "1/1 packs", "verify": "41/41 files"}[verb]
    assert files in line  # files done of files in all
    assert re.search(r"\d/\d+\.\d MB", line)  # bytes done of bytes in all
    assert re.search(r"\d+\.\d (KiB|MiB|GiB)/s", line)  # the rate
    assert line.rstrip().endswith("done")  # the time left, at the end: none


def test_rate_and_time_left_are_the_mean_since_the_phase_began():
    from kcache.cli.progress_bars import _fields
    from kcache.progress import Update

    fields = _fields(Update("restoring", 3, 12, 25 * MiB, 100 * MiB), elapsed=2.0)
    assert fields == {"files": "3/12 files", "rate": "12.5 MiB/s", "left": "6 s left"}
    assert _fields(Update("restoring", 12, 12, 100 * MiB, 100 * MiB, done=True), elapsed=4.0)["left"] == "done"
