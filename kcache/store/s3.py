"""`s3://bucket/prefix` backend (botocore, boto3's core; the only module that imports it).

    s3://bucket/prefix/packs/<hh>/<pack-id>
                      /manifests/<hh>/<manifest-id>
                      /refs/<bundle-key>

Content-addressed objects are written with `If-None-Match: *`: a 412 (or a 409 from a racing
conditional write) means the same bytes are already there, which is success. Reads are ranged
GETs streamed to the caller. Retries with backoff, connect/read timeouts and the connection pool
size are botocore configuration, not loops here. botocore retries requests, not bodies: a whole
object read cut part-way is resumed here with ranged GETs of the same ETag (range reads are
resumed by their reader, kcache.fetch). Any S3-compatible endpoint works through
AWS_ENDPOINT_URL or --s3-endpoint-url; credentials come the usual boto3 way: botocore's chain
(environment, profile, web identity, container and instance metadata). boto3 itself is not
imported: its transfer manager, which kcache does not use, cost every command 35 ms to import, and
its session 25 ms more to make a client.
"""

from __future__ import annotations

import io
import logging
import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from functools import partial
from pathlib import Path
from typing import BinaryIO

import botocore.loaders
import botocore.session
from botocore.awsrequest import AWSResponse
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    ReadTimeoutError,
)
from botocore.parsers import ResponseParserError
from urllib3 import exceptions as urllib3_errors

from kcache import durations
from kcache.errors import ConfigError, ObjectMissing, ObjectTooLarge, StoreError
from kcache.store.base import Leftover, ObjectInfo, is_valid_key
from kcache.streams import Resumable, Window, read_exact
from kcache.untrusted import one_line

log = logging.getLogger(__name__)
_PACK_UPLOAD = re.compile(r"packs/[0-9a-f]{2}/[0-9a-f]{64}\Z")  # the only objects kcache uploads in parts

MULTIPART_THRESHOLD = 64 * 1024 * 1024
# The most of an error answer's body read: S3's are a few hundred bytes of XML. botocore reads every
# answer of 300 and up whole into memory, and an endpoint on plain http can send gigabytes.
ERROR_BODY_BYTES = 64 * 1024
# The most of a successful answer read whole (list pages, multipart replies; object reads stream):
# a page of 1000 keys is about 300 KB. Past it the answer is refused, not retried.
WHOLE_BODY_BYTES = 16 * 1024 * 1024
PART_SIZE = 16 * 1024 * 1024
# An answer botocore cannot parse: a header that is no number or date where S3 sends one (ValueError), a
# body that is no XML (ResponseParserError). A hostile endpoint's (plain http on the path) or a broken
# server's: a store failure like any other, where it had been a bug exit (70) and a crashed DaemonSet.
_UNPARSED = (ResponseParserError, ValueError)
_BROKEN = (BotoCoreError, *_UNPARSED)  # no S3 error code: the transport or the answer failed
_FAILED = (ClientError, *_BROKEN)
_MISSING = {"NoSuchKey", "404", "NotFound"}
_EXISTS = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"}


class _S3Models(botocore.loaders.Loader):
    """botocore's data loader for clients of S3 alone.

    Before it loads a model, the stock loader makes sure the service exists by listing every service
    botocore knows: ~440 directories, some 900 listdir and 2,700 stat calls, twice per client (the
    model and its endpoint rules): 10-20% of making a client (0.10 s -> 0.09 s on a 16-core host,
    0.095 s -> 0.078 s on 2 cores), paid by every restore before its first request. S3 is the one
    service kcache asks for, so that is the list; the model files themselves load as before."""

    def list_available_services(self, type_name):
        return ["s3"]


def _session() -> botocore.session.Session:
    session = botocore.session.get_session()
    # As botocore's own loader does: data_path (AWS_DATA_PATH) adds places to look for models.
    extra = session.get_config_variable("data_path")
    paths = [os.path.expanduser(os.path.expandvars(p)) for p in extra.split(os.pathsep)] if extra else []
    session.register_component("data_loader", _S3Models(extra_search_paths=paths))
    return session


