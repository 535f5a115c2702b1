"""Fingerprints: the named facts that decide whether a cached kernel is safe to run here.

    facts (dotted names, string values)
      ├── toolchain facts: machine, drivers, compilers, torch/triton, Inductor settings
      │     toolchain_key = xxh3_128(canonical {"schema", "facts": toolchain facts})
      └── workload facts: names starting model. / workload. / extra.
            workload_key  = xxh3_128(canonical {"schema", "facts": workload facts})
    bundle_key = xxh3_128(canonical {"schema", "toolchain": toolchain_key, "workload": workload_key})

Torch's own cache keys leave out facts that change what a kernel does (the CPU ISA) or where it
links from (the torch install path): serving such a hit gives NaNs or heap corruption, so those
facts are here. Facts that differ between identical replicas (host names, IPs, HOME, the
cache directories themselves) are never here, or no replica would ever hit.

Where facts come from, weakest first (each later source wins fact by fact, none drops one):
this machine's probes (kcache.probes) or a facts file; --model, --model-config, --extra; --fact.
A facts file, and a --fact naming a fact this machine can see itself (probes.CHECKS), are checked
against it: a fingerprint carries the disagreements, restore treats any as a miss and publish refuses.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from kcache import boundedread, canonical, untrusted
from kcache import probes as probing
from kcache.errors import ConfigError
from kcache.probes import NONE

log = logging.getLogger(__name__)

# 2: cpu.features (every ISA feature -march=native may use) replaced cpu.flags and cpu.model;
#    gpu.* describe the CUDA-visible devices; a user's TORCH_COMPILE_CACHE_KEY_TAG is keyed.
# 3: cpu.isa names the vector ISA off x86 as torch does (sve128/sve256 by SVE length, neon, vsx,
#    zvector, none; ATEN_CPU_CAPABILITY=default is none everywhere); s390x keys its features and
#    ppc64le/s390x a cpu.model; TORCH_INDUCTOR_INSTALL_GXX is keyed.
# 4: cxx.native, the instruction sets the compiler's -march=native turns on (x86: gcc reads CPUID, and
#    /proc/cpuinfo hides some of them, e.g. AVX10.2, APX, AVX-NE-CONVERT).
# 5: cxx.v_hash hashes `g++ -v` as torch runs it for its keys (by name, LC_ALL=C), not by its path.
SCHEMA = 5
WORKLOAD_PREFIXES = ("model.", "workload.", "extra.")
# A facts file without these would put every machine under one toolchain key. gpu.sm may be "none".
CORE_FACTS = ("os", "arch", "python", "torch.version", "cpu.isa", "cpu.features", "gpu.sm")
# Facts read from one --model-config file: a new file replaces all of them, stale ones included.
_CONFIG_FACTS = ("model.config", "model.arch", "model.dtype")
# Facts whose value is a space-separated set.
_SET_FACTS = {"cpu.features", "cxx.native"}
# Volatile fields of a Hugging Face config.json that do not change the compiled graph.
_CONFIG_VOLATILE = {"_name_or_path", "transformers_version", "_commit_hash"}


FACTS_FILE, FACT_FLAG = "the facts file", "--fact"  # what claimed a mismatched fact


@dataclass(frozen=True)
class Mismatch:
    """A fact on which the facts file (or a --fact over it), or a --fact over this machine's own
    probes, and this machine's own probe disagree."""

    fact: str
    claimed: str | None  # None: the facts file lacks a fact this machine can see
    probed: str
    source: str = FACTS_FILE  # FACTS_FILE or FACT_FLAG


@dataclass(frozen=True)
class Fingerprint:
    facts: Mapping[str, str]
    toolchain_key: str
    workload_key: str
    bundle_key: str
    mismatches: tuple[Mismatch, ...] = ()  # only with a facts file; any one makes restore a miss

    def as_dict(self) -> dict:
        return {
            "bundle_key": self.bundle_key,
            "toolchain_key": self.toolchain_key,
            "workload_key": self.workload_key,
            "facts": dict(sorted(self.facts.items())),
            "mismatches": [{"fact": m.fact, "facts_file": m.claimed, "here": m.probed} for m in self.mismatches],
        }

    @property
    def contradicted(self) -> str:
        """What this machine contradicts: FACTS_FILE or FACT_FLAG (only with mismatches)."""
        return FACTS_FILE if any(m.source == FACTS_FILE for m in self.mismatches) else FACT_FLAG

    def mismatch_reason(self) -> str:
        """One line naming every disagreement, for a miss's reason."""
        return f"{self.contradicted} does not describe this machine: " + "; ".join(map(_describe, self.mismatches))


