"""Files kcache reads from a path a user or another container controls: regular files only, capped.

A FIFO in place of --facts-file (a ConfigMap path another container can replace, an env value)
blocked the init container for good in open(); /dev/zero or a huge file was read whole. Each
input is a clear ConfigError instead; a cache file replaced by a FIFO after publish's walk is
skipped, not waited on.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from outcome import outcome_within

from kcache import fingerprint, signing
from kcache.errors import ConfigError
from kcache.publish import _hash_or_skip

READERS = {
    "facts-file": lambda p: fingerprint.load_facts_file(p),
    "model-config": lambda p: fingerprint.workload_facts("m", p, {}),
    "trusted-key": lambda p: signing.load_trusted_keys([p]),
    "signing-key": lambda p: signing.load_signing_key(p),
}
CAPS = {"facts-file": fingerprint.MAX_FACTS_FILE_BYTES, "model-config": fingerprint.MAX_MODEL_CONFIG_BYTES,
        "trusted-key": signing.MAX_KEY_FILE_BYTES, "signing-key": signing.MAX_KEY_FILE_BYTES}  # fmt: skip


def outcome_of(call, fifo: Path | None = None) -> list:
    """Run `call` in a thread; a reader stuck on a FIFO is freed by opening its other end."""
    unstick = (lambda: os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))) if fifo is not None else None
    return [outcome_within(call, 30, unstick, "the read blocked on a FIFO")]


@pytest.mark.parametrize("what", list(READERS))
def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path, what):
    fifo = tmp_path / "input"
    os.mkfifo(fifo)
    (result,) = outcome_of(lambda: READERS[what](fifo), fifo)
    assert isinstance(result, ConfigError) and "not a regular file" in str(result), result


@pytest.mark.parametrize("what", list(READERS))
def test_a_file_over_the_cap_is_refused_unread(tmp_path, what):
    big = tmp_path / "input"
    with open(big, "wb") as f:
        f.truncate(CAPS[what] + 1)  # sparse: costs no disk
    (result,) = outcome_of(lambda: READERS[what](big))
    assert isinstance(result, ConfigError) and "limit" in str(result), result


@pytest.mark.parametrize("what", list(READERS))
def test_dev_zero_is_refused(what):
    (result,) = outcome_of(lambda: READERS[what](Path("/dev/zero")))
    assert isinstance(result, ConfigError) and "not a regular file" in str(result), result


def test_a_cache_file_replaced_by_a_fifo_after_the_walk_is_skipped(tmp_path):
    fifo = tmp_path / "kernel.so"
    os.mkfifo(fifo)
    (result,) = outcome_of(lambda: _hash_or_skip(fifo), fifo)
    assert result is None
