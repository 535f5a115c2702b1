"""Warmup profiles: which request shapes `kcache warmup` sends, read from YAML or TOML.

    # profiles.yaml                          # profiles.toml
    profiles:                                [[profiles]]
      - name: chat                           name = "chat"
        batch_size: 1                        batch_size = 1
        input_tokens: 512                    input_tokens = 512
        output_tokens: 64                    output_tokens = 64
        repeats: 3          # optional, 1    repeats = 3

Every shape a service compiles for is worth one profile: torch.compile (and vLLM's CUDA graphs)
specialise on batch size and sequence length, so a shape nobody sent during warmup is compiled by
the first user who does. Errors name the file, the line where the parser knows it, the profile
and the field.

A profiles file is input from whoever wrote the ConfigMap: only a regular file of at most
MAX_FILE_BYTES is read (no FIFO to hang on, no /dev/zero), YAML aliases may expand to at most
MAX_YAML_NODES nodes (no billion laughs), nesting is capped, every value has an upper bound
(LIMITS), and an error shows a value only as a short scalar, never its repr.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kcache import boundedread
from kcache.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


@dataclass(frozen=True)
class Profile:
    name: str
    batch_size: int  # concurrent requests (sequences) per step
    input_tokens: int  # prompt length per request, in tokens (approximate over HTTP)
    output_tokens: int  # tokens generated per request
    repeats: int = 1  # the first run compiles; later runs measure the steady state


DEFAULTS: tuple[Profile, ...] = (
    Profile("single-short", 1, 128, 50, 3),
    Profile("single-long", 1, 4096, 100, 2),
    Profile("batch-mid", 4, 512, 100, 5),
    Profile("batch-large", 8, 256, 50, 3),
    Profile("batch-max", 16, 128, 30, 2),
)

FIELDS = ("name", "batch_size", "input_tokens", "output_tokens", "repeats")
_REQUIRED = ("name", "batch_size", "input_tokens", "output_tokens")
# Upper bounds: far above any real service (vLLM's default max_num_seqs is 256; the longest contexts
# are about 1M tokens), low enough that a typo cannot build an endless prompt or request queue.
LIMITS = {"batch_size": 1024, "input_tokens": 1 << 20, "output_tokens": 1 << 17, "repeats": 100}
MAX_NAME = 200
MAX_PROFILES = 256
MAX_FILE_BYTES = 1 << 20
MAX_YAML_NODES = 100_000  # after alias expansion
MAX_DEPTH = 32


class ProfileError(ConfigError):
    """A profiles file that cannot be used; says where (file, line, profile, field) and why."""

    def __init__(self, path: str, why: str, *, line: int | None = None, profile: str | None = None,
                 field: str | None = None):  # fmt: skip
        super().__init__("profiles file", path, why)
        self.path, self.line, self.profile, self.field = path, line, profile, field
        where = f"{path}:{line}" if line else path
        self.args = (f"{where}: {profile + ': ' if profile else ''}{why}",)


def load(path: Path) -> tuple[Profile, ...]:
    """The profiles of a .yaml/.yml or .toml file, validated."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".yaml", ".yml", ".toml"):
        raise ProfileError(str(path), "unknown format; name the file *.yaml, *.yml or *.toml")
    text = _read(path)
    return parse_toml(text, str(path)) if suffix == ".toml" else parse_yaml(text, str(path))


def _read(path: Path) -> str:
    """The file's text: only a regular file of at most MAX_FILE_BYTES (kcache.boundedread)."""
    try:
        data = boundedread.read_bytes(path, MAX_FILE_BYTES)
    except boundedread.NotRegularFile:
        raise ProfileError(
            str(path), "not a regular file (a FIFO, device or directory cannot be read as profiles)"
        ) from None
    except boundedread.FileTooLarge:
        raise ProfileError(str(path), f"file is over the {MAX_FILE_BYTES}-byte limit") from None
    except OSError as exc:
        raise ProfileError(str(path), f"cannot read: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProfileError(str(path), f"not UTF-8 text (byte {exc.start})") from None


def parse_yaml(text: str, name: str = "profiles.yaml") -> tuple[Profile, ...]:
    import yaml

    loader = _limited_loader(yaml)(text)
    try:
        node = loader.get_single_node()
        _count_nodes(node, name)
        doc = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc)
        raise ProfileError(name, f"not valid YAML: {_short(problem)}", line=mark.line + 1 if mark else None) from None
    except ValueError:  # int() of a literal past Python's 4300-digit limit
        raise ProfileError(name, "a number is too long to read (more than 4300 digits)") from None
    finally:
        loader.dispose()
    return _validate(doc, name, _YamlLines(node))