# What --facts-file and --model-config may hold: `kcache fingerprint --json` prints a few KiB and a
# model's config.json is tens of KiB; anything far larger is not the file meant (or /dev/zero).
MAX_FACTS_FILE_BYTES = 1 << 20
MAX_MODEL_CONFIG_BYTES = 4 << 20


def _describe(m: Mismatch) -> str:
    where = "in the facts file" if m.source == FACTS_FILE else f"by {m.source}"
    return describe_set_difference(m.fact, m.probed, m.claimed, where) or (
        f"{m.fact} ({_short(m.claimed)} {where}, {_short(m.probed)} here)"
    )


def set_difference(fact: str, here: str | None, there: str | None) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """For a set-valued fact (cpu.features): the names only `here` has, and only `there` has; else None."""
    if fact not in _SET_FACTS or here is None or there is None:
        return None
    ours, theirs = set(here.split()), set(there.split())
    return tuple(sorted(ours - theirs)), tuple(sorted(theirs - ours))


def describe_set_difference(fact: str, here: str | None, there: str | None, there_side: str) -> str | None:
    """`fact (N here only: ..., M <there_side> only: ...)` for a set-valued fact whose sets differ, else None.

    The list is long (hundreds of characters of cpu.features): quoting both values cut short would hide
    the one feature that differs.
    """
    sides = set_difference(fact, here, there)
    if sides is None or not any(sides):
        return None
    said = [f"{len(names)} {side}: {_short(' '.join(names), 120)}"
            for names, side in zip(sides, ("here only", f"{there_side} only")) if names]  # fmt: skip
    return f"{fact} ({', '.join(said)})"


def _short(value: str | None, limit: int = 60) -> str:
    if value is None:
        return "absent"
    return value if len(value) <= limit else value[: limit - 3] + "..."


def is_bundle_key(text: str) -> bool:
    """Whether `text` has the shape of a bundle key: xxh3_128 as 32 lowercase hex digits (canonical.xxh3)."""
    return len(text) == 32 and all(c in "0123456789abcdef" for c in text)


def is_workload_fact(name: str) -> bool:
    return name.startswith(WORKLOAD_PREFIXES)


def compute(facts: Mapping[str, str]) -> Fingerprint:
    """Keys for a set of facts. Pure: the same facts give the same keys on any machine.

    ConfigError for a fact that is not UTF-8 text (an environment variable or --model holding a byte
    no encoding names reads as a lone surrogate): canonical JSON cannot carry it, so nothing is keyed.
    """
    for name, value in facts.items():
        if not (untrusted.is_utf8(name) and untrusted.is_utf8(value)):
            raise ConfigError(f"fact {ascii(name)}", value, "is not UTF-8 text, so it cannot be keyed; "
                              "set the environment variable or flag it comes from to UTF-8 text")  # fmt: skip
    toolchain = {k: v for k, v in facts.items() if not is_workload_fact(k)}
    workload = {k: v for k, v in facts.items() if is_workload_fact(k)}
    toolchain_key = canonical.xxh3({"schema": SCHEMA, "facts": toolchain})
    workload_key = canonical.xxh3({"schema": SCHEMA, "facts": workload})
    bundle_key = canonical.xxh3({"schema": SCHEMA, "toolchain": toolchain_key, "workload": workload_key})
    return Fingerprint(dict(facts), toolchain_key, workload_key, bundle_key)


def parse_assignments(pairs: Iterable[str], flag: str) -> dict[str, str]:
    """`name=value` strings from the command line."""
    result = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.strip():
            raise ConfigError(flag, pair, "expected NAME=VALUE")
        result[name.strip()] = value
    return result


