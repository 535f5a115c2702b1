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
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    try:
        text = path.read_text()
    except OSError as exc:
        raise ProfileError(str(path), f"cannot read: {exc.strerror or exc}") from None
    suffix = path.suffix.lower()
    if suffix in (".yaml", ".yml"):
        return parse_yaml(text, str(path))
    if suffix == ".toml":
        return parse_toml(text, str(path))
    raise ProfileError(str(path), "unknown format; name the file *.yaml, *.yml or *.toml")


def parse_yaml(text: str, name: str = "profiles.yaml") -> tuple[Profile, ...]:
    import yaml

    try:
        doc = yaml.safe_load(text)
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc)
        raise ProfileError(name, f"not valid YAML: {problem}", line=mark.line + 1 if mark else None) from None
    return _validate(doc, name, _YamlLines(node))


def parse_toml(text: str, name: str = "profiles.toml") -> tuple[Profile, ...]:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        found = re.search(r"line (\d+)", str(exc))
        raise ProfileError(name, f"not valid TOML: {exc}", line=int(found.group(1)) if found else None) from None
    return _validate(doc, name, _TomlLines(text))


def _validate(doc: Any, name: str, lines: _YamlLines | _TomlLines) -> tuple[Profile, ...]:
    if not isinstance(doc, Mapping) or "profiles" not in doc:
        raise ProfileError(name, "expected a top-level 'profiles' list (see `kcache warmup --help`)")
    unknown = sorted(set(doc) - {"profiles"})
    if unknown:
        raise ProfileError(name, f"unknown top-level key {unknown[0]!r}; only 'profiles' is read")
    items = doc["profiles"]
    if not isinstance(items, Sequence) or isinstance(items, str) or not items:
        raise ProfileError(name, "'profiles' must be a non-empty list", line=lines.top())
    profiles: list[Profile] = []
    for i, item in enumerate(items, start=1):
        profile = _one(item, i, name, lines)
        if any(p.name == profile.name for p in profiles):
            raise ProfileError(name, f"duplicate name {profile.name!r}", line=lines.field(i, "name"),
                               profile=f"profile {i} ({profile.name})", field="name")  # fmt: skip
        profiles.append(profile)
    return tuple(profiles)


def _one(item: Any, i: int, name: str, lines: _YamlLines | _TomlLines) -> Profile:
    label = f"profile {i}"
    if not isinstance(item, Mapping):
        raise ProfileError(name, "must be a mapping of fields", line=lines.item(i), profile=label)
    if isinstance(item.get("name"), str) and item["name"].strip():
        label = f"profile {i} ({item['name']})"

    def fail(field: str, why: str):
        return ProfileError(name, why, line=lines.field(i, field) or lines.item(i), profile=label, field=field)

    for field in item:
        if field not in FIELDS:
            raise fail(str(field), f"unknown field {field!r}; fields are {', '.join(FIELDS)}")
    for field in _REQUIRED:
        if field not in item:
            raise fail(field, f"{field} is missing")
    if not isinstance(item["name"], str) or not item["name"].strip():
        raise fail("name", "name must be a non-empty string")
    values = {}
    for field in FIELDS[1:]:
        value = item.get(field, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise fail(field, f"{field} must be a positive integer (got {value!r})")
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
