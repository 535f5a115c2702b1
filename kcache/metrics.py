"""Prometheus text exposition (format 0.0.4) of what the markers under a restore root say.

    kcache_ready                                 1 when `kcache ready` (same --health-url) would exit 0
    kcache_ready_signal{signal}                  1 per signal met: restore, weights, graphs, warmup, engine
    kcache_ready_cold                            1 when ready only because a failed warmup asked for ready-cold
    kcache_restore_info{status,bundle_key}       1; status is hit | miss | error
    kcache_restore_files / _bytes / _seconds     when the restore marker carries them
    kcache_warmup_info{status}                   1; status is ok | failed | running
    kcache_warmup_seconds, kcache_warmup_profiles
    kcache_jit_files_after_ready{layer}          files that appeared after ready (kcache watch)
    kcache_jit_bytes_after_ready{layer}
    kcache_watch_baseline_files, kcache_watch_publishes_total, kcache_watch_publish_errors_total

A series whose marker is absent is left out rather than reported as zero: "no restore yet" and
"restored nothing" are different answers. A field that is not a finite number at least 0 (a string,
an int too large for a float, 1e400, -3) is left out too: markers are written by other containers,
so every label value taken from one is also cut to one line of at most 200 characters. Rendering is pure; `collect`
only reads the markers (and asks the model server, given an engine).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from kcache import readiness, untrusted

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class Sample:
    labels: tuple[tuple[str, str], ...]
    value: float


@dataclass(frozen=True)
class Family:
    name: str
    kind: str  # gauge | counter
    help: str
    samples: tuple[Sample, ...]


def family(name: str, kind: str, help_: str, *samples: tuple[Mapping[str, str], float]) -> Family:
    return Family(name, kind, help_, tuple(Sample(tuple(sorted(labels.items())), float(v)) for labels, v in samples))


def render(families: Iterable[Family]) -> str:
    lines: list[str] = []
    for fam in families:
        lines.append(f"# HELP {fam.name} {_escape_help(fam.help)}")
        lines.append(f"# TYPE {fam.name} {fam.kind}")
        for sample in fam.samples:
            labels = ",".join(f'{k}="{_escape_label(v)}"' for k, v in sample.labels)
            lines.append(
                f"{fam.name}{{{labels}}} {_number(sample.value)}" if labels else f"{fam.name} {_number(sample.value)}"
            )
    return "\n".join(lines) + "\n"


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_label(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    return str(int(value)) if value.is_integer() else repr(value)


def collect(root: Path, engine: readiness.EngineHealth | None = None) -> list[Family]:
    """Every family the markers under `root` support right now (and the model server's health, given `engine`)."""
    state = readiness.check(root, engine)
    families = [
        family("kcache_ready", "gauge", "1 when restore finished, the weights loaded, graphs compiled and warmup "
               "ok (or failed with --on-failure ready-cold), and with --health-url the model server is healthy.",
               ({}, 1 if state.ready else 0)),
        family("kcache_ready_signal", "gauge", "1 for each readiness signal that holds.",
               *(({"signal": s.name}, 1 if s.ok else 0) for s in state.signals)),
        family("kcache_ready_cold", "gauge", "1 when ready although warmup failed (--on-failure ready-cold).",
               ({}, 1 if state.cold else 0)),
    ]  # fmt: skip
    families += _restore(state.restore)
    families += _warmup(state.warmup)
    families += _watch(readiness.read_marker(root, readiness.WATCH_MARKER))
    return families


def numeric(doc: Mapping, field: str) -> float | None:
    """A finite number at least 0 (every field is a count, a size or seconds), or None: markers are
    written by other containers, an int too large for a float (or 1e400, which parses to inf) must
    not turn every scrape into an error, and a negative counter would read as a reset to rate()."""
    value = doc.get(field)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) and number >= 0 else None


def _restore(doc: dict | None) -> list[Family]:
    if doc is None:
        return []
    labels = {"status": _label(doc.get("status", "unknown")), "bundle_key": _label(doc.get("bundle_key", ""))}
    result = [family("kcache_restore_info", "gauge", "Outcome of the last restore into this root.", (labels, 1))]
    for field, help_ in (("files", "Files the last restore laid down."),
                         ("bytes", "Bytes the last restore laid down."),
                         ("seconds", "Seconds the last restore took.")):  # fmt: skip
        value = numeric(doc, field)
        if value is not None:
            result.append(family(f"kcache_restore_{field}", "gauge", help_, ({}, value)))
    return result


def _warmup(doc: dict | None) -> list[Family]:
    if doc is None:
        return []
    result = [
        family(
            "kcache_warmup_info", "gauge", "Outcome of warmup.", ({"status": _label(doc.get("status", "unknown"))}, 1)
        )
    ]
    seconds = numeric(doc, "seconds")
    if seconds is not None:
        result.append(family("kcache_warmup_seconds", "gauge", "Seconds warmup took.", ({}, seconds)))
    if isinstance(doc.get("profiles"), list):
        result.append(family("kcache_warmup_profiles", "gauge", "Warmup profiles run.", ({}, len(doc["profiles"]))))
    return result


def _watch(doc: dict | None) -> list[Family]:
    if doc is None:
        return []
    files, sizes = _per_layer(doc, "new_files"), _per_layer(doc, "new_bytes")
    return [
        family("kcache_jit_files_after_ready", "gauge",
               "Cache files that appeared after the pod became ready: shapes warmup did not cover.",
               *(({"layer": layer}, count) for layer, count in files)),
        family("kcache_jit_bytes_after_ready", "gauge", "Bytes of those files.",
               *(({"layer": layer}, size) for layer, size in sizes)),
        family("kcache_watch_baseline_files", "gauge", "Cache files present when the pod became ready.",
               ({}, numeric(doc, "baseline_files") or 0)),
        family("kcache_watch_publishes_total", "counter", "Delta publishes by kcache watch.",
               ({}, numeric(doc, "publishes") or 0)),
        family("kcache_watch_publish_errors_total", "counter", "Delta publishes that failed.",
               ({}, numeric(doc, "publish_errors") or 0)),
    ]  # fmt: skip


def _per_layer(doc: Mapping, field: str) -> list[tuple[str, float]]:
    """(layer, number) pairs of a {layer: number} field, sorted; anything else in it is left out."""
    values = doc.get(field)
    if not isinstance(values, Mapping):
        return []
    pairs: dict[str, float] = {}
    for key in values:
        number = numeric(values, key)
        if number is not None:
            pairs.setdefault(_label(key), number)  # two names cut to one label: one series, or the scrape fails
    return sorted(pairs.items())


def _label(value: object) -> str:
    """A label value from a marker: one line, bounded (a 4 MiB status must not become a 4 MiB scrape)."""
    return untrusted.one_line(value, readiness.MAX_SHOWN)
