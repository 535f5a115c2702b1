"""Relocation of a ninja build folder: what `cpp_extension.load_inline()` leaves, moved to another ROOT.

load_inline writes its sources into the build folder, so three files name the folder by the absolute
path it had on the publishing machine:

    <folder>/build.ninja   `build main.o: compile /pub/.../<name>/main.cpp` (text)
    <folder>/.ninja_log    `# ninja log v<N>` then start, end, mtime, output, hash of the command (hex)
                           ninja rebuilds an output whose command hashes otherwise (v5, v6: MurmurHash64A,
                           seed 0xDECAFBADDECAFBAD; v7, ninja 1.13: rapidhash, its default seed)
    <folder>/.ninja_deps   `# ninjadeps\\n`, int32 version 4, then records, each a uint32 size (top bit:
                           a deps record) and its bytes, all little-endian:
                             path: the path, NUL-padded to 4 bytes, then uint32 ~id (ids count up from 0)
                             deps: int32 output id, uint64 mtime as two uint32 (low first), int32 input ids

Restore rewrites all three as ninja would have written them had the build run under ROOT: the old
folder's path, found from the manifest's inputs that name a file of this folder, becomes the new one
in build.ninja and in path records (ids and checksums unchanged), and each log entry whose hash is
the hash of its edge's old command gets the hash of the new command. Mtimes are kept: ninja compares
them with the files restore lays down at their published times. The files are bytes from the store:
each is bounded before it is read, variable expansion is bounded, nothing is run (ninja is not
called), and a folder with anything not understood (a log version, a statement, a record, a path
that needs escaping) is left as it was: the pod rebuilds it, slowly and never wrongly.
"""

from __future__ import annotations

import bisect
import errno
import logging
import os
import posixpath
import re
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path

from kcache import atomic
from kcache.ninjahash import LOG_HASHES
from kcache.untrusted import one_line

log = logging.getLogger(__name__)

MAX_MANIFEST_BYTES = 1024 * 1024  # torch's build.ninja: ~1 KiB
MAX_LOG_BYTES = 4 * 1024 * 1024  # ~80 bytes an output
MAX_DEPS_BYTES = 16 * 1024 * 1024  # a path record a header: thousands of headers fit
MAX_VALUE_CHARS = 1024 * 1024  # one evaluated variable, path or command
# All a folder's evaluation together (paths, variables, commands; nested ones count again): a token
# of `$big` repeated would otherwise hold a MiB for every 5 bytes of manifest. Hashing takes ~50 ms/MiB.
# Held at once (both parses live until the folder is written) and up to 4 bytes a character in memory
# (one emoji makes a str 4 bytes wide): 8 Mi characters is at most 32 MiB of restore's 256 MiB.
MAX_EVALUATED_CHARS = 8 * 1024 * 1024
_MAX_DEPTH = 64  # nested variable lookups
# Variable look-ups a folder's evaluation may make: a rule's variables are evaluated at each use, and
# an empty one costs no characters, so fan-out alone (128 `$v` in each of a few levels) ran for hours.
# torch's manifest makes a few for each source file; a million take ~2 s.
MAX_LOOKUPS = 1024 * 1024
_MAX_RECORD = (1 << 19) - 1  # ninja's own bound on a deps record
_MAX_TRIES = 4  # `/<folder name>/` looked for in a path, from its end

_LOGGED_CHARS = 300


class Unrelocatable(ValueError):
    """A build folder this relocation does not understand; it is left as it was (ninja rebuilds)."""


# --- build.ninja -----------------------------------------------------------------------------------

_NAME = re.compile(r"[A-Za-z0-9_-]+")
_BRACED = re.compile(r"[A-Za-z0-9_.-]+")
_SHELL_SAFE = re.compile(r"[A-Za-z0-9_+\-./]+")  # ninja quotes any other path in $in and $out


@dataclass
class Edge:
    rule: str
    outs: list[str]  # explicit outputs first
    explicit_outs: int
    ins: list[str]
    explicit_ins: int
    scope: dict[str, str] = field(default_factory=dict)  # the edge's own variables, evaluated


@dataclass
class Manifest:
    scope: dict[str, str]
    rules: dict[str, dict[str, str]]  # raw (unevaluated) rule variables
    edges: list[Edge]


