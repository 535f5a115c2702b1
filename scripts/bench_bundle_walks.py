"""Benchmark (not a test): peak RSS and seconds of the walks over every bundle, at fleet scale.

    python scripts/bench_bundle_walks.py fill [--bundles 20000] [--db PATH]
    python scripts/bench_bundle_walks.py listing|plan|donor|donor-miss [--db PATH]

`fill` writes a fresh SQLite index: --bundles bundles over 2,000 bundle keys, each with ~2.6 KB of
facts (45 facts, as real rows carry). Each other mode measures one call, in its own process (peak
RSS is per process, so run one mode per process):

    listing     what gc's plan and verify hold of every bundle
    plan        gc.plan with --keep-last 3 against an empty file:// store (no manifests)
    donor       one layer-ref donor lookup (layerkeys.donor_ref) that finds holders at once
    donor-miss  one that finds none: it walks every key's newest bundle

Works on older code too (lifecycle.all_bundles): PYTHONPATH picks which kcache is measured.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import tempfile
import time
from datetime import datetime, timedelta, timezone

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
FACTS = {f"fact.{i:02d}.name": f"value-{i}-" + "x" * 30 for i in range(45)}
KEYS = 2000


def fill(path: str, n: int) -> None:
    from sqlalchemy import insert

    from kcache.index import Index
    from kcache.index.models import BundleRow

    if os.path.exists(path):
        os.remove(path)
    index = Index.open(f"sqlite:///{path}")
    facts = json.dumps(FACTS, sort_keys=True)
    rows = [dict(id=f"{i:064x}", bundle_key=f"{i % KEYS:032x}", toolchain_key="t" * 32, workload_key="w" * 32,
                 model=f"org/m{i % 1000}", facts=facts, layers="inductor,triton,cuda", files=500, bytes=10**8,
                 created_at=T0 + timedelta(seconds=i), created_by="host:1", status="active", compile_seconds=100.0)
            for i in range(n)]  # fmt: skip
    with index.engine.begin() as conn:
        conn.execute(insert(BundleRow), rows)
    print(f"{n} bundles in {path}, {len(facts)} B of facts each")


def measure(path: str, mode: str) -> None:
    import kcache
    from kcache import gc, layerkeys
    from kcache.index import Index, lifecycle
    from kcache.store.local import LocalStore

    logging.disable(logging.WARNING)  # donor lookups warn once per manifest the empty store lacks
    index = Index.open(f"sqlite:///{path}")
    index.count_bundles()  # connected, schema checked: not part of the figure
    store = LocalStore(tempfile.mkdtemp(prefix="kcache-bench-store-"))
    listing = getattr(lifecycle, "bundle_heads", None) or lifecycle.all_bundles
    key = layerkeys.layer_key("cuda", FACTS)
    work = {
        "listing": lambda: len(listing(index)),
        "plan": lambda: len(gc.plan(store, index, gc.Policy(keep_last=3), now=T0 + timedelta(days=30)).delete_bundles),
        "donor": lambda: layerkeys.donor_ref(store, index, "cuda", key),
        "donor-miss": lambda: layerkeys.donor_ref(store, index, "cuda", "0" * 32),
    }[mode]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    out = work()
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"{os.path.dirname(os.path.dirname(kcache.__file__))}  {mode}: {seconds:.2f} s, peak RSS "
          f"+{(after - before) / 1024:.0f} MiB (total {after / 1024:.0f} MiB); {out}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["fill", "listing", "plan", "donor", "donor-miss"])
    parser.add_argument("--bundles", type=int, default=20000)
    parser.add_argument("--db", default=os.path.join(tempfile.gettempdir(), "kcache-bundle-walks.db"))
    args = parser.parse_args()
    fill(args.db, args.bundles) if args.mode == "fill" else measure(args.db, args.mode)


if __name__ == "__main__":
    main()