def _limited_loader(yaml):
    """A SafeLoader whose composer refuses nesting deeper than MAX_DEPTH (Python would hit its recursion limit)."""

    class Loader(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent, index):
            self.depth += 1
            try:
                if self.depth > MAX_DEPTH:
                    raise yaml.YAMLError(f"nested too deeply (more than {MAX_DEPTH} levels)")
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

    return Loader


def _count_nodes(node: Any, name: str) -> None:
    """Refuse a document whose aliases expand to more than MAX_YAML_NODES nodes (billion laughs),
    or without end: `&a [*a]` is a node that holds itself. Aliases share one node object, so each
    node's expanded size is computed once."""
    sizes: dict[int, int] = {}
    sizing: set[int] = set()  # the nodes whose size is being computed: meeting one again is a cycle

    def size(n: Any) -> int:
        if id(n) in sizing:
            raise ProfileError(name, "a YAML alias refers to a node that contains it (an endless document)")
        if id(n) not in sizes:
            sizing.add(id(n))
            value = n.value if isinstance(n.value, list) else ()
            children = (c for item in value for c in (item if isinstance(item, tuple) else (item,)))
            sizes[id(n)] = 1 + sum(size(c) for c in children)
            sizing.discard(id(n))
            if sizes[id(n)] > MAX_YAML_NODES:
                raise ProfileError(name, f"YAML aliases expand to more than {MAX_YAML_NODES} nodes")
        return sizes[id(n)]

    if node is not None:
        size(node)


def parse_toml(text: str, name: str = "profiles.toml") -> tuple[Profile, ...]:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        found = re.search(r"line (\d+)", str(exc))
        line = int(found.group(1)) if found else None
        raise ProfileError(name, f"not valid TOML: {_short(str(exc))}", line=line) from None
    except ValueError:  # int() of a literal past Python's 4300-digit limit
        raise ProfileError(name, "a number is too long to read (more than 4300 digits)") from None
    except RecursionError:
        raise ProfileError(name, "nested too deeply to read") from None
    return _validate(doc, name, _TomlLines(text))


def _clip(text: str, limit: int = 60) -> str:
    """Text from the file made printable and bounded (it may reach a terminal or a log)."""
    cleaned = "".join(c if c.isprintable() else "?" for c in text[: limit + 1])
    return cleaned if len(cleaned) <= limit else cleaned[:limit] + "..."


