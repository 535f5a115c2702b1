"""A ninja build folder restored elsewhere is up to date for the real ninja (kcache.ninjabuild).

The hashes are checked against logs the real ninja writes: the venv's (1.13, log v7, rapidhash) and
the system's where it is older (1.11/1.12, log v5/v6, MurmurHash64A).
"""

import logging
import os
import shutil
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from kcache import ninjabuild, ninjahash, sources
from kcache.publish import publish
from kcache.restore import restore

VENV_NINJA = Path(sys.executable).parent / "ninja"
NINJAS = [p for p in (str(VENV_NINJA), shutil.which("ninja"), "/usr/bin/ninja") if p and Path(p).exists()]

# Commands of every length class rapidhash treats apart (0-3, 4-16, 17-48, 49-96, 97+ bytes).
LENGTHS = [0, 1, 3, 4, 7, 8, 15, 16, 17, 31, 32, 33, 47, 48, 49, 95, 96, 97, 143, 144, 200, 300]


def ninja_version(ninja: str) -> str:
    return subprocess.run([ninja, "--version"], capture_output=True, text=True, check=True).stdout.strip()


def run_ninja(ninja: str, folder: Path, *args: str) -> str:
    done = subprocess.run([ninja, "-C", str(folder), *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


@pytest.fixture(params=sorted(set(NINJAS), key=NINJAS.index))
def ninja(request):
    return request.param


def log_entries(folder: Path) -> tuple[int, dict[str, int]]:
    lines = (folder / ".ninja_log").read_text().splitlines()
    version = int(lines[0].removeprefix("# ninja log v"))
    return version, {f[3]: int(f[4], 16) for f in (line.split("\t") for line in lines[1:])}


def test_command_hashes_are_the_ones_ninja_logs(tmp_path, ninja):
    commands = {f"o{n}": ("touch $out #" + "x" * n) for n in LENGTHS}
    commands.update({f"s{n}": ":" + " " * n for n in range(4)})  # shorter than `touch`
    text = "".join(f"rule r_{out}\n  command = {cmd}\nbuild {out}: r_{out}\n" for out, cmd in commands.items())
    (tmp_path / "build.ninja").write_text(text)
    run_ninja(ninja, tmp_path)
    version, logged = log_entries(tmp_path)
    hasher = ninjahash.LOG_HASHES[version]
    assert set(logged) == set(commands)
    for out, cmd in commands.items():
        assert hasher(cmd.replace("$out", out).encode()) == logged[out], (ninja_version(ninja), out)


BUILD = """ninja_required_version = 1.3
cxx = cp
flags = -p
mirror = /mirror{folder}/include -I{folder}/include

rule compile
  command = $cxx $flags $in $out && printf '%s: %s\\n' $out $in > $out.d
  depfile = $out.d
  deps = gcc

rule link
  command = cp $in $out

build main.o: compile {folder}/main.cpp
build kc_inline.so: link main.o

build all: phony kc_inline.so
default kc_inline.so
"""


def built(base: Path, ninja: str) -> Path:
    """A folder laid out as load_inline leaves one: its source inside, named by absolute path."""
    folder = base / "torch_extensions/kc_inline"
    folder.mkdir(parents=True)
    (folder / "main.cpp").write_text("int x;\n")
    (folder / "build.ninja").write_text(BUILD.format(folder=folder))
    run_ninja(ninja, folder)
    assert "no work to do" in run_ninja(ninja, folder, "-n", "-d", "explain")
    return folder


def moved(folder: Path, base: Path) -> Path:
    """The layer's folder moved (by rename: mtimes kept, as restore lays them) under `base`."""
    layer = base / "torch_extensions"
    layer.parent.mkdir(parents=True)
    os.rename(folder.parent, layer)
    return layer / folder.name


def files_of(folder: Path) -> frozenset[str]:
    return frozenset(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def test_a_moved_folder_is_up_to_date_after_relocation(tmp_path, ninja):
    folder = moved(built(tmp_path / "pub", ninja), tmp_path / "pod/elsewhere")
    assert ninjabuild.relocate_folder(folder, folder, files_of(folder))
    text = (folder / "build.ninja").read_text()
    assert f"= /mirror{tmp_path}/pub/torch_extensions/kc_inline/include -I{folder}/include\n" in text  # not in it
    assert str(tmp_path / "pub") not in text.replace(f"/mirror{tmp_path}/pub", "")
    assert str(tmp_path / "pub").encode() not in (folder / ".ninja_deps").read_bytes()
    explained = run_ninja(ninja, folder, "-n", "-d", "explain")
    assert "no work to do" in explained, explained


def test_a_moved_folder_is_rebuilt_without_relocation(tmp_path, ninja):
    """The control: torch writes build.ninja for the new place, and ninja finds the command changed."""
    folder = moved(built(tmp_path / "pub", ninja), tmp_path / "pod/elsewhere")
    (folder / "build.ninja").write_text(BUILD.format(folder=folder))
    assert "no work to do" not in run_ninja(ninja, folder, "-n", "-d", "explain")


def test_restore_under_another_root_relocates_the_folder(tmp_path, store, sqlite_index, fp, ninja):
    built(tmp_path / "src", ninja)
    publish(store, sqlite_index, fp, sources.select(["torch_extensions"]), root=tmp_path / "src", env={})
    shutil.rmtree(tmp_path / "src")
    assert restore(store, sqlite_index, fp, tmp_path / "dst").status == "hit"
    folder = tmp_path / "dst/torch_extensions/kc_inline"
    (folder / "build.ninja").write_text(BUILD.format(folder=folder))  # what torch writes there
    explained = run_ninja(ninja, folder, "-n", "-d", "explain")
    assert "no work to do" in explained, explained


def test_restore_of_a_malformed_deps_log_hits_and_leaves_it(tmp_path, store, sqlite_index, fp, caplog):
    folder = built(tmp_path / "src", NINJAS[0])
    (folder / ".ninja_deps").write_bytes(deps(path_record(b"main.o", 0, checksum=5)))
    published = {n: (folder / n).read_bytes() for n in ninjabuild.FILES}
    publish(store, sqlite_index, fp, sources.select(["torch_extensions"]), root=tmp_path / "src", env={})
    with caplog.at_level(logging.WARNING, logger="kcache.ninjabuild"):
        assert restore(store, sqlite_index, fp, tmp_path / "dst").status == "hit"
    restored = tmp_path / "dst/torch_extensions/kc_inline"
    assert {n: (restored / n).read_bytes() for n in ninjabuild.FILES} == published  # ninja rebuilds it
    assert "leaving ninja build kc_inline as published" in caplog.text


@pytest.mark.parametrize("name", [".ninja_log", ".ninja_deps"])
def test_restore_of_a_folder_whose_log_is_a_directory_hits_and_leaves_it(tmp_path, store, sqlite_index, fp, caplog,
                                                                          name):  # fmt: skip
    """A bundle whose build folder holds a directory where a log belongs (a file under `.ninja_log/`):
    opened as the log and read, it failed the whole restore with EISDIR (the pod started cold) where a
    folder relocation does not understand is left as published."""
    folder = built(tmp_path / "src", NINJAS[0])
    (folder / name).unlink()
    (folder / name).mkdir()
    (folder / name / "x").write_bytes(b"x")
    publish(store, sqlite_index, fp, sources.select(["torch_extensions"]), root=tmp_path / "src", env={})
    with caplog.at_level(logging.WARNING, logger="kcache.ninjabuild"):
        assert restore(store, sqlite_index, fp, tmp_path / "dst").status == "hit"
    restored = tmp_path / "dst/torch_extensions/kc_inline"
    assert (restored / "build.ninja").read_bytes() == (folder / "build.ninja").read_bytes()
    assert (restored / name / "x").read_bytes() == b"x"
    assert "leaving ninja build kc_inline as published" in caplog.text


def test_a_stale_log_entry_keeps_its_hash():
    """An entry whose hash is not its edge's command was stale where it was built: ninja reruns it anyway."""
    old, new = "cp /pub/main.cpp main.o", "cp /pod/main.cpp main.o"
    log = b"# ninja log v7\n0\t1\t2\tmain.o\t%x\n0\t1\t2\tmain.o\tabc\n0\t1\t2\tother\tdef\n"
    out = ninjabuild.rehash_log(log % ninjahash.rapidhash(old.encode()), {"main.o": (old, new)})
    assert out == log % ninjahash.rapidhash(new.encode())


def test_a_linked_log_is_not_followed(tmp_path, caplog):
    folder = hostile(tmp_path, ".ninja_log")
    (folder / ".ninja_log").unlink()
    (folder / ".ninja_log").symlink_to("/dev/zero")
    with caplog.at_level(logging.WARNING, logger="kcache.ninjabuild"):
        ninjabuild.relocate_folders(folder.parent, folder.parent, [f"kc_inline/{f}" for f in files_of(folder)])
    assert "is a symbolic link" in caplog.text
    assert str(tmp_path / "pub") in (folder / "build.ninja").read_text()  # nothing written


def test_relocation_leaves_the_mtimes(tmp_path):
    folder = moved(built(tmp_path / "pub", NINJAS[0]), tmp_path / "pod")
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    assert ninjabuild.relocate_folder(folder, folder, files_of(folder))
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before


def test_in_place_nothing_is_rewritten(tmp_path):
    folder = built(tmp_path / "pub", NINJAS[0])
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert not ninjabuild.relocate_folder(folder, folder, files_of(folder))
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def hostile(tmp_path, name: str, data: bytes | None = None, size: int | None = None) -> Path:
    folder = moved(built(tmp_path / "pub", NINJAS[0]), tmp_path / "pod")
    target = folder / name
    if data is not None:
        target.write_bytes(data)
    if size is not None:
        with target.open("r+b") as f:
            f.truncate(size)  # sparse: no disk, and reading it whole would take the memory
    return folder


def relocated_or_left(folder: Path, caplog) -> dict[str, bytes]:
    before = {n: (folder / n).read_bytes() for n in ninjabuild.FILES if (folder / n).stat().st_size < 1 << 26}
    with caplog.at_level(logging.WARNING, logger="kcache.ninjabuild"):
        ninjabuild.relocate_folders(folder.parent, folder.parent, [f"kc_inline/{f}" for f in files_of(folder)])
    assert "leaving ninja build kc_inline as published" in caplog.text
    assert {n: (folder / n).read_bytes() for n in before} == before  # nothing half-written
    return before


@pytest.mark.parametrize("name,size", [(".ninja_deps", 1 << 33), (".ninja_log", 1 << 33), ("build.ninja", 1 << 33)])
def test_huge_files_are_not_read(tmp_path, caplog, name, size):
    relocated_or_left(hostile(tmp_path, name, size=size), caplog)


def deps(*records: bytes, version: int = 4) -> bytes:
    return b"# ninjadeps\n" + struct.pack("<i", version) + b"".join(records)


def path_record(path: bytes, index: int, checksum: int | None = None) -> bytes:
    padded = path + b"\0" * (-len(path) % 4)
    checksum = ~index & 0xFFFFFFFF if checksum is None else checksum
    return struct.pack("<I", len(padded) + 4) + padded + struct.pack("<I", checksum)


@pytest.mark.parametrize("data", [
    deps(version=3),
    b"# ninjadeps\n",
    deps(path_record(b"main.o", 0))[:-2],  # ends inside a record
    deps(struct.pack("<I", 0x7FFFFFFF) + b"x" * 64),  # a size past ninja's own bound
    deps(path_record(b"main.o", 0, checksum=5)),  # a wrong id
    deps(path_record(b"main.o", 0), struct.pack("<Iiiii", 0x80000010, 0, 0, 0, 7)),  # an id never named
    deps(path_record(b"main.o", 0), struct.pack("<Iiii", 0x8000000E, 0, 0, 0)[:-2]),
], ids=["v3", "no-version", "truncated", "oversized", "checksum", "unknown-id", "odd-size"])  # fmt: skip
def test_malformed_deps_logs_leave_the_folder(tmp_path, caplog, data):
    relocated_or_left(hostile(tmp_path, ".ninja_deps", data), caplog)


@pytest.mark.parametrize("data", [
    b"# ninja log v8\n0\t1\t2\tmain.o\tabc\n",
    b"# ninja log v4\n0\t1\t2\tmain.o\tabc\n",
    b"0\t1\t2\tmain.o\tabc\n",
    b"# ninja log v7\n0\t1\t2\tmain.o\n",
    b"# ninja log v7\n0\t1\t2\tmain.o\tnot-hex\n",
    b"# ninja log v7\n0\t1\t2\tmain.o\tabc",
], ids=["too-new", "too-old", "no-header", "short", "not-hex", "unterminated"])  # fmt: skip
def test_malformed_build_logs_leave_the_folder(tmp_path, caplog, data):
    relocated_or_left(hostile(tmp_path, ".ninja_log", data), caplog)


def test_a_variable_bomb_is_refused_not_expanded(tmp_path, caplog):
    """Each top-level value doubles the last: 2^40 characters if it were evaluated."""
    folder = hostile(tmp_path, "build.ninja")
    bomb = "v0 = xxxxxxxx\n" + "".join(f"v{i + 1} = ${{v{i}}}$v{i}\n" for i in range(40))
    (folder / "build.ninja").write_text(bomb + BUILD.format(folder=tmp_path / "pub/torch_extensions/kc_inline"))
    relocated_or_left(folder, caplog)


def test_a_value_repeated_as_paths_is_refused_not_held(tmp_path, caplog):
    """100,000 inputs of 400 KiB each: 40 GiB evaluated if the folder's budget did not stop it."""
    folder = hostile(tmp_path, "build.ninja")
    big = "big = " + "x" * (400 * 1024) + "\n"
    (folder / "build.ninja").write_text(BUILD.format(folder=tmp_path / "pub/torch_extensions/kc_inline")
                                        + big + "build many: link" + " $big" * 100_000 + "\n")
    relocated_or_left(folder, caplog)


def test_nested_empty_variables_are_refused_not_looked_up_for_ever(tmp_path, caplog):
    """Rule variables are evaluated at each use, and an empty one costs no characters: three levels of 128
    references took 2 million look-ups from 1.5 KiB (a fourth level, hours), all within the budget."""
    folder = hostile(tmp_path, "build.ninja")
    levels = "".join(f"  v{i + 1} = " + f"$v{i}" * 128 + "\n" for i in range(3))
    nest = "rule nest\n  v0 =\n" + levels + "  command = true $v3\nbuild nested: nest\n"
    (folder / "build.ninja").write_text(BUILD.format(folder=tmp_path / "pub/torch_extensions/kc_inline") + nest)
    relocated_or_left(folder, caplog)
    assert "look-ups" in caplog.text


@pytest.mark.parametrize("text", [
    "include other.ninja\n",
    "pool p\n  depth = 1\n",
    "rule r\n  command = x\n  not a binding\n",
    "rule r\n  command = $(bad)\nbuild extra: r\n",
    "rule r\n  command = ${v\nbuild extra: r\n",
], ids=["include", "pool", "no-binding", "bad-escape", "open-brace"])  # fmt: skip
def test_manifests_it_does_not_know_leave_the_folder(tmp_path, caplog, text):
    folder = hostile(tmp_path, "build.ninja")
    (folder / "build.ninja").write_text(BUILD.format(folder=tmp_path / "pub/torch_extensions/kc_inline") + text)
    relocated_or_left(folder, caplog)


def test_a_folder_at_its_caps_is_relocated_in_bounded_memory(tmp_path):
    """build.ninja's values near the folder's evaluation budget and .ninja_deps at its cap: relocated in
    ~41 MiB. The manifests stayed alive in a reference cycle (command()'s lookup handed itself to
    _expand) while the logs were rewritten, and each rewritten log was copied once more into bytes:
    56 MiB, on top of a restore whose manifest at the cap already holds most of its 256 MiB bound."""
    pub, folder = tmp_path / "pub/torch_extensions/kc_inline", tmp_path / "pod/torch_extensions/kc_inline"
    folder.mkdir(parents=True)
    (folder / "main.cpp").write_bytes(b"int x;\n")
    values = "a = " + "x" * 65536 + "\n" + "".join(f"v{i} = " + "$a" * 16 + "\n" for i in range(3))
    (folder / "build.ninja").write_text(BUILD.format(folder=pub) + values)  # ~6.5M characters over both parses
    record = 512 * 1024 - 8  # ninja's bound on a record, less its size and id
    records = (ninjabuild.MAX_DEPS_BYTES - 16) // (record + 8)
    (folder / ".ninja_deps").write_bytes(deps(*(path_record(b"%07d" % i * (record // 7), i) for i in range(records))))
    tracemalloc.start()
    try:
        assert ninjabuild.relocate_folder(folder, folder, files_of(folder))
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert str(folder) in (folder / "build.ninja").read_text()
    assert peak < 48 * 1024 * 1024, f"relocation peaked at {peak / 2**20:.0f} MiB"
