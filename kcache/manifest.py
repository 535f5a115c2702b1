"""Manifests: the sorted list of files a bundle restores, serialized canonically.

A manifest is the bundle's whole truth: which layers it holds and, for every file, where it goes
under the restore root, its mode and size, the SHA-256 of its content and where those bytes sit
in the store (pack id, offset, compressed length). Restore needs nothing else, so a pod that can
read the bucket but not the SQL index can still restore.

    {"schema": 2, "bundle_key": ..., "toolchain_key": ..., "workload_key": ..., "facts": {...},
     "layers": ["inductor", ...],
     "layer_info": {"inductor-pch": {"user": "root"}, ...},       # what a layer's layout depends on
     "entries": [[path, mode, size, blob, pack, offset, length, mtime_ns], ...],   # sorted by path
     "chunks": {blob: [sha256 of content bytes 0..4 MiB, 4..8 MiB, ...], ...}}   # blobs >= 32 MiB

The manifest id is the SHA-256 of those canonical bytes; it is also the bundle id. Schema 2 added
mtime_ns (builders such as ninja judge "up to date" by modification time) and layer_info; schema 3
added chunks: the SHA-256 of each CHUNK_BYTES of a large blob's content, taken by the publisher from
its own file, so restore verifies each part of the blob on the thread that decompressed it instead
of one SHA-256 chain over the whole (kcache.fetch). Schema 1 and 2 manifests still parse and keep
their own bytes and id; their large blobs are verified whole.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
import re
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kcache import canonical, limits, packs
from kcache.errors import IntegrityError, ObjectMissing, UnsafePath
from kcache.store import Store, manifest_key

SCHEMA = 3
_ROW_LENGTH = {1: 7, 2: 8, 3: 8}  # the schemas this kcache reads
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
_ROWS_PER_PIECE = 2048
# Only permission bits travel: setuid/setgid/sticky from a shared store would be a gift to an attacker.
MODE_MASK = 0o777
# What a path may be: real cache paths are short and shallow (Triton's "triton/<hash>/<kernel>.cubin",
# Inductor's "inductor/<user>/fxgraph/<hh>/<hash>/<entry>", vLLM's compile cache: under 300 bytes and
# about 8 components deep). 4096 bytes is Linux's PATH_MAX, so no path past it can be restored anyway, and
# 256 components is 30 times the deepest real one. A store writer could otherwise plant one entry of a
# million components in a manifest well under its size cap, which every restore, reindex and gc parses.
MAX_PATH_BYTES = 4096
MAX_PATH_COMPONENTS = 256
MAX_NAME_BYTES = 255  # NAME_MAX: one component of a path
# Layers a manifest may list: the ~15 built-in ones and the extra directories a publisher names. Each
# becomes a Source, a prefix every path is checked against and, for an extra layer, an export in
# kcache.env: two million names in a manifest under its cap had taken restore to 1.4 GiB.
MAX_LAYERS = 256


# Memory (scripts/bench_manifest_memory.py: tracemalloc, CPython 3.11, 100k entries of ~200
# canonical bytes each): a parsed entry holds ~415 bytes (slots object, path and blob strings, five
# ints; pack ids are shared). Parsing peaks at ~950 bytes an entry including the raw bytes, about
# 4.8x the manifest's size, because json.loads holds the decoded text and every row at once; a parsed
# manifest keeps neither its bytes nor a second copy for the canonical check. Restore caps manifests
# at KCACHE_MAX_MANIFEST_BYTES (limits.py: 32 MiB, ~170k such entries), which keeps a whole restore
# from S3 at ~220 MiB (tests/test_restore_memory.py), under the 256 MiB restore bound.
@dataclass(frozen=True, slots=True)  # slots: a 20k-file bundle holds 20k of these during restore
class Entry:
    """One file of a bundle and where its bytes live."""

    path: str  # POSIX, relative to the restore root, starting with the layer's directory
    mode: int
    size: int
    blob: str  # SHA-256 of the uncompressed content
    pack: str
    offset: int
    length: int  # compressed length inside the pack
    mtime_ns: int | None = None  # published modification time; None in schema 1 manifests, 0 if unknown

    def as_row(self, schema: int = SCHEMA) -> list:
        row = [self.path, self.mode, self.size, self.blob, self.pack, self.offset, self.length]
        return row if schema == 1 else row + [self.mtime_ns]


@dataclass(frozen=True)
class Manifest:
    bundle_key: str
    toolchain_key: str
    workload_key: str
    facts: Mapping[str, str]
    layers: tuple[str, ...]
    entries: tuple[Entry, ...] = field(default=())
    layer_info: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    schema: int = SCHEMA
    chunks: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # blob -> digests of its CHUNK_BYTES pieces

    @functools.cached_property
    def _bytes(self) -> bytes:
        return b"".join(self.pieces())

    def to_bytes(self) -> bytes:
        return self._bytes

    def pieces(self, rows_per_piece: int = _ROWS_PER_PIECE) -> Iterator[bytes]:
        """The canonical bytes in order, the entries `rows_per_piece` rows at a time: joined, they are
        to_bytes(). A canonical object is its sorted keys, each with its value's canonical form,
        so no piece needs the whole document (parse compares a fetched manifest piece by piece)."""
        fields: dict[str, Any] = {
            "schema": self.schema,
            "bundle_key": self.bundle_key,
            "toolchain_key": self.toolchain_key,
            "workload_key": self.workload_key,
            "facts": dict(self.facts),
            "layers": list(self.layers),
            "entries": None,  # written below, in pieces
        }
        if self.schema >= 2:
            fields["layer_info"] = {name: dict(info) for name, info in self.layer_info.items()}
        if self.schema >= 3:
            fields["chunks"] = {blob: list(digests) for blob, digests in self.chunks.items()}
        for n, name in enumerate(sorted(fields)):
            yield (b"," if n else b"{") + canonical.dumps(name) + b":"
            if name != "entries":
                yield canonical.dumps(fields[name])
                continue
            yield b"["
            for start in range(0, len(self.entries), rows_per_piece):
                rows = [e.as_row(self.schema) for e in self.entries[start : start + rows_per_piece]]
                yield (b"," if start else b"") + canonical.dumps(rows)[1:-1]
            yield b"]"
        yield b"}"

    @functools.cached_property
    def id(self) -> str:
        return canonical.sha256(self._bytes)

    @property
    def total_size(self) -> int:
        return sum(e.size for e in self.entries)


def build(
    bundle_key: str,
    toolchain_key: str,
    workload_key: str,
    facts: Mapping[str, str],
    layers: Iterable[str],
    entries: Iterable[Entry],
    layer_info: Mapping[str, Mapping[str, str]] | None = None,
    chunks: Mapping[str, Sequence[str]] | None = None,
) -> Manifest:
    """A manifest with entries sorted by path and every path checked; `chunks` maps a blob to the
    SHA-256 of each CHUNK_BYTES of its content (see the module docstring)."""
    # 0 stands for "unknown" (restore then leaves the time of writing), so every row has a number.
    ordered = tuple(sorted((e if e.mtime_ns is not None else replace(e, mtime_ns=0) for e in entries),
                           key=lambda e: e.path))  # fmt: skip
    _check_entries(ordered)
    info = {str(k): {str(a): str(b) for a, b in v.items()} for k, v in (layer_info or {}).items() if v}
    digests = {str(blob): tuple(str(d) for d in pieces) for blob, pieces in (chunks or {}).items()}
    _check_blobs(ordered, digests)
    return Manifest(bundle_key, toolchain_key, workload_key, dict(facts), tuple(sorted(set(layers))), ordered, info,
                    chunks=digests)  # fmt: skip


def least_size(head: Manifest, paths: Sequence[str]) -> int:
    """The fewest bytes `head` (its entries aside) can take with a file at each of `paths`: every row
    also holds two ids and numbers of a digit at least. Publish knows this before hashing a byte."""
    numbers = _ROW_LENGTH[head.schema] - 3  # path, blob and pack are the strings
    row_rest = 2 + (_ROW_LENGTH[head.schema] - 1) + 2 * (64 + 2) + numbers  # brackets, commas, ids, digits
    return len(head.to_bytes()) + len(canonical.dumps(list(paths))) - 2 + row_rest * len(paths)


def parse(data: bytes, expected_id: str) -> Manifest:
    """Parse manifest bytes fetched from a store, verifying they hash to `expected_id`."""
    actual = canonical.sha256(data)
    if actual != expected_id:
        raise IntegrityError("manifest", expected_id, f"content hashes to {actual}")
    if (values := _values_in(data)) > len(data) // _BYTES_PER_VALUE + _VALUE_SLACK:
        raise IntegrityError("manifest", expected_id, f"holds more JSON values than its {len(data)} bytes can in a "
                             f"manifest ({values}; {_BYTES_PER_VALUE} bytes a value at least)")  # fmt: skip
    if (pairs := data.count(b":")) > len(data) // _BYTES_PER_PAIR + _VALUE_SLACK:
        raise IntegrityError("manifest", expected_id, f"holds more JSON values than its {len(data)} bytes can in a "
                             f"manifest ({pairs} object members; {_BYTES_PER_PAIR} bytes one at least)")  # fmt: skip
    if (weight := _text_weight(data)) > (cap := limits.max_manifest_bytes()):
        raise IntegrityError("manifest", expected_id, f"decodes to {_text_bytes(data)} bytes of text ({len(data)} "
                             f"bytes, characters of up to 4 bytes in one string): counted as {weight} bytes, over the "
                             f"{cap}-byte cap")  # fmt: skip
    try:
        doc = json.loads(data)
        if type(doc) is not dict:
            raise ValueError("the manifest is not a JSON object")
        schema = doc.get("schema")
        if isinstance(schema, bool) or schema not in _ROW_LENGTH:
            raise ValueError(f"schema {schema!r} is not one of {sorted(_ROW_LENGTH)}")
        if type(doc["layers"]) is not list:  # a string would have been a layer a character
            raise ValueError("layers is not a list")
        if len(doc["layers"]) > MAX_LAYERS:
            raise ValueError(f"lists {len(doc['layers'])} layers, over the {MAX_LAYERS} a manifest may have")
        entries = tuple(_entry_from_row(n, row, _ROW_LENGTH[schema]) for n, row in enumerate(doc["entries"]))
        manifest = Manifest(
            str(doc["bundle_key"]),
            str(doc["toolchain_key"]),
            str(doc["workload_key"]),
            {str(k): str(v) for k, v in doc["facts"].items()},
            tuple(str(layer) for layer in doc["layers"]),
            entries,
            _layer_info(doc.get("layer_info", {}) if schema >= 2 else {}),
            schema,
            _chunks(doc["chunks"]) if schema >= 3 else {},
        )
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise IntegrityError("manifest", expected_id, f"does not parse: {exc}") from None
    del doc  # its rows: every entry holds what it needs of them, and restore's memory peaks here
    # Only the canonical form is a manifest: its id is then the same whether taken from the stored
    # bytes or from the fields (and text a canonical encoder cannot write, a lone surrogate, is refused).
    # Compared piece by piece: a second copy of the whole manifest would raise the peak by its size.
    try:
        canonical_form = _same_bytes(manifest.pieces(), data)
    except (UnicodeEncodeError, ValueError) as exc:
        raise IntegrityError("manifest", expected_id, f"holds text no manifest can: {exc}") from None
    if not canonical_form:
        raise IntegrityError("manifest", expected_id, "is not in canonical form")
    _check_entries(entries)
    try:
        _check_blobs(entries, manifest.chunks)
    except ValueError as exc:
        raise IntegrityError("manifest", expected_id, f"does not parse: {exc}") from None
    # The id is known to be right, and the bytes are not kept: what restore holds is the entries.
    manifest.__dict__["id"] = expected_id  # where functools.cached_property keeps it
    return manifest


# json.loads makes up to ~64 bytes of Python of `[],` (3 bytes), ~59 of a two-character string, ~40 of
# a number `1000,` and ~150 of a fact `"f00000001":"",` before a row is checked: 8-26 times the bytes,
# where real rows take ~4.8 (720 MiB from 32 MiB of empty lists or layer_info, 410 MiB of facts). So
# the values the bytes can make are counted first (strings by their quotes, the rest by the commas
# and brackets around them; escaped quotes, commas in text count too: only more). A real row is 13
# bytes a value at its smallest (a six-character path, one-digit sizes and times), ~17 typically.
_BYTES_PER_VALUE = 10
# A member of an object (a fact, a layer's info, a blob's chunk digests) costs more: a dict slot, and a
# dict for each layer's info, then a copy for the canonical check (1 GB-ish per 32 MiB of them at 32
# bytes each, ~150 MiB at this bound). Real ones are a few hundred, and a chunks member holds at
# least two digests (~200 bytes); a colon inside text counts too (a path with one is still ~150).
_BYTES_PER_PAIR = 128
_VALUE_SLACK = 4096  # facts, layers and their info: a few hundred values, some of them short


# json.loads decodes the bytes into one string before it parses: CPython keeps a string at 1, 2 or 4 bytes a
# character, whichever its widest character needs, so one emoji in a path made the 32 MiB of an ASCII manifest
# at the cap 128 MiB of text (a restore at ~316 MiB, past its 256 MiB bound). What the text takes beyond a byte
# a byte counts against the cap at a quarter (parsing peaks near 5x the bytes, of which the text is one):
# a manifest may hold ~25 MiB of rows with a character of up to U+FFFF in it, ~18 MiB with one beyond it,
# and either peaks below an ASCII manifest at the cap.
_NOT_CONTINUATION = bytes(b for b in range(256) if not 0x80 <= b < 0xC0)
_FOUR_BYTES = re.compile(rb"[\xf0-\xff]")  # the lead of a character past U+FFFF (or no UTF-8 at all)
_TWO_BYTES = re.compile(rb"[\xc4-\xef]")  # the lead of a character past U+00FF


def _text_bytes(data: bytes) -> int:
    """The bytes of the string json.loads decodes `data` into."""
    if data.isascii():
        return len(data)
    characters = len(data) - len(data.translate(None, _NOT_CONTINUATION))  # each but a lead byte's
    width = 4 if _FOUR_BYTES.search(data) else 2 if _TWO_BYTES.search(data) else 1
    return characters * width


def _text_weight(data: bytes) -> int:
    return len(data) + max(0, _text_bytes(data) - len(data)) // 4


def _values_in(data: bytes) -> int:
    return data.count(b",") + data.count(b"[") + data.count(b"{") + data.count(b'"') // 2


def _same_bytes(pieces: Iterable[bytes], data: bytes) -> bool:
    view, at = memoryview(data), 0
    for piece in pieces:
        if view[at : at + len(piece)] != piece:
            return False
        at += len(piece)
    return at == len(data)


# A manifest is canonical JSON, keys sorted: its first member is its bundle key.
_HEAD = re.compile(rb'\{"bundle_key":"([0-9a-f]{16,64})"')
_HEAD_BYTES = 96


def bundle_key_hint(store: Store, manifest_id: str) -> str | None:
    """The bundle key a stored manifest names in its first bytes, without reading the rest of it.

    Only a hint, from the store: the bundle restore takes for that key passes the signature check
    (which names the key) before its manifest is read, and the manifest must then name the key
    itself; a hint that differs from ours can only make a miss. Raises ObjectMissing."""
    with store.open_range(manifest_key(manifest_id), 0, _HEAD_BYTES) as stream:
        head = b""
        while len(head) < _HEAD_BYTES and (piece := stream.read(_HEAD_BYTES - len(head))):
            head += piece
    found = _HEAD.match(head)
    return found.group(1).decode() if found else None


def fetch(store: Store, manifest_id: str) -> Manifest:
    """Read and verify the manifest `manifest_id`; one over KCACHE_MAX_MANIFEST_BYTES is refused unread."""
    key = manifest_key(manifest_id)
    data = limits.read_manifest(store, key)
    if data is None:
        raise ObjectMissing(store.url, key)
    return parse(data, manifest_id)


def _layer_info(doc: Any) -> dict[str, dict[str, str]]:
    """{layer: {key: value}} with string keys and values only: the layout reads it, so it is hostile."""
    if not isinstance(doc, dict):
        raise ValueError("layer_info is not an object")
    for layer, info in doc.items():
        if not isinstance(info, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in info.items()):
            raise ValueError(f"layer_info of {layer!r} is not an object of strings")
    return doc


def _chunks(doc: Any) -> dict[str, tuple[str, ...]]:
    """{blob: (digest, ...)} of hex SHA-256 strings only: restore trusts a part of a blob by them."""
    if type(doc) is not dict:
        raise ValueError("chunks is not an object")
    found: dict[str, tuple[str, ...]] = {}
    for blob, digests in doc.items():
        if not _HEX64.match(blob) or type(digests) is not list:
            raise ValueError(f"chunks of {str(blob)[:80]!r} is not a list under a blob id")
        if not all(type(d) is str and _HEX64.match(d) for d in digests):
            raise ValueError(f"chunks of blob {blob[:12]} are not all SHA-256 hex digests")
        found[blob] = tuple(digests)
    return found


def _check_blobs(entries: tuple[Entry, ...], chunks: Mapping[str, tuple[str, ...]]) -> None:
    """Every blob has one size, whichever paths name it (restore checks the first path's and copies
    the blob to the others); every blob with chunk digests is a blob of the manifest, with one
    digest per CHUNK_BYTES of its size."""
    sizes: dict[str, int] = {}
    for entry in entries:
        if sizes.setdefault(entry.blob, entry.size) != entry.size:
            raise ValueError(f"blob {entry.blob[:12]} is listed with {sizes[entry.blob]} and {entry.size} bytes")
    for blob, digests in chunks.items():
        if blob not in sizes:
            raise ValueError(f"chunks name blob {blob[:12]}, which no entry holds")
        if len(digests) != packs.chunk_count(sizes[blob]) or len(digests) < 2:
            raise ValueError(f"blob {blob[:12]} of {sizes[blob]} bytes has {len(digests)} chunk digests, not "
                             f"{packs.chunk_count(sizes[blob])} (at least 2)")  # fmt: skip


def _entry_from_row(n: int, row: Any, length_of_row: int) -> Entry:
    if type(row) is not list or len(row) != length_of_row:
        raise ValueError(f"entry {str(row)[:80]!r} does not have {length_of_row} columns")
    path, mode, size, blob, pack, offset, length = row[:7]
    mtime_ns = row[7] if length_of_row > 7 else None
    # First, before any other check or the canonical comparison touches the path more than once.
    if type(path) is str and (too_big := over_caps(path)):
        raise ValueError(f"entry {n} ({_shown(path)}) {too_big}")
    # type() is int: JSON numbers parse to exact ints, and a bool (an int subclass) is no number here.
    if not (type(mode) is int and type(size) is int and type(offset) is int and type(length) is int
            and (mtime_ns is None or type(mtime_ns) is int)
            and 0 <= mode < 2**63 and 0 <= size < 2**63 and 0 <= offset < 2**63 and 0 <= length < 2**63
            and (mtime_ns is None or 0 <= mtime_ns < 2**63)):  # fmt: skip
        numbers = [("mode", mode), ("size", size), ("offset", offset), ("length", length), ("mtime_ns", mtime_ns)]
        name = next(n for n, v in numbers if (v is not None or n != "mtime_ns") and not _u63(v))
        raise ValueError(f"{name} of {path!r} is not a non-negative 64-bit integer")
    if type(path) is not str:
        raise ValueError("path is not a string")
    for name, value in (("blob", blob), ("pack", pack)):
        if type(value) is not str or not _HEX64.match(value):
            raise ValueError(f"{name} of {path!r} is not a SHA-256 hex digest")
    if mode & ~MODE_MASK:
        raise ValueError(f"mode {mode:o} of {path!r} has bits beyond permissions")
    return Entry(path, mode, size, blob, sys.intern(pack), offset, length, mtime_ns)  # many entries share a pack


def _u63(value: Any) -> bool:
    return type(value) is int and 0 <= value < 2**63


def _check_entries(entries: tuple[Entry, ...]) -> None:
    """Every path safe, none twice, none a file and a directory at once. Linear in the bytes of the
    paths (a sort aside): a hostile manifest must not make a parser spend its time here."""
    for entry in entries:
        check_path(entry.path)
    paths = sorted(entry.path for entry in entries)  # the entries' own strings; built manifests come sorted
    for before, path in itertools.pairwise(paths):
        if before == path:
            raise UnsafePath(path, "appears twice in the manifest")
    # A file may not also be used as a directory ("a" and "a/b"): restore could not lay out both.
    # The paths under a file's name (those starting "a/") sit together in sorted order, at the
    # place "a/" would be: one binary search a file, each comparison no longer than the file's path.
    for path in paths:
        under = path + "/"
        at = bisect.bisect_left(paths, under)
        if at < len(paths) and paths[at].startswith(under):
            raise UnsafePath(paths[at], "a parent of this path is itself a file in the manifest")


def is_sha256(value: object) -> bool:
    """Whether `value` is a SHA-256 in lowercase hex: a blob, pack or manifest (bundle) id."""
    return isinstance(value, str) and _HEX64.match(value) is not None


def check_path(path: str) -> str:
    """Return `path` if it is a safe relative POSIX path, else raise UnsafePath."""
    if too_big := over_caps(path):
        raise UnsafePath(_shown(path, quoted=False), too_big)
    if not path:
        raise UnsafePath(path, "empty path")
    if "\x00" in path or "\\" in path:
        raise UnsafePath(path, "contains a NUL byte or backslash")
    if path.startswith("/"):
        raise UnsafePath(path, "absolute paths are not allowed")
    for part in path.split("/"):
        if part in ("", ".", ".."):
            raise UnsafePath(path, "empty, '.' or '..' components are not allowed")
        # No file system takes a longer name: restore's ENAMETOOLONG had blamed ROOT for the bundle.
        if len(part) > MAX_NAME_BYTES // 4 and (size := len(part.encode("utf-8", "surrogatepass"))) > MAX_NAME_BYTES:
            raise UnsafePath(_shown(path, quoted=False), f"has a name of {size} bytes, over the {MAX_NAME_BYTES} "
                                                         "a file system takes")  # fmt: skip
    return path


def over_caps(path: str) -> str | None:
    """Why `path` is over MAX_PATH_BYTES or MAX_PATH_COMPONENTS, or None. One pass over it at most."""
    if len(path) > MAX_PATH_BYTES:  # a character is at least one UTF-8 byte: over the cap unencoded
        return f"is a path of {len(path)} characters, over the {MAX_PATH_BYTES} bytes a path may have"
    size = len(path.encode("utf-8", "surrogatepass"))
    if size > MAX_PATH_BYTES:
        return f"is a path of {size} bytes, over the {MAX_PATH_BYTES} a path may have"
    components = path.count("/") + 1
    if components > MAX_PATH_COMPONENTS:
        return f"has {components} components, over the {MAX_PATH_COMPONENTS} a path may have"
    return None


def _shown(path: str, *, quoted: bool = True) -> str:
    """The start of a path for a message: a hostile one may be megabytes."""
    head = path if len(path) <= 80 else f"{path[:80]}..."
    return repr(head) if quoted else head