def collect(
    *,
    model: str | None = None,
    model_config: Path | None = None,
    extra: Mapping[str, str] | None = None,
    overrides: Mapping[str, str] | None = None,
    env: Mapping[str, str] | None = None,
    probes: Iterable[probing.Probe] | None = None,
    facts_file: Path | None = None,
    checks: Iterable[probing.Probe] | None = None,
) -> Fingerprint:
    """Probe this machine (or read `facts_file`), add the workload flags, apply overrides, compute the keys.

    A facts file is what `kcache fingerprint --json` printed on the machine that runs the model:
    an init container without torch, g++ or a GPU then computes the model container's
    fingerprint. It is checked against `checks` (default probing.CHECKS), what this machine can
    see itself; disagreements land in `mismatches`. So is each override without a facts file: a
    --fact describing another CPU (or GPU, arch) would file this machine's kernels under that
    machine's key on publish, and run that machine's kernels here on restore.
    """
    env = os.environ if env is None else env
    if facts_file is not None:
        facts = load_facts_file(Path(facts_file))
    else:
        facts = {}
        for probe in _default(probes, "PROBES"):
            facts.update(probe(env))
    facts.setdefault("model.id", NONE)
    if model_config is not None:
        for name in _CONFIG_FACTS:
            facts.pop(name, None)
    facts.update(workload_facts(model, model_config, extra or {}))
    _refuse_blank_identity(overrides or {})
    _warn_unknown(overrides or {}, facts)
    facts.update(overrides or {})
    fp = compute(facts)
    if facts_file is None:
        return replace(fp, mismatches=_overrides_contradicted(overrides or {}, facts, env, checks))
    return replace(fp, mismatches=find_mismatches(facts, env, _default(checks, "CHECKS")))


def _overrides_contradicted(overrides: Mapping[str, str], facts: Mapping[str, str], env: Mapping[str, str],
                            checks: Iterable[probing.Probe] | None) -> tuple[Mismatch, ...]:  # fmt: skip
    """The overridden facts a check reads here otherwise. A fact no check reads (GPU facts where no GPU
    is visible: a CPU-only builder naming production's GPU) stays a plain override."""
    if not any(not is_workload_fact(name) for name in overrides):
        return ()  # nothing to probe again (--fact model.id=...)
    found = find_mismatches(facts, env, _default(checks, "CHECKS"))
    return tuple(replace(m, source=FACT_FLAG) for m in found if m.fact in overrides)


def with_model(fp: Fingerprint, model: str) -> Fingerprint:
    """`fp` as `collect` gives it for another --model: the same machine (not probed again), facts file
    and flags; a blank `model` is refused as in `collect`. Not for a --fact model.id, which wins over
    every --model."""
    facts = {**fp.facts, **workload_facts(model, None, {})}
    return replace(compute(facts), mismatches=fp.mismatches)


# The facts that say which model a bundle is for (publish.names_a_model). Other facts may be blank on
# a real machine (env.TORCHINDUCTOR_X set to ""; model.arch of an empty architectures list); these never.
_IDENTITY_FACTS = ("model.id", "model.config")


def _blank_identity(facts: Mapping[str, str]) -> str | None:
    """The model-identity fact `facts` give blank, if any: it would key a bundle no pod naming its
    model ever restores (a variable expanded to nothing), so it is refused as a blank --model is."""
    return next((name for name in _IDENTITY_FACTS if name in facts and not facts[name].strip()), None)


def _refuse_blank_identity(overrides: Mapping[str, str]) -> None:
    if name := _blank_identity(overrides):
        raise ConfigError(f"--fact {name}", overrides[name], "is blank; give the model identity "
                          "(e.g. --model meta-llama/Llama-3.1-8B), or leave the fact out")  # fmt: skip


def _warn_unknown(overrides: Mapping[str, str], facts: Mapping[str, str]) -> None:
    """Say so when an override names no fact this machine (or the facts file) has: a misspelt name
    adds a fact and leaves the one meant as probed. Not refused: a newer kcache's facts file or a
    probe this machine lacks may name facts this one does not know."""
    for name in sorted(set(overrides) - set(facts)):
        if is_workload_fact(name):
            continue
        import difflib  # only for a misspelt --fact

        close = difflib.get_close_matches(name, list(facts), n=1)
        hint = f" (did you mean {close[0]}?)" if close else " (--extra adds workload facts of your own)"
        log.warning("--fact %s names no fact of this machine; it is added as a new fact%s", name, hint)