class _Budget:
    """Characters a folder's evaluation may still produce, and variable look-ups it may still make."""

    def __init__(self, chars: int = MAX_EVALUATED_CHARS, lookups: int = MAX_LOOKUPS):
        self.left = chars
        self.lookups = lookups

    def look_up(self) -> None:
        self.lookups -= 1
        if self.lookups < 0:
            raise Unrelocatable(f"evaluates past {MAX_LOOKUPS} variable look-ups")

    def take(self, chars: int) -> None:
        self.left -= chars
        if self.left < 0:
            raise Unrelocatable(f"evaluates past {MAX_EVALUATED_CHARS} characters")


def _expand(raw: str, lookup, budget: _Budget, depth: int = 0) -> str:
    """`raw` with ninja's escapes and variables evaluated; `lookup(name, depth)` gives a variable."""
    if depth > _MAX_DEPTH:
        raise Unrelocatable("variables nest too deeply")
    out: list[str] = []
    size, i = 0, 0
    while i < len(raw):
        j = raw.find("$", i)
        if j < 0:
            piece, i = raw[i:], len(raw)
        elif j + 1 < len(raw) and raw[j + 1] in "$ :":
            piece, i = raw[i:j] + raw[j + 1], j + 2
        elif j + 1 < len(raw) and raw[j + 1] == "{":
            m = _BRACED.match(raw, j + 2)
            if not m or raw[m.end() : m.end() + 1] != "}":
                raise Unrelocatable("a bad ${...} reference")
            budget.look_up()
            piece, i = raw[i:j] + lookup(m.group(), depth + 1), m.end() + 1
        else:
            m = _NAME.match(raw, j + 1)
            if not m:
                raise Unrelocatable("a bad $ escape")
            budget.look_up()
            piece, i = raw[i:j] + lookup(m.group(), depth + 1), m.end()
        size += len(piece)
        budget.take(len(piece))
        if size > MAX_VALUE_CHARS:
            raise Unrelocatable(f"a value evaluates past {MAX_VALUE_CHARS} characters")
        out.append(piece)
    return "".join(out)


def _logical_lines(text: str) -> list[str]:
    """Lines with `$` + newline continuations joined and comments dropped."""
    lines: list[str] = []
    pending = ""
    for line in text.split("\n"):
        if pending:
            line = pending + line.lstrip(" ")
            pending = ""
        if re.search(r"(?<!\$)(\$\$)*\$$", line):
            pending = line[:-1]
            continue
        if line.lstrip(" ").startswith("#"):
            continue
        lines.append(line)
    if pending:
        raise Unrelocatable("build.ninja ends inside a continued line")
    return lines


def _split_paths(raw: str) -> list[str]:
    """Raw path tokens split at unescaped spaces."""
    tokens, current, i = [], [], 0
    while i < len(raw):
        c = raw[i]
        if c == "$" and i + 1 < len(raw):
            current.append(raw[i : i + 2])
            i += 2
            continue
        if c == " ":
            if current:
                tokens.append("".join(current))
                current = []
        else:
            current.append(c)
        i += 1
    if current:
        tokens.append("".join(current))
    return tokens


def _binding(line: str) -> tuple[str, str]:
    name, eq, value = line.partition("=")
    name = name.strip()
    if not eq or not _NAME.fullmatch(name):
        raise Unrelocatable("a statement this relocation does not know")
    return name, value.lstrip(" ")


def _edge(decl: str, body: list[str], scope: dict[str, str], budget: _Budget) -> Edge:
    m = re.search(r"(?<!\$)(\$\$)*:", decl)
    if not m:
        raise Unrelocatable("a build statement with no ':'")
    outs_raw, rest = decl[: m.end() - 1], decl[m.end() :].split()
    if not rest:
        raise Unrelocatable("a build statement with no rule")
    rule, ins_raw = rest[0], decl[m.end() :].split(None, 1)[1] if len(rest) > 1 else ""
    edge_scope: dict[str, str] = {}
    for line in body:  # an edge's variables are evaluated in the file's scope
        name, value = _binding(line)
        edge_scope[name] = _expand(value, _file_lookup(scope), budget)

    def lookup(name, depth):
        return edge_scope[name] if name in edge_scope else _file_lookup(scope)(name, depth)

    def paths(raw: str) -> tuple[list[str], int]:
        tokens = _split_paths(raw)
        explicit = next((k for k, t in enumerate(tokens) if t in ("|", "||", "|@")), len(tokens))
        return [_expand(t, lookup, budget) for t in tokens if t not in ("|", "||", "|@")], explicit

    outs, explicit_outs = paths(outs_raw)
    ins, explicit_ins = paths(ins_raw)
    for path in outs + ins:
        if posixpath.normpath(path) != path:
            raise Unrelocatable(f"a path ninja would canonicalize: {path!r}")
    return Edge(rule, outs, explicit_outs, ins, explicit_ins, edge_scope)


