"""The watch sidecar's publish error (its --json line, its log) never carries a password: a
driver's or a bug's message may quote the index URL whole."""

from __future__ import annotations

import pytest

from kcache import watch
from kcache.errors import StoreError


@pytest.mark.parametrize("exc", [
    RuntimeError("connection to postgresql://kcache:hunter2-pw@db/kcache failed"),
    OSError("cannot reach https://key:hunter2-pw@s3.example/bucket"),
    StoreError("s3://b", "https://key:hunter2-pw@s3.example/bucket answered 500"),
])  # fmt: skip
def test_publish_error_text_is_redacted(exc):
    text = watch.describe(exc)
    assert "hunter2-pw" not in text and ("db/kcache" in text or "s3.example" in text)