def _default(given, name: str):
    # Looked up at call time, so that tests replacing probes.PROBES or probes.CHECKS take effect.
    return getattr(probing, name) if given is None else given


def find_mismatches(facts: Mapping[str, str], env: Mapping[str, str], checks: Iterable[probing.Probe]):
    """Every fact a check probed here whose value differs from `facts`, by name."""
    probed: dict[str, str] = {}
    for check in checks:
        probed.update(check(env))
    return tuple(Mismatch(n, facts.get(n), v) for n, v in sorted(probed.items()) if facts.get(n) != v)


def load_facts_file(path: Path) -> dict[str, str]:
    """Facts from `kcache fingerprint --json` output, or a flat JSON object of name -> value."""
    doc = _read_json(path, "--facts-file", MAX_FACTS_FILE_BYTES)
    facts = doc.get("facts", doc) if isinstance(doc, dict) else None
    if not isinstance(facts, dict) or not all(isinstance(v, str) for v in facts.values()):
        raise ConfigError("--facts-file", str(path), "expected `kcache fingerprint --json` output or {name: value}")
    missing = [name for name in CORE_FACTS if name not in facts]
    if facts.get("arch") in probing.X86 and "cxx.v_hash" in facts and "cxx.native" not in facts:
        missing.append("cxx.native")  # a file from before schema 4, whose compiler saw what cpuinfo hides
    if missing:
        raise ConfigError("--facts-file", str(path), f"lacks the core facts {', '.join(missing)}; write it with "
                          "`kcache fingerprint --json` in the model container, with this kcache version")  # fmt: skip
    if name := _blank_identity(facts):  # refused as --fact model.id= is: a kcache that took that flag wrote it
        raise ConfigError("--facts-file", str(path), f"has a blank {name}; write it again with `kcache "
                          "fingerprint --json` and the model's identity, or leave the fact out")  # fmt: skip
    return {str(k): v for k, v in facts.items()}


# ---- workload ---------------------------------------------------------------------------------


def workload_facts(model: str | None, config_path: Path | None, extra: Mapping[str, str]) -> dict[str, str]:
    """The workload facts the flags give; a flag not given gives no fact (it never resets one).

    A blank --model is refused: it would key a bundle no pod naming its model ever restores. So is
    a blank --extra (a variable expanded to nothing): no pod that sets the fact restores its bundle.
    """
    if model is not None and not model.strip():
        raise ConfigError("--model", model, "is blank; give the model identity, e.g. --model meta-llama/Llama-3.1-8B")
    for name, value in extra.items():
        if not value.strip():
            raise ConfigError(f"--extra {name}", value, f"is blank; give it a value (e.g. --extra {name}=2), "
                              "or leave it out")  # fmt: skip
    facts = {"model.id": model} if model else {}
    if config_path is not None:
        facts.update(_model_config_facts(Path(config_path)))
    facts.update({f"extra.{k}": v for k, v in extra.items()})
    return facts


def _read_json(path: Path, flag: str, limit: int):
    data = boundedread.read_named(path, limit, flag)
    try:
        return json.loads(data, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested past the parser's limit
        raise ConfigError(flag, str(path), f"is not JSON: {exc}") from None


def _refuse_constant(name: str) -> None:
    """NaN and Infinity: Python's json reads and writes them, JSON and canonical JSON have none."""
    raise ValueError(f"{name} is no JSON number")


def _model_config_facts(path: Path) -> dict[str, str]:
    config = _read_json(path, "--model-config", MAX_MODEL_CONFIG_BYTES)
    if not isinstance(config, dict):
        raise ConfigError("--model-config", str(path), "is not a JSON object")
    kept = {k: v for k, v in config.items() if k not in _CONFIG_VOLATILE}
    try:  # text escaped as a lone surrogate has no canonical (UTF-8) form; a facts file's is checked in compute
        facts = {"model.config": canonical.xxh3(kept)}
    except (ValueError, RecursionError) as exc:
        raise ConfigError("--model-config", str(path), f"cannot be keyed: {exc}") from None
    if isinstance(config.get("architectures"), list):
        facts["model.arch"] = ",".join(map(str, config["architectures"]))
    dtype = config.get("torch_dtype") or config.get("dtype")
    if dtype:
        facts["model.dtype"] = str(dtype)
    return facts