def _file_lookup(scope: dict[str, str]):
    return lambda name, depth: scope.get(name, "")


def parse(text: str, budget: _Budget) -> Manifest:
    """The subset of ninja's manifest syntax torch writes: variables, rules, builds, defaults."""
    scope: dict[str, str] = {}
    rules: dict[str, dict[str, str]] = {}
    edges: list[Edge] = []
    lines = _logical_lines(text)
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        body: list[str] = []
        while i < len(lines) and (lines[i].startswith(" ") or not lines[i].strip()):
            if lines[i].strip():
                body.append(lines[i].strip(" "))
            i += 1
        if not line.strip():
            continue
        if line.startswith(" "):
            raise Unrelocatable("an indented line outside a rule or build")
        keyword = line.split(" ", 1)[0]
        if keyword == "rule":
            name = line.partition(" ")[2].strip()
            if not _NAME.fullmatch(name):
                raise Unrelocatable("a rule with a bad name")
            rules[name] = dict(_binding(b) for b in body)
        elif keyword == "build":
            edges.append(_edge(line[len("build ") :], body, scope, budget))
        elif keyword == "default" and not body:
            continue
        elif keyword in ("pool", "include", "subninja"):
            raise Unrelocatable(f"a {keyword} statement")
        elif not body:
            name, value = _binding(line)
            scope[name] = _expand(value, _file_lookup(scope), budget)  # top-level values are evaluated at once
        else:
            raise Unrelocatable("a statement this relocation does not know")
    return Manifest(scope, rules, edges)


def command(manifest: Manifest, edge: Edge, budget: _Budget) -> str:
    """The command ninja hashes for `edge` (EvaluateCommand with the rsp file, which torch never uses)."""
    rule = manifest.rules.get(edge.rule)
    if rule is None:
        raise Unrelocatable(f"an edge of unknown rule {edge.rule!r}")
    if rule.get("rspfile") or rule.get("rspfile_content"):
        raise Unrelocatable("a rule with a response file")
    for path in edge.ins[: edge.explicit_ins] + edge.outs[: edge.explicit_outs]:
        if not _SHELL_SAFE.fullmatch(path):
            raise Unrelocatable(f"a path ninja would quote: {path!r}")

    return _CommandScope(manifest, edge, rule, budget)("command", 0)


class _CommandScope:
    """ninja's variable lookup for one edge's command. An object, not a closure that hands itself to
    `_expand`: that closure's reference to itself was a cycle holding both manifests, every value they
    evaluated (up to the folder's budget), until a garbage collection ran, so through the logs' rewrite."""

    def __init__(self, manifest: Manifest, edge: Edge, rule: dict[str, str], budget: _Budget):
        self.manifest, self.edge, self.rule, self.budget = manifest, edge, rule, budget

    def __call__(self, name: str, depth: int) -> str:
        edge = self.edge
        if name in ("in", "in_newline"):
            return (" " if name == "in" else "\n").join(edge.ins[: edge.explicit_ins])
        if name == "out":
            return " ".join(edge.outs[: edge.explicit_outs])
        if name in edge.scope:
            return edge.scope[name]
        if name in self.rule:
            return _expand(self.rule[name], self, self.budget, depth)
        return self.manifest.scope.get(name, "")


# --- .ninja_log and .ninja_deps ---------------------------------------------------------------------

_LOG_HEADER = re.compile(rb"# ninja log v([0-9]{1,3})\n")
_DEPS_HEADER = b"# ninjadeps\n" + struct.pack("<i", 4)