class S3Store:
    def __init__(self, bucket: str, prefix: str = "", *, endpoint_url: str | None = None, jobs: int = 16,
                 endpoint_configured: bool = False):  # fmt: skip
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.jobs = max(1, jobs)
        self._bucket_known = False  # set once a 404 was checked against the bucket (see _missing)
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
            if not os.environ.get(name, "").isascii():  # signing encodes them: a bug exit on the first request
                raise ConfigError(name, "(not shown)", "holds characters a credential cannot have (non-ASCII)")
        max_attempts = _attempts("KCACHE_S3_MAX_ATTEMPTS", "6")
        connect_timeout = _seconds("KCACHE_S3_CONNECT_TIMEOUT", "5")
        read_timeout = _seconds("KCACHE_S3_READ_TIMEOUT", "60")
        try:
            session = _session()
            if endpoint_configured and session.get_config_variable("ignore_configured_endpoint_urls"):
                # The switch read as botocore reads it (the environment, then the profile); kcache
                # handing the variable's endpoint over made it an explicit one botocore never ignores.
                endpoint_url = None
            config = Config(
                max_pool_connections=self.jobs + 4,
                retries={"max_attempts": max_attempts, "mode": "adaptive"},
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                # No SHA-256 of every body for the signature (botocore signs bodies over plain http):
                # packs and manifests are named by their SHA-256 and checked on every read, refs are
                # signed by kcache when they must be trusted, and the CRC32 checksum botocore sends
                # still guards each transfer. It was 0.4 s of CPU per GiB published.
                s3={"payload_signing_enabled": False, **_addressing(session, endpoint_url)},
            )
            self.client = session.create_client("s3", region_name=_region(session), endpoint_url=endpoint_url,
                                                config=config)  # fmt: skip
            self._check_web_identity(session)
        except (BotoCoreError, ValueError) as exc:
            raise StoreError(self.url, f"cannot create an S3 client: {exc}") from None
        _bound_error_bodies(self.client)

    def _check_web_identity(self, session: botocore.session.Session) -> None:
        """With web identity credentials (EKS IRSA: AWS_ROLE_ARN and AWS_WEB_IDENTITY_TOKEN_FILE), that the
        token file can be opened. botocore reads it at the first request and lets open()'s OSError out,
        which said nothing of credentials (a bug exit); a pod without the token's mount, or whose user may
        not read it, gets a store error naming the setting. The credentials are the ones the client took
        (botocore keeps them on the session), so nothing is resolved twice."""
        credentials = session.get_credentials()
        if getattr(credentials, "method", None) != "assume-role-with-web-identity":
            return
        path = session.get_config_variable("web_identity_token_file")
        try:
            with open(path, "rb"):
                pass
        except (OSError, TypeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise StoreError(self.url, f"the web identity token file (AWS_WEB_IDENTITY_TOKEN_FILE) {path!r} "
                                       f"cannot be read: {why}; is the service account token mounted, and "
                                       "readable by this user?") from None  # fmt: skip

    def _key(self, key: str) -> str:
        if not is_valid_key(key):
            raise StoreError(self.url, f"invalid object key {key!r}")
        return f"{self.prefix}/{key}" if self.prefix else key

    def _error(self, exc: Exception, key: str, action: str) -> StoreError:
        """One kcache error for each way S3 says no."""
        if isinstance(exc, ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in _MISSING:
                return self._missing(key)
            if code == "NoSuchBucket":
                return StoreError(self.url, f"bucket {self.bucket!r} does not exist")
            # Before the 403s: S3 answers each of these with a 403 too, and "check the policy" sent an
            # operator whose node clock had drifted to IAM.
            if code == "RequestTimeTooSkewed":
                return StoreError(self.url, f"the server refused the request's time ({code}): this "
                                            "machine's clock is off by more than S3 allows (15 minutes); "
                                            "check its time sync")  # fmt: skip
            if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"):
                return StoreError(self.url, f"credentials rejected ({code})")
            if code in ("AccessDenied", "AllAccessDisabled", "403") or status == 403:
                return StoreError(
                    self.url, f"access denied while trying to {action} {key}: check credentials and policy"
                )
            return StoreError(self.url, f"cannot {action} {key}: {code or status} {exc}")
        if isinstance(exc, _UNPARSED):
            return StoreError(self.url, f"cannot {action} {key}: the server's answer does not parse "
                                        f"({one_line(exc, 200)})")  # fmt: skip
        if isinstance(exc, NoCredentialsError):
            return StoreError(self.url, "no AWS credentials found (env, ~/.aws, or instance role)")
        if isinstance(exc, EndpointConnectionError):
            return StoreError(self.url, f"endpoint unreachable: {exc.kwargs.get('endpoint_url', exc)}")
        if isinstance(exc, (ConnectTimeoutError, ReadTimeoutError)):
            return StoreError(self.url, f"timed out trying to {action} {key}")
        return StoreError(self.url, f"cannot {action} {key}: {exc}")

    def _missing(self, key: str) -> StoreError:
        """A 404: the object's, unless the bucket itself is missing. A HEAD's 404 has no body to say
        which, and a misspelt bucket must not read as "nothing published" (asked once a store)."""
        if not self._bucket_known:
            try:
                self.client.head_bucket(Bucket=self.bucket)
            except ClientError as exc:
                if str(exc.response.get("Error", {}).get("Code", "")) in ("NoSuchBucket", "404"):
                    return StoreError(self.url, f"bucket {self.bucket!r} does not exist")
            except _BROKEN:  # cannot tell: the object's 404 stands
                return ObjectMissing(self.url, key)
            self._bucket_known = True  # or not ours to list (403): either way the object is missing
        return ObjectMissing(self.url, key)

    # ---- writes --------------------------------------------------------------------------------

    def put_bytes(self, key: str, data: bytes) -> bool:
        return self._put_single(key, io.BytesIO(data))

    def put_file(self, key: str, path: Path) -> bool:
        size = Path(path).stat().st_size
        if size <= MULTIPART_THRESHOLD:
            with open(path, "rb") as body:
                return self._put_single(key, body)
        return self._put_multipart(key, Path(path), size)

    def _put_single(self, key: str, body: BinaryIO) -> bool:
        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=body, IfNoneMatch="*")
            return True
        except ClientError as exc:
            if _code(exc) in _EXISTS:
                return False
            raise self._error(exc, key, "write") from None
        except _BROKEN as exc:
            raise self._error(exc, key, "write") from None

    def _put_multipart(self, key: str, path: Path, size: int) -> bool:
        full = self._key(key)
        try:
            upload = self.client.create_multipart_upload(Bucket=self.bucket, Key=full).get("UploadId")
        except _FAILED as exc:
            raise self._error(exc, key, "write") from None
        if not isinstance(upload, str):  # S3 always sends one: no upload to send parts to, or to abort
            raise StoreError(self.url, f"cannot write {key}: the server's answer has no UploadId")

        def send(number: int) -> dict:
            offset = (number - 1) * PART_SIZE
            with open(path, "rb") as f:
                f.seek(offset)
                body = f.read(min(PART_SIZE, size - offset))
            etag = self.client.upload_part(Bucket=self.bucket, Key=full, UploadId=upload,
                                           PartNumber=number, Body=body).get("ETag")  # fmt: skip
            if not isinstance(etag, str):  # the completion names each part by it
                raise StoreError(self.url, f"cannot write {key}: the server's answer to part {number} has no ETag")
            return {"PartNumber": number, "ETag": etag}

        try:
            with ThreadPoolExecutor(max_workers=min(self.jobs, 8)) as pool:
                parts = list(pool.map(send, range(1, (size + PART_SIZE - 1) // PART_SIZE + 1)))
            self.client.complete_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload,
                                                  MultipartUpload={"Parts": parts}, IfNoneMatch="*")  # fmt: skip
            return True
        except ClientError as exc:
            self._abort(full, upload)
            if _code(exc) in _EXISTS:
                return False
            raise self._error(exc, key, "write") from None
        except _BROKEN as exc:
            self._abort(full, upload)
            raise self._error(exc, key, "write") from None
        except BaseException:  # the source unreadable, Ctrl-C, SIGTERM (Terminated): S3 bills the parts
            self._abort(full, upload)
            raise

    def _abort(self, full: str, upload: str) -> None:
        """Abort the upload, or log why not: the error that made us abort is the one to raise."""
        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload)
        except Exception as exc:  # the bucket's lifecycle rule (or gc's leftovers) cleans up after us
            log.warning("could not abort multipart upload of %s: %s", full, exc)

    # ---- reads ---------------------------------------------------------------------------------

    def get_bytes(self, key: str) -> bytes:
        return self._get_whole(key)[0]

    def _get_whole(self, key: str, limit: int | None = None) -> tuple[bytes, str]:
        """(content, ETag). A body cut part-way is resumed with ranged GETs of the same version.
        Over `limit` bytes: ObjectTooLarge, and the body is not read (its connection is closed)."""
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
        except _FAILED as exc:
            raise self._error(exc, key, "read") from None
        etag = response.get("ETag")
        try:
            size = self._length(response, key, "read")
            if limit is not None and size > limit:
                raise ObjectTooLarge("object", key, size, limit)
            if not isinstance(etag, str):  # the version a resume reads and a compare-and-swap writes at
                raise StoreError(self.url, f"cannot read {key}: the server's answer has no ETag")
        except (StoreError, ObjectTooLarge):  # the body is not read: its connection is closed
            response["Body"].close()
            raise
        first = Window(_BodyReader(response["Body"], self, key), size)
        # If-Match: a ref replaced between the cut and the resume must not be read half old, half new.
        with Resumable(first, lambda at, n: self._ranged(key, at, n, etag), 0, size, name=key) as body:
            data = read_exact(body, size, "object", key)
        return data, etag

    def open_range(self, key: str, offset: int, length: int) -> BinaryIO:
        if length == 0:
            return Window(io.BytesIO(b""), 0)
        return self._ranged(key, offset, length)

    def _ranged(self, key: str, offset: int, length: int, etag: str | None = None) -> BinaryIO:
        condition = {"IfMatch": etag} if etag else {}
        try:
            body = self.client.get_object(
                Bucket=self.bucket, Key=self._key(key), Range=f"bytes={offset}-{offset + length - 1}", **condition
            )["Body"]
        except _FAILED as exc:
            raise self._error(exc, key, "read") from None
        return Window(_BodyReader(body, self, key), length)

    def size(self, key: str) -> int:
        try:
            answer = self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except _FAILED as exc:
            raise self._error(exc, key, "stat") from None
        return self._length(answer, key, "stat")

    def _length(self, answer: dict, key: str, action: str) -> int:
        """The object's size from an answer's Content-Length, which S3 always sends; without one, or
        with one that is negative, the answer is no object's."""
        length = answer.get("ContentLength")
        if type(length) is not int or length < 0:
            raise StoreError(self.url, f"cannot {action} {key}: the server's answer has no valid Content-Length")
        return length

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
            return True
        except ObjectMissing:
            return False

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        full = self._key(prefix.rstrip("/")) + "/" if prefix else (self.prefix + "/" if self.prefix else "")
        strip = len(self.prefix) + 1 if self.prefix else 0
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
                for obj in page.get("Contents", []):
                    try:
                        key, size, modified = obj["Key"][strip:], int(obj["Size"]), obj["LastModified"]
                    except (KeyError, TypeError, ValueError):  # what botocore parsed is what was sent
                        raise StoreError(self.url, f"list {prefix}: an entry without a key, size or date: "
                                         f"{one_line(str(obj), 120)}") from None  # fmt: skip
                    if is_valid_key(key):  # what no key can name, no command reads or deletes
                        yield ObjectInfo(key, size, modified)
        except _FAILED as exc:
            raise self._error(exc, prefix, "list") from None

    def leftovers(self) -> Iterator[Leftover]:
        """Multipart uploads a killed publish never completed nor aborted: S3 bills their parts
        until they are aborted (or a bucket lifecycle rule does it). One that completes or is
        aborted while we look is skipped."""
        full = self.prefix + "/" if self.prefix else ""
        strip = len(full)
        try:
            for page in self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=full):
                for upload in page.get("Uploads", []):
                    if not _PACK_UPLOAD.match(upload["Key"][strip:]):  # only packs go up in parts; a store
                        continue  # at a bucket's root must leave other applications' uploads alone
                    try:
                        found = self._leftover(upload["Key"], upload["UploadId"], upload["Initiated"], strip)
                    except (KeyError, TypeError, ValueError):  # an entry without the fields S3 always sends
                        raise StoreError(self.url, f"list uploads: an entry without its id, date or sizes: "
                                         f"{one_line(str(upload), 120)}") from None  # fmt: skip
                    if found is not None:
                        yield found
        except _FAILED as exc:
            raise self._error(exc, "", "list uploads under") from None

    def _leftover(self, full: str, upload: str, initiated, strip: int) -> Leftover | None:
        """Dated by its newest part, not only by when it began: an upload still sending parts is a
        publish in flight (and some servers report no real start time: moto says 2010)."""
        try:
            parts = self.client.list_parts(Bucket=self.bucket, Key=full, UploadId=upload).get("Parts", [])
        except ClientError as exc:
            if _code(exc) == "NoSuchUpload":
                return None
            raise
        newest = max([initiated, *(part["LastModified"] for part in parts)])
        return Leftover(full[strip:], sum(int(part["Size"]) for part in parts), newest, upload)

    def remove_leftover(self, leftover: Leftover) -> None:
        if leftover.upload_id is None:
            return
        try:
            # Not through _key: the upload's name came from the bucket, whatever a writer named it.
            full = f"{self.prefix}/{leftover.key}" if self.prefix else leftover.key
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=leftover.upload_id)
        except ClientError as exc:
            if _code(exc) != "NoSuchUpload":  # completed or aborted meanwhile
                raise self._error(exc, leftover.key, "abort the upload of") from None
        except _BROKEN as exc:
            raise self._error(exc, leftover.key, "abort the upload of") from None

    def get_versioned(self, key: str, limit: int | None = None) -> tuple[bytes, str] | None:
        try:
            return self._get_whole(key, limit)
        except ObjectMissing:
            return None

    def put_if(self, key: str, data: bytes, version: str | None) -> bool:
        condition = {"IfMatch": version} if version else {"IfNoneMatch": "*"}
        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, **condition)
            return True
        except ClientError as exc:
            if _code(exc) in _EXISTS or _code(exc) in _MISSING:  # someone else moved (or removed) it
                return False
            raise self._error(exc, key, "write") from None
        except _BROKEN as exc:
            raise self._error(exc, key, "write") from None

    def now(self) -> datetime:
        """The S3 server's clock, which stamps LastModified: the Date of its answer to a one-key list
        (the request gc makes anyway, so a policy that lets gc list allows it). The host asking may
        be hours off it. Whole seconds, rounded down: an age measured by it is never too great."""
        full = self.prefix + "/" if self.prefix else ""
        try:
            answer = self.client.list_objects_v2(Bucket=self.bucket, Prefix=full, MaxKeys=1)
        except _FAILED as exc:
            raise self._error(exc, full, "list") from None
        date = answer.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        try:
            when = parsedate_to_datetime(date)
        except (TypeError, ValueError):  # no server stamping objects should lack one (RFC 9110 8.6.7)
            log.warning("%s sent no valid Date header (%s): using this host's clock to age its objects",
                        self.url, one_line(date, 60))  # fmt: skip
            return datetime.now(timezone.utc)
        return when if when.tzinfo else when.replace(tzinfo=timezone.utc)

    def delete(self, key: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key))
        except _FAILED as exc:
            error = self._error(exc, key, "delete")
            if not isinstance(error, ObjectMissing):
                raise error from None


