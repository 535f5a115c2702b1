"""What the gc fault and clock tests share: a small published bundle, the packs it names, and a
publisher's index that waits right before its commit point."""

from __future__ import annotations

import threading

from trees import write_tree

from kcache import manifest as manifests
from kcache import sources
from kcache.publish import PublishConfig, publish

LAYERS = sources.select()


def publish_tree(tmp_path, store, index, fp, content: bytes, name: str, signing_key=None):
    write_tree(tmp_path / name, {"inductor/kernel.so": content, f"inductor/{name}.py": name.encode()})
    return publish(store, index, fp, LAYERS, root=tmp_path / name, env={},
                   config=PublishConfig(signing_key=signing_key))


def packs_of(store, bundle_id):
    return {e.pack for e in manifests.fetch(store, bundle_id).entries}


class CommitsWhenReleased:
    """A publisher's index that stops right before the commit point (the bundle row), after its
    packs are uploaded, recorded and revived, until released."""

    def __init__(self, inner):
        self.inner, self.reached, self.release = inner, threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def add_bundle(self, bundle, **kwargs):
        self.reached.set()
        assert self.release.wait(60)
        return self.inner.add_bundle(bundle, **kwargs)