def rehash_log(data: bytes, moved: dict[str, tuple[str, str]]) -> bytearray:
    """The log with each entry of an output in `moved` (output -> (old command, new command)) whose
    hash is the old command's given the new command's hash; other entries are kept as they are."""
    m = _LOG_HEADER.match(data)
    if not m:
        raise Unrelocatable("the build log has no `# ninja log v<N>` line")
    hasher = LOG_HASHES.get(int(m.group(1)))
    if hasher is None:
        raise Unrelocatable(f"build log version {int(m.group(1))} is not one this relocation knows")
    hashes: dict[tuple[str, str], tuple[int, int]] = {}  # by command pair: an edge's outputs share one
    if not data.endswith(b"\n"):
        raise Unrelocatable("the build log ends inside an entry")
    # One buffer, entry by entry: a list of the log's lines (and one of the entries written) held an
    # object of ~40 bytes for each entry of ~10, 80 MiB for a log at its cap.
    out, at = bytearray(data[: m.end()]), m.end()
    while at < len(data):
        end = data.index(b"\n", at)
        line, at = data[at:end], end + 1
        fields = line.split(b"\t")
        if len(fields) != 5 or not re.fullmatch(rb"[0-9a-f]{1,16}", fields[4]):
            raise Unrelocatable("a build log entry that does not parse")
        output = fields[3].decode("utf-8", "surrogateescape")
        if output in moved:
            pair = moved[output]
            if pair not in hashes:
                hashes[pair] = tuple(hasher(c.encode("utf-8", "surrogateescape")) for c in pair)
            old_hash, new_hash = hashes[pair]
            if int(fields[4], 16) == old_hash:  # else the entry is stale here as it was there
                fields[4] = b"%x" % new_hash
        out += b"\t".join(fields) + b"\n"
        if len(out) > MAX_LOG_BYTES:  # new hashes may be longer: no more than a log restore would read
            raise Unrelocatable(f"the rewritten build log is over {MAX_LOG_BYTES} bytes")
    return out  # not copied into bytes: written as it is


def move_deps(data: bytes, old: bytes, new: bytes) -> bytearray:
    """The deps log with path records under `old` moved under `new`; refuses what ninja would not load."""
    if not data.startswith(_DEPS_HEADER):
        raise Unrelocatable("the deps log has no `# ninjadeps` v4 header")
    # One buffer, record by record: a list of records held an object of ~45 bytes for each of 12, and
    # a deps log at its cap took ~200 MiB.
    out, at, paths = bytearray(_DEPS_HEADER), len(_DEPS_HEADER), 0
    view = memoryview(data)
    while at < len(data):
        if at + 4 > len(data):
            raise Unrelocatable("the deps log ends inside a record size")
        (head,) = struct.unpack_from("<I", data, at)
        size = head & 0x7FFFFFFF
        body = data[at + 4 : at + 4 + size]
        if size > _MAX_RECORD or len(body) != size:
            raise Unrelocatable("a deps log record past its bound or the file's end")
        at += 4 + size
        if head >> 31:
            ids = struct.unpack(f"<{size // 4}i", body) if size % 4 == 0 and size >= 12 else None
            if ids is None or not all(0 <= i < paths for i in (ids[0], *ids[3:])):
                raise Unrelocatable("a deps record that does not parse")
            out += view[at - 4 - size : at]
            continue
        if size < 8 or size % 4 or struct.unpack_from("<I", body, size - 4)[0] != ~paths & 0xFFFFFFFF:
            raise Unrelocatable("a path record that does not parse")
        path = body[: size - 4]
        for _ in range(3):  # ninja strips at most the 3 bytes of padding
            path = path[:-1] if path.endswith(b"\0") else path
        if path.startswith(old + b"/"):
            path = new + path[len(old) :]
        padded = path + b"\0" * (-len(path) % 4)
        if len(padded) + 4 > _MAX_RECORD:
            raise Unrelocatable("a moved path is too long for a deps record")
        out += struct.pack("<I", len(padded) + 4)
        out += padded
        out += body[size - 4 :]
        paths += 1
        if len(out) > MAX_DEPS_BYTES:  # a longer folder path: no more than a deps log restore would read
            raise Unrelocatable(f"the moved deps log is over {MAX_DEPS_BYTES} bytes")
    return out  # not copied into bytes: written as it is


# --- a folder --------------------------------------------------------------------------------------

_PATH_CHAR = r"[A-Za-z0-9_+,@=.-]"
# Where a path starts in a manifest: a line's or a word's start, after `=`, `:`, a quote or a flag
# that takes a directory. Not inside another path: /x/pub/ext names something else than /pub/ext.
_AFTER = r"(^|[\s=:'\",]|-I|-L)"
FILES = ("build.ninja", ".ninja_log", ".ninja_deps")


