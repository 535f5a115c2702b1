"""Explain: why this machine's fingerprint hits or misses, and which stored bundle came closest.

    this machine's facts ──► keys ──► an active bundle with our bundle key? ──► hit
                                              │ no
                                              ▼
    every candidate bundle: the facts that differ (ours vs its), split toolchain / workload
    ranked by how many facts differ, then newest first ──► nearest few, each with a verdict

Among the index's bundles, a miss is caused by a differing fact, a bundle that is no longer
active, or a facts file that this machine contradicts (restore then misses whatever the index
holds), so naming the facts answers "why did my pod start cold?" without anyone reading hashes.
Pure: takes facts and Bundle records, runs no queries. `kcache explain` also looks for a yank
marker on the hit (restore obeys one whatever the index says); a signature a pod requires is
`kcache verify --trusted-key`'s to check.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from kcache import fingerprint, layerkeys
from kcache import probes as probing
from kcache.records import Bundle

TOOLCHAIN, WORKLOAD = "toolchain", "workload"
NO_LAYER_REUSED = "not reused: {} does not describe this machine"  # the facts file, or --fact
_VALUE_IN_VERDICT = 40  # characters of a fact value quoted in a verdict (cxx.version is long)

# Why a differing fact causes a miss, most decisive first: the verdict names the first that applies.
# A name ending in "." is a prefix.
_REASONS: tuple[tuple[str, str], ...] = (
    ("cpu.isa", "kernels built for another ISA are never restored (they give NaNs or corrupt the heap)"),
    ("cpu.features", "kernels built with -march=native for other CPU features can die with SIGILL"),
    ("cxx.native", "the compiler's -march=native turns on other instructions there: its kernels can die with SIGILL"),
    ("gpu.sm", "kernels are compiled for one GPU architecture"),
    ("gpu.name", "Inductor's keys contain the GPU name"),
    ("arch", "kernels are machine code for one CPU architecture"),
    ("os", "kernels are built for one operating system"),
    ("libc", "kernels link against one C library"),
    ("python", "caches are keyed by the Python version and ABI (a debug build's extension modules are another's)"),
    ("torch.path", "compiled kernels link with absolute paths into the torch install"),
    ("torch.", "torch's cache keys contain its version and build"),
    ("triton.override_files", "Triton builds kernels from other override files and files them under its own keys"),
    ("triton.swap_mir_files", "Triton assembles kernels from other MIR files and files them under its own keys"),
    ("triton.", "Triton's cache keys contain its version"),
    ("engine.", "not every engine refuses cache entries of another version (TensorRT-LLM's autotuner loads any)"),
    ("gpu.driver", "the CUDA JIT cache is valid for one driver version"),
    ("gpu.count", "the bundle was built for another GPU count"),
    ("cxx.", "the C++ compiler is part of Inductor's keys"),
    ("cuda.nvcc", "nvcc builds CUTLASS kernels and torch extensions, and torch's keys hold its path, not its version"),
    (
        "cpu.threads",
        "Inductor bakes the thread count into CPU kernels (TORCHINDUCTOR_CPP_DYNAMIC_THREADS=1 takes it out)",
    ),  # fmt: skip
    ("cpu.", "kernels were built for another CPU"),
    *((f"env.{name}", "g++ reads it: the same command line builds from other headers, libraries or programs")
      for name in probing.COMPILER_ENV),  # fmt: skip
    *((f"env.{name}", "nvcc reads it: the same command line builds with other flags, headers or host compiler")
      for name in probing.NVCC_ENV),  # fmt: skip
    ("env.", "this setting changes the code torch generates"),
    ("model.", "a different model compiles different kernels"),
    ("workload.", "different compile options compile different kernels"),
    ("extra.", "the --extra workload facts differ"),
)


@dataclass(frozen=True)
class FactDiff:
    """One fact on which this machine and a bundle disagree; None means absent on that side."""

    name: str
    here: str | None
    bundle: str | None

    @property
    def group(self) -> str:
        return WORKLOAD if fingerprint.is_workload_fact(self.name) else TOOLCHAIN

    @property
    def here_only(self) -> tuple[str, ...] | None:
        """For a set-valued fact (cpu.features), the members only this machine has; else None."""
        sides = fingerprint.set_difference(self.name, self.here, self.bundle)
        return None if sides is None else sides[0]

    @property
    def bundle_only(self) -> tuple[str, ...] | None:
        sides = fingerprint.set_difference(self.name, self.here, self.bundle)
        return None if sides is None else sides[1]


@dataclass(frozen=True)
class Candidate:
    """A stored bundle, and how it differs from this machine."""

    bundle: Bundle
    differences: tuple[FactDiff, ...]  # toolchain first, then workload; by name within each
    verdict: str

    def group(self, name: str) -> tuple[FactDiff, ...]:
        return tuple(d for d in self.differences if d.group == name)


@dataclass(frozen=True)
class Explanation:
    fingerprint: fingerprint.Fingerprint
    hit: Bundle | None  # the newest active bundle with our bundle key: what restore would lay down
    nearest: tuple[Candidate, ...]  # empty on a hit
    considered: int  # bundles compared

    @property
    def mismatches(self) -> tuple[fingerprint.Mismatch, ...]:
        return self.fingerprint.mismatches


def diff_facts(here: Mapping[str, str], there: Mapping[str, str]) -> tuple[FactDiff, ...]:
    """Every fact whose value differs, including facts present on one side only."""
    names = {n for n in here.keys() | there.keys() if here.get(n) != there.get(n)}
    ordered = sorted(names, key=lambda n: (fingerprint.is_workload_fact(n), n))
    return tuple(FactDiff(n, here.get(n), there.get(n)) for n in ordered)


def reason(name: str) -> str:
    return _REASONS[_rank(name)][1] if _rank(name) < len(_REASONS) else "every toolchain fact must match exactly"


def _rank(name: str) -> int:
    for i, (pattern, _) in enumerate(_REASONS):
        if name == pattern or (pattern.endswith(".") and name.startswith(pattern)):
            return i
    return len(_REASONS)


def verdict(diffs: tuple[FactDiff, ...], bundle: Bundle, bundle_key: str, contradicted: str = "") -> str:
    """One line: the most decisive differing fact and why it means a miss.

    `contradicted` is the fingerprint's mismatch reason when this machine contradicts its facts file.
    """
    if not diffs:
        if contradicted and bundle.bundle_key == bundle_key:
            return f"same facts, but restore misses: {contradicted}"
        if bundle.bundle_key != bundle_key:
            return "same facts but another bundle key: published by a kcache with another fingerprint schema"
        if bundle.status != "active":
            return f"same bundle key, but the bundle is {bundle.status}: restore uses active bundles only"
        return "identical: restore would use this bundle"
    first = min(diffs, key=lambda d: (_rank(d.name), d.name))
    more = f" and {len(diffs) - 1} more fact{'s' if len(diffs) > 2 else ''}" if len(diffs) > 1 else ""
    what = fingerprint.describe_set_difference(first.name, first.here, first.bundle, "in bundle") or (
        f"{first.name} ({_quote(first.here, 'here')}, {_quote(first.bundle, 'in bundle')})"
    )
    return f"differs in {what}{more}: {reason(first.name)}"


def _quote(value: str | None, side: str) -> str:
    if value is None:
        return f"absent {side}"
    short = value if len(value) <= _VALUE_IN_VERDICT else value[: _VALUE_IN_VERDICT - 3] + "..."
    return f"{short} {side}"


def explain(
    facts: Mapping[str, str],
    bundles: Iterable[Bundle],
    *,
    limit: int = 3,
    mismatches: tuple[fingerprint.Mismatch, ...] = (),
) -> Explanation:
    """Compare this machine's facts with stored bundles: the hit, or the `limit` nearest bundles.

    With `mismatches` (a facts file this machine contradicts) there is no hit, as in restore.
    """
    fp = replace(fingerprint.compute(facts), mismatches=tuple(mismatches))
    contradicted = fp.mismatch_reason() if fp.mismatches else ""
    unique = list({b.id: b for b in bundles}.values())
    matching = [b for b in unique if b.bundle_key == fp.bundle_key and b.status == "active"]
    hit = max(matching, key=lambda b: (b.created_at, b.id), default=None)
    if hit is not None and not contradicted:
        return Explanation(fp, hit, (), len(unique))
    candidates = []
    for b in unique:
        diffs = diff_facts(fp.facts, b.facts)
        candidates.append(Candidate(b, diffs, verdict(diffs, b, fp.bundle_key, contradicted)))
    # Fewest differences first; among equals the newest, which is what a re-publish would replace.
    candidates.sort(key=lambda c: (len(c.differences), -c.bundle.created_at.timestamp(), c.bundle.id))
    return Explanation(fp, None, tuple(candidates[:limit]), len(unique))


def layer_verdicts(fp: fingerprint.Fingerprint, bundles: Iterable[Bundle]) -> tuple[layerkeys.Verdict, ...]:
    """Per reusable layer, what `restore --fallback layers` would take, as restore decides it.

    Under a facts file (or a --fact) this machine contradicts, restore takes no layer at all: a donor's
    layer key would be derived from the same false facts, so its kernels are as wrong here as a whole bundle's.
    """
    if not fp.mismatches:
        return layerkeys.verdicts(fp.facts, bundles)
    why = NO_LAYER_REUSED.format(fp.contradicted)
    return tuple(layerkeys.Verdict(layer, layerkeys.layer_key(layer, fp.facts), None, (), why)
                 for layer in layerkeys.FACTS)  # fmt: skip
