"""A multipart upload that fails for any reason is aborted: S3 bills its parts until then.

Faults come from wrapping the store's boto3 client (every call still reaches moto's server); the
uploads left open are what the bucket itself lists.
"""

from __future__ import annotations

import logging
import signal

import boto3
import pytest
from botocore.exceptions import ClientError, EndpointConnectionError

from kcache.errors import StoreError, Terminated
from kcache.store import s3

KEY = "packs/ab/" + "ab" * 32


class FaultyClient:
    """The real client, but `fail[method](call number)` may raise instead of (or after) calling it."""

    def __init__(self, inner, **fail):
        self.inner, self.fail, self.calls = inner, fail, {}

    def __getattr__(self, name):
        method = getattr(self.inner, name)
        if name not in self.fail:
            return method

        def call(**kwargs):
            self.calls[name] = number = self.calls.get(name, 0) + 1
            return self.fail[name](number, lambda: method(**kwargs))

        return call


@pytest.fixture
def big(tmp_path, monkeypatch):
    monkeypatch.setattr(s3, "MULTIPART_THRESHOLD", 6 * 1024 * 1024)
    monkeypatch.setattr(s3, "PART_SIZE", 5 * 1024 * 1024)  # S3's minimum part size
    path = tmp_path / "big"
    path.write_bytes(bytes(range(256)) * (48 * 1024))  # 12 MiB: three parts
    return path


def _open_uploads(store) -> list[str]:
    """The bucket's own list of multipart uploads not completed nor aborted."""
    client = boto3.client("s3", endpoint_url=store.client.meta.endpoint_url)
    return [u["Key"] for u in client.list_multipart_uploads(Bucket=store.bucket).get("Uploads", [])]


def _on_part(number: int, exc: BaseException):
    def upload_part(n, call):
        if n == number:
            raise exc
        return call()

    return upload_part


@pytest.mark.parametrize("exc", [Terminated(signal.SIGTERM), KeyboardInterrupt(), RuntimeError("a bug")],
                         ids=["terminated", "interrupt", "bug"])  # fmt: skip
def test_an_upload_interrupted_by_any_exception_is_aborted(s3_store, big, exc):
    s3_store.client = FaultyClient(s3_store.client, upload_part=_on_part(2, exc))
    with pytest.raises(type(exc)) as caught:
        s3_store.put_file(KEY, big)
    assert caught.value is exc
    assert s3_store.client.calls["upload_part"] >= 2
    assert _open_uploads(s3_store) == [] and list(s3_store.leftovers()) == []
    assert not s3_store.exists(KEY)


def test_an_upload_whose_source_cannot_be_read_is_aborted(s3_store, big):
    def create_multipart_upload(_n, call):
        answer = call()
        big.unlink()  # the pack's temporary file went away after the upload began
        return answer

    s3_store.client = FaultyClient(s3_store.client, create_multipart_upload=create_multipart_upload)
    with pytest.raises(FileNotFoundError):
        s3_store.put_file(KEY, big)
    assert _open_uploads(s3_store) == []


def _abort_fails(exc: BaseException):
    def abort_multipart_upload(_n, _call):
        raise exc

    return abort_multipart_upload


ABORT_FAILURES = [
    ClientError({"Error": {"Code": "AccessDenied", "Message": "no"}}, "AbortMultipartUpload"),
    EndpointConnectionError(endpoint_url="http://127.0.0.1:9"),
    ConnectionResetError(104, "reset by peer"),
    ValueError("an unexpected answer"),
]


@pytest.mark.parametrize("abort", ABORT_FAILURES, ids=["client-error", "unreachable", "reset", "value-error"])
def test_a_failed_abort_does_not_mask_an_interrupt(s3_store, big, abort, caplog):
    interrupt = Terminated(signal.SIGTERM)
    s3_store.client = FaultyClient(s3_store.client, upload_part=_on_part(1, interrupt),
                                   abort_multipart_upload=_abort_fails(abort))  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="kcache.store.s3"), pytest.raises(Terminated) as caught:
        s3_store.put_file(KEY, big)
    assert caught.value is interrupt
    assert s3_store.client.calls["abort_multipart_upload"] == 1
    assert "could not abort multipart upload" in caplog.text
    assert _open_uploads(s3_store) == [s3_store._key(KEY)]  # left for gc's leftovers or a lifecycle rule


@pytest.mark.parametrize("abort", ABORT_FAILURES, ids=["client-error", "unreachable", "reset", "value-error"])
def test_a_failed_abort_does_not_mask_a_store_error(s3_store, big, abort):
    refused = ClientError({"Error": {"Code": "InternalError", "Message": "try later"}}, "UploadPart")
    s3_store.client = FaultyClient(s3_store.client, upload_part=_on_part(2, refused),
                                   abort_multipart_upload=_abort_fails(abort))  # fmt: skip
    with pytest.raises(StoreError, match="InternalError"):
        s3_store.put_file(KEY, big)
    assert s3_store.client.calls["abort_multipart_upload"] == 1