def _read(path: Path, bound: int) -> bytes | None:
    """The staged file, None when there is none; refused past `bound` bytes, before or while reading."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)  # staging holds plain files; nothing else is read
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise  # the disk's: the restore reports it
        raise Unrelocatable(f"{path.name} is a symbolic link") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # a directory the bundle made of the name (a file under it)
        os.close(fd)
        raise Unrelocatable(f"{path.name} is not a file")
    with os.fdopen(fd, "rb") as f:
        size = st.st_size
        data = f.read(bound + 1) if size <= bound else b""
    if size > bound or len(data) > bound:
        raise Unrelocatable(f"{path.name} is over {bound} bytes")
    return data


def _old_folder(manifest: Manifest, files: frozenset[str], new: str) -> str | None:
    """Where the folder was built: the one place `/.../<name>` that the manifest's absolute paths name
    a file of this folder (`files`, relative to it) under. Only the last few `/<name>/` of a path are
    tried: a path is one of torch's, `<folder>/main.cpp`, or names nothing of the folder."""
    name = "/" + posixpath.basename(new) + "/"
    found = set()
    for edge in manifest.edges:
        for path in edge.ins + edge.outs:
            end = len(path)
            for _ in range(_MAX_TRIES):
                at = path.rfind(name, 0, end) if path.startswith("/") else -1
                if at < 0:
                    break
                if path[at + len(name) :] in files:
                    found.add(path[: at + len(name) - 1])
                    break
                end = at + len(name) - 1
    if len(found) > 1:
        raise Unrelocatable(f"the manifest names {len(found)} places of this folder")
    return found.pop() if found else None


def relocate_folder(staged: Path, target: Path, files: frozenset[str]) -> bool:
    """Rewrite the ninja files staged in `staged` for their final place `target`; `files` are the
    paths the bundle restores in the folder, relative to it. True when something was rewritten;
    Unrelocatable (nothing written) when the folder is not understood."""
    manifest_bytes = _read(staged / "build.ninja", MAX_MANIFEST_BYTES)
    if manifest_bytes is None:
        return False
    try:
        text = manifest_bytes.decode("utf-8")
    except UnicodeDecodeError:
        raise Unrelocatable("build.ninja is not UTF-8") from None
    budget = _Budget()
    manifest = parse(text, budget)
    new = str(target)
    old = _old_folder(manifest, files, new)
    if old is None or old == new:
        return False
    for place in (old, new):
        if not re.fullmatch(rf"(/{_PATH_CHAR}+)+", place):
            raise Unrelocatable(f"a folder path this relocation does not rewrite: {place!r}")
    moved_text = re.sub(_AFTER + re.escape(old) + rf"(?!{_PATH_CHAR})", lambda m: m.group(1) + new, text,
                        flags=re.MULTILINE)
    if len(moved_text) > MAX_MANIFEST_BYTES:  # a short folder path named often, moved under a long one
        raise Unrelocatable(f"the moved build.ninja is over {MAX_MANIFEST_BYTES} characters")
    moved = parse(moved_text, budget)
    if [e.outs for e in moved.edges] != [e.outs for e in manifest.edges]:
        raise Unrelocatable("the rewrite changed an output's name")
    commands = {}
    for before, after in zip(manifest.edges, moved.edges):
        if before.rule == "phony":  # ninja's own: no command, never logged
            continue
        pair = (command(manifest, before, budget), command(moved, after, budget))
        commands.update((out, pair) for out in before.outs)  # one pair an edge: hashed once
    rewritten = {"build.ninja": moved_text.encode("utf-8")}
    log_bytes = _read(staged / ".ninja_log", MAX_LOG_BYTES)
    if log_bytes is not None:
        rewritten[".ninja_log"] = rehash_log(log_bytes, commands)
    deps_bytes = _read(staged / ".ninja_deps", MAX_DEPS_BYTES)
    if deps_bytes is not None:
        rewritten[".ninja_deps"] = move_deps(deps_bytes, old.encode(), new.encode())
    for name, data in rewritten.items():  # everything understood: now write
        _write_back(staged / name, data)
    return True


def _write_back(path: Path, data: bytes | bytearray) -> None:
    st = path.stat()
    atomic.write_bytes(path, data, mode=st.st_mode & 0o777)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # ninja compares the log's mtimes with the files'


def relocate_folders(staged_layer: Path, target_layer: Path, rels) -> None:
    """Every build folder (a directory holding build.ninja) among `rels`, the layer's paths."""
    rels = sorted(rels)
    for rel in rels:
        if rel != "build.ninja" and not rel.endswith("/build.ninja"):
            continue
        folder = posixpath.dirname(rel)
        prefix = folder + "/" if folder else ""
        first = bisect.bisect_left(rels, prefix)
        last = bisect.bisect_left(rels, prefix + "\U0010ffff")  # the folder's paths sort together
        files = frozenset(r[len(prefix) :] for r in rels[first:last])
        try:
            relocate_folder(staged_layer / folder, target_layer / folder if folder else target_layer, files)
        except (Unrelocatable, ValueError, LookupError, struct.error, RecursionError, MemoryError) as exc:
            log.warning("leaving ninja build %s as published (%s): ninja will rebuild it under this ROOT",
                        one_line(folder or ".", _LOGGED_CHARS), one_line(str(exc), _LOGGED_CHARS))