class AnswerTooLarge(BotoCoreError):
    fmt = "the answer to {operation} is over {limit} bytes"


def _region(session: botocore.session.Session) -> str | None:
    """botocore's region (AWS_DEFAULT_REGION, the profile), else AWS_REGION: the variable the AWS CLI v2
    and every other AWS SDK read, and the one many manifests set alone. Without it requests were signed
    for us-east-1 and, on AWS, sent to the global endpoint."""
    return None if session.get_config_variable("region") else (os.environ.get("AWS_REGION", "").strip() or None)


def _addressing(session: botocore.session.Session, endpoint_url: str | None) -> dict[str, str]:
    """Path-style for an endpoint: it works with every S3-compatible server (MinIO, Ceph, moto) behind
    an IP. Unless the AWS config chose a style (`s3 = addressing_style = virtual`): some services answer
    only virtual-hosted requests, and a style set in the client's config wins over the file's."""
    chosen = (session.get_config_variable("s3") or {}).get("addressing_style")
    return {"addressing_style": "path"} if endpoint_url and not chosen else {}


def _bound_error_bodies(client) -> None:
    """Have `client` read at most ERROR_BODY_BYTES of an error answer's body, and refuse a successful
    answer it reads whole (not a streamed object) past WHOLE_BODY_BYTES; the rest is never read: the
    connection is closed. botocore has no setting for either: its 'before-send' hook may answer a
    request itself, so the hook sends it and hands botocore the answer with its body bounded."""
    session = getattr(getattr(client, "_endpoint", None), "http_session", None)
    if session is None:  # a botocore laid out otherwise: its own reading stands
        log.debug("cannot bound S3 error bodies: no http session on the client")
        return

    def send(request, **_kwargs):
        streamed = request.stream_output
        request.stream_output = True  # the body is read here, not by the session
        try:
            answer = session.send(request)
        finally:
            request.stream_output = streamed
        bounded = partial(AWSResponse, answer.url, answer.status_code, answer.headers)
        # Read here, under botocore's handling of what this hook raises: a body cut off or stalled
        # part-way is its ConnectionClosedError or ReadTimeoutError, retried as the session's own
        # reads are (urllib3's errors, read later by botocore, were bugs to kcache).
        if answer.status_code >= 300:
            return bounded(_Read(_read_bounded(answer.raw, ERROR_BODY_BYTES, request.url)))
        if not streamed:  # read now, as the session would have
            data = _read_bounded(answer.raw, WHOLE_BODY_BYTES + 1, request.url)
            if len(data) > WHOLE_BODY_BYTES:
                raise AnswerTooLarge(operation=request.method, limit=WHOLE_BODY_BYTES)
            return bounded(_Read(data))
        return answer

    client.meta.events.register_first("before-send.s3", send)