def _short(value: Any, limit: int = 60) -> str:
    """A value as an error may show it: short scalars only, never a repr that could expand."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        digits = len(str(abs(value))) if value.bit_length() < 10_000 else limit + 1
        return (
            str(value) if digits <= limit else f"a {digits}-digit number" if digits <= limit * 50 else "a huge number"
        )
    if isinstance(value, str):
        return repr(_clip(value, limit))
    if isinstance(value, float):
        return _clip(repr(value), limit)
    return {list: "a list", tuple: "a list", dict: "a mapping"}.get(type(value), f"a {type(value).__name__}")


def _validate(doc: Any, name: str, lines: _YamlLines | _TomlLines) -> tuple[Profile, ...]:
    if not isinstance(doc, Mapping) or "profiles" not in doc:
        raise ProfileError(name, "expected a top-level 'profiles' list (see `kcache warmup --help`)")
    unknown = sorted((str(k) for k in doc if k != "profiles"), key=str)
    if unknown:
        raise ProfileError(name, f"unknown top-level key {_short(unknown[0])}; only 'profiles' is read")
    items = doc["profiles"]
    if not isinstance(items, Sequence) or isinstance(items, str) or not items:
        raise ProfileError(name, "'profiles' must be a non-empty list", line=lines.top())
    if len(items) > MAX_PROFILES:
        raise ProfileError(name, f"at most {MAX_PROFILES} profiles (got {len(items)})", line=lines.top())
    profiles: list[Profile] = []
    for i, item in enumerate(items, start=1):
        profile = _one(item, i, name, lines)
        if any(p.name == profile.name for p in profiles):
            raise ProfileError(name, f"duplicate name {_short(profile.name)}", line=lines.field(i, "name"),
                               profile=f"profile {i} ({profile.name})", field="name")  # fmt: skip
        profiles.append(profile)
    return tuple(profiles)


def _one(item: Any, i: int, name: str, lines: _YamlLines | _TomlLines) -> Profile:
    label = f"profile {i}"
    if not isinstance(item, Mapping):
        raise ProfileError(name, "must be a mapping of fields", line=lines.item(i), profile=label)
    if isinstance(item.get("name"), str) and item["name"].strip():
        label = f"profile {i} ({_clip(item['name'].strip(), 40)})"

    def fail(field: str, why: str):
        return ProfileError(name, why, line=lines.field(i, field) or lines.item(i), profile=label, field=field)

    for field in item:
        if field not in FIELDS:
            raise fail(_short(field), f"unknown field {_short(field)}; fields are {', '.join(FIELDS)}")
    for field in _REQUIRED:
        if field not in item:
            raise fail(field, f"{field} is missing")
    if not isinstance(item["name"], str) or not item["name"].strip():
        raise fail("name", "name must be a non-empty string")
    if len(item["name"].strip()) > MAX_NAME:
        raise fail("name", f"name must be at most {MAX_NAME} characters")
    values = {}
    for field in FIELDS[1:]:
        value = item.get(field, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise fail(field, f"{field} must be a positive integer (got {_short(value)})")
        if value > LIMITS[field]:
            raise fail(field, f"{field} must be at most {LIMITS[field]} (got {_short(value)})")
        values[field] = value
    return Profile(item["name"].strip(), **values)


class _YamlLines:
    """1-based line numbers of a composed YAML document's profile items and fields."""

    def __init__(self, root: Any):
        self._root = root

    def _profiles(self):
        for key, value in getattr(self._root, "value", None) or []:
            if getattr(key, "value", None) == "profiles":
                return value
        return None

    def top(self) -> int | None:
        node = self._profiles()
        return node.start_mark.line + 1 if node is not None else None

    def _item(self, i: int):
        node = self._profiles()
        items = getattr(node, "value", None)
        return items[i - 1] if isinstance(items, list) and len(items) >= i else None

    def item(self, i: int) -> int | None:
        node = self._item(i)
        return node.start_mark.line + 1 if node is not None else None

    def field(self, i: int, field: str) -> int | None:
        pairs = getattr(self._item(i), "value", None)
        for key, value in pairs if isinstance(pairs, list) else []:
            if getattr(key, "value", None) == field:
                return value.start_mark.line + 1
        return None


class _TomlLines:
    """Line numbers for `[[profiles]]` tables; tomllib keeps none, so the text is scanned.
    Inline tables (`profiles = [{...}]`) get no line numbers: the profile and field still say where."""

    _HEADER = re.compile(r"\s*\[\[\s*profiles\s*\]\]\s*(#.*)?$")

    def __init__(self, text: str):
        self._lines = text.splitlines()
        self._headers = [n for n, line in enumerate(self._lines) if self._HEADER.match(line)]

    def top(self) -> int | None:
        return self._headers[0] + 1 if self._headers else None

    def item(self, i: int) -> int | None:
        return self._headers[i - 1] + 1 if len(self._headers) >= i else None

    def field(self, i: int, field: str) -> int | None:
        if len(self._headers) < i:
            return None
        pattern = re.compile(rf"\s*{re.escape(field)}\s*=")
        for n in range(self._headers[i - 1] + 1, len(self._lines)):
            if self._lines[n].lstrip().startswith("["):
                break
            if pattern.match(self._lines[n]):
                return n + 1
        return None