def _read_bounded(raw, limit: int, url: str) -> bytes:
    """At most `limit` bytes of an answer's body, its read errors as botocore's (see `send`)."""
    bounded = _Bounded(raw, limit)
    try:
        return b"".join(bounded.stream())
    except urllib3_errors.ReadTimeoutError as exc:
        bounded.close()
        raise ReadTimeoutError(endpoint_url=url, error=exc) from None
    except (urllib3_errors.HTTPError, OSError) as exc:  # ProtocolError: reset, cut short; SSLError
        bounded.close()
        raise ConnectionClosedError(endpoint_url=url, error=exc) from None


class _Read:
    """An answer's body, read already: what AWSResponse takes as its raw stream."""

    def __init__(self, data: bytes):
        self._data = data

    def stream(self, **_kwargs) -> Iterator[bytes]:
        yield self._data

    def read(self, *_args, **_kwargs) -> bytes:
        data, self._data = self._data, b""
        return data

    def close(self) -> None:
        self._data = b""


class _Bounded:
    """An answer's raw body of which at most `limit` bytes are ever read; then the connection is closed."""

    def __init__(self, raw, limit: int):
        self._raw, self._left = raw, limit

    def read(self, amt: int | None = None, **_kwargs) -> bytes:
        want = self._left if amt is None or amt < 0 else min(amt, self._left)
        data = self._raw.read(want) if want else b""
        self._left -= len(data)
        if not self._left:
            self._raw.close()
        return data

    def stream(self, amt: int = 2**16, **_kwargs) -> Iterator[bytes]:
        while data := self.read(amt):
            yield data

    def close(self) -> None:
        self._raw.close()


class _BodyReader:
    """A response body whose mid-stream failures (timeouts, cut connections) are kcache errors."""

    def __init__(self, body, store: S3Store, key: str):
        self._body, self._store, self._key = body, store, key

    def read(self, n: int = -1) -> bytes:
        try:
            return self._body.read(n)
        except (BotoCoreError, OSError) as exc:
            raise self._store._error(exc, self._key, "read") from None

    def close(self) -> None:
        self._body.close()


def _seconds(var: str, default: str) -> float:
    """A timeout from the environment: `60`, `60s`, `2m` (a typo is a ConfigError naming the variable)."""
    return durations.parse(os.environ.get(var) or default, var, bare_seconds=True, positive=True).total_seconds()


def _attempts(var: str, default: str) -> int:
    text = (os.environ.get(var) or default).strip()
    if not (text.isascii() and text.isdigit() and len(text) <= 3) or not 1 <= int(text) <= 100:
        raise ConfigError(var, text, "expected a whole number of attempts from 1 to 100")
    return int(text)


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))
