"""S3 specifics against a real HTTP endpoint: multipart, conditional writes, faults."""

import socket
import struct

import boto3
import pytest
from trees import read_tree, write_tree

from kcache import sources
from kcache.errors import ConfigError, ObjectMissing, StoreError
from kcache.publish import publish
from kcache.refs import RefCatalog
from kcache.restore import restore
from kcache.store import open_store, s3


def test_multipart_upload_is_create_if_absent(s3_store, tmp_path, monkeypatch):
    monkeypatch.setattr(s3, "MULTIPART_THRESHOLD", 6 * 1024 * 1024)
    monkeypatch.setattr(s3, "PART_SIZE", 5 * 1024 * 1024)  # S3's minimum part size
    big = tmp_path / "big"
    big.write_bytes(bytes(range(256)) * (48 * 1024))  # 12 MiB: three parts
    assert s3_store.put_file("packs/bb/big", big) is True
    assert s3_store.size("packs/bb/big") == big.stat().st_size
    with s3_store.open_range("packs/bb/big", 5 * 1024 * 1024 - 3, 6) as stream:
        assert stream.read() == big.read_bytes()[5 * 1024 * 1024 - 3 : 5 * 1024 * 1024 + 3]
    assert s3_store.put_file("packs/bb/big", big) is False


def test_publish_and_restore_through_s3(s3_store, sqlite_index, fp, tmp_path):
    files = {f"inductor/k/{i}.py": f"kernel {i}".encode() * 50 for i in range(300)}
    files["triton/abc/kernel.cubin"] = (b"\x7fELF" * 1000, 0o755)
    write_tree(tmp_path / "src", files)
    first = publish(s3_store, sqlite_index, fp, sources.select(), root=tmp_path / "src", env={})
    again = publish(s3_store, sqlite_index, fp, sources.select(), root=tmp_path / "src", env={})
    assert first.new_blobs == 301 and again.uploaded_bytes == 0
    result = restore(s3_store, sqlite_index, fp, tmp_path / "dst", jobs=8)
    assert result.status == "hit"
    assert read_tree(tmp_path / "dst/inductor") == read_tree(tmp_path / "src/inductor")
    assert read_tree(tmp_path / "dst/triton") == read_tree(tmp_path / "src/triton")


def test_missing_bucket_is_named(s3_endpoint):
    store = open_store("s3://no-such-bucket-here/x", endpoint_url=s3_endpoint)
    with pytest.raises(StoreError, match="does not exist"):
        store.put_bytes("packs/aa/x", b"x")


def test_missing_object(s3_store):
    with pytest.raises(ObjectMissing):
        s3_store.get_bytes("manifests/aa/nothing")


def test_endpoint_down_is_a_clear_error(monkeypatch):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("KCACHE_S3_CONNECT_TIMEOUT", "1")
    monkeypatch.setenv("KCACHE_S3_MAX_ATTEMPTS", "1")
    store = open_store("s3://bucket/p", endpoint_url=f"http://127.0.0.1:{port}")
    with pytest.raises(StoreError, match="unreachable"):
        store.get_bytes("manifests/aa/x")


def test_prefixes_keep_stores_apart(s3_bucket):
    url, endpoint = s3_bucket
    a = open_store(url + "/a", endpoint_url=endpoint)
    b = open_store(url + "/b", endpoint_url=endpoint)
    a.put_bytes("packs/aa/1", b"a")
    assert [o.key for o in a.list("packs/")] == ["packs/aa/1"] and list(b.list("packs/")) == []
    raw = boto3.client("s3", endpoint_url=endpoint)
    keys = [o["Key"] for o in raw.list_objects_v2(Bucket=url.split("/")[2])["Contents"]]
    assert keys == ["cache/a/packs/aa/1"]


def _publish_cli(tmp_path, url, endpoint):
    import json

    from click.testing import CliRunner

    from kcache.cli import main

    write_tree(tmp_path / "src", {f"inductor/{i}": f"content {i}".encode() * 100 for i in range(20)})
    args = ["--store", url, "--s3-endpoint-url", endpoint, "--index", f"sqlite:///{tmp_path / 'i.db'}", "--model", "m"]
    out = CliRunner().invoke(
        main, ["publish", "--from", str(tmp_path / "src"), *args, "--json"], catch_exceptions=False
    )
    return json.loads(out.output), args


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_damaged_pack_in_bucket_fails_open_without_partial_cache(tmp_path, s3_bucket, damage):
    from click.testing import CliRunner

    from kcache.cli import main

    url, endpoint = s3_bucket
    published, args = _publish_cli(tmp_path, url, endpoint)
    store = open_store(url, endpoint_url=endpoint)
    (pack,) = list(store.list("packs/"))
    raw = boto3.client("s3", endpoint_url=endpoint)
    bucket, key = url.split("/")[2], f"cache/{pack.key}"
    if damage == "missing":
        raw.delete_object(Bucket=bucket, Key=key)
    else:
        body = raw.get_object(Bucket=bucket, Key=key)["Body"].read()
        raw.put_object(Bucket=bucket, Key=key, Body=body[:40])  # cut inside the blob frames
    write_tree(tmp_path / "dst", {"inductor/old": b"previous"})
    result = CliRunner().invoke(main, ["restore", "--into", str(tmp_path / "dst"), *args], catch_exceptions=False)
    assert result.exit_code == 0 and "restore failed, starting cold" in result.stderr
    assert "Traceback" not in result.output
    assert read_tree(tmp_path / "dst/inductor") == {"old": (b"previous", 0o644)}
    strict = CliRunner().invoke(main, ["restore", "--into", str(tmp_path / "dst"), "--strict", *args])
    assert strict.exit_code in (4, 6)


@pytest.mark.parametrize("var, value", [
    ("KCACHE_S3_READ_TIMEOUT", "abc"), ("KCACHE_S3_READ_TIMEOUT", "nan"), ("KCACHE_S3_CONNECT_TIMEOUT", "-1"),
    ("KCACHE_S3_CONNECT_TIMEOUT", "0"), ("KCACHE_S3_MAX_ATTEMPTS", "many"), ("KCACHE_S3_MAX_ATTEMPTS", "0"),
    ("KCACHE_S3_MAX_ATTEMPTS", "2.5"), ("KCACHE_S3_MAX_ATTEMPTS", "²"),
])  # fmt: skip
def test_a_bad_s3_setting_is_a_config_error_naming_it(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=var):
        open_store("s3://bucket/prefix", endpoint_url="http://127.0.0.1:1")


@pytest.mark.parametrize("var, value", [("KCACHE_S3_READ_TIMEOUT", "5s"), ("KCACHE_S3_READ_TIMEOUT", "2.5"),
                                        ("KCACHE_S3_MAX_ATTEMPTS", "3")])  # fmt: skip
def test_good_s3_settings_are_taken(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    open_store("s3://bucket/prefix", endpoint_url="http://127.0.0.1:1")


def test_bodies_go_unsigned_with_a_crc32_checksum(s3_store, tmp_path):
    """Over plain http botocore would hash every body for the signature (0.4 s of CPU per GiB
    published). Packs and manifests are checked by their SHA-256 on every read instead; the CRC32
    checksum still guards each transfer, and the server checks it."""
    sent = []
    s3_store.client.meta.events.register(
        "before-send.s3.*", lambda request, **_kw: sent.append((request.method, dict(request.headers))))
    (tmp_path / "pack").write_bytes(b"packed bytes" * 100)
    s3_store.put_file("packs/aa/one", tmp_path / "pack")
    s3_store.put_bytes("manifests/aa/two", b"{}")
    puts = [headers for method, headers in sent if method == "PUT"]
    assert len(puts) == 2
    for headers in puts:
        assert headers["X-Amz-Content-SHA256"] in (b"UNSIGNED-PAYLOAD", "UNSIGNED-PAYLOAD")
        assert "x-amz-checksum-crc32" in {k.lower() for k in headers}


def test_a_missing_bucket_is_named_for_reads_whose_404_has_no_body(s3_endpoint, fp, tmp_path):
    """A HEAD answers a bare 404 for a missing bucket as for a missing object: a restore through
    refs/ into a misspelt bucket must say so, not report a miss as if nothing had been published."""
    store = open_store("s3://no-such-bucket-here/x", endpoint_url=s3_endpoint)
    with pytest.raises(StoreError, match="does not exist"):
        store.size("refs/aa")
    with pytest.raises(StoreError, match="does not exist"):
        restore(store, RefCatalog(store), fp, tmp_path / "dst")


def test_a_missing_object_in_an_existing_bucket_is_still_missing(s3_store):
    with pytest.raises(ObjectMissing):
        s3_store.size("refs/aa")
    with pytest.raises(ObjectMissing):
        s3_store.size("refs/bb")


@pytest.fixture
def fake_credentials(monkeypatch):
    """Credentials for a client of a hostile server, which checks none."""
    for var, value in (("AWS_ACCESS_KEY_ID", "x"), ("AWS_SECRET_ACCESS_KEY", "y"), ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(var, value)


ERROR_BODY = 48 * 1024 * 1024  # an endless one, as far as a test needs: far past any bound


def _huge_error(chunked: bool):
    """An error answer with a body of ERROR_BODY bytes (chunked: no length to refuse up front),
    streamed until the reader hangs up."""

    def route(server, conn, request):
        framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {ERROR_BODY}"
        server.send(conn, f"HTTP/1.1 403 Forbidden\r\nContent-Type: application/xml\r\n{framing}\r\n\r\n".encode())
        piece = b"<Error><Code>AccessDenied</Code><Message>" + b"A" * (65536 - 41)
        for _ in range(ERROR_BODY // len(piece)):
            server.send(conn, b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
        server.send(conn, b"0\r\n\r\n" if chunked else b"")

    return route


@pytest.mark.parametrize("chunked", [False, True])
def test_an_error_answer_is_read_no_further_than_its_bound(fake_credentials, chunked):
    """A hostile endpoint (plain http) answers a pack read with an endless error body: botocore would
    read all of it into memory, which would kill an init container with a memory limit."""
    from hostile_http import HostileServer

    key = "packs/ab/" + "ab" * 32
    with HostileServer({f"GET /bucket/{key}": _huge_error(chunked)}) as server:
        store = open_store("s3://bucket", endpoint_url=server.url)
        with pytest.raises(StoreError, match="access denied"):
            store.open_range(key, 0, 100)
        # The bound, and what the sockets' buffers held when the reader hung up.
        assert server.sent < 16 * 1024 * 1024


def _small_head(server, conn, request):
    server.send(conn, b'HTTP/1.1 200 OK\r\nContent-Length: 200\r\nETag: "e"\r\n\r\n')


def test_a_ref_whose_read_is_far_longer_than_its_head_said_is_refused_unread(fake_credentials):
    """A hostile endpoint answers a ref's HEAD with 200 bytes and its GET with 2 GB: moving the ref
    (publish, gc, refresh, yank: a watch sidecar in the pod does it) must not hold the 2 GB."""
    from hostile_http import HostileServer, huge_body

    from kcache import refs
    from kcache.errors import ObjectTooLarge

    bundle_key = "ab" * 16
    key = refs.ref_key(bundle_key)
    deleted = lambda server, conn, request: server.send(conn, b"HTTP/1.1 204 No Content\r\n\r\n")  # noqa: E731
    routes = {f"HEAD /bucket/{key}": _small_head, f"GET /bucket/{key}": huge_body, f"DELETE /bucket/{key}": deleted}
    with HostileServer(routes) as server:
        store = open_store("s3://bucket", endpoint_url=server.url)
        with pytest.raises(ObjectTooLarge):
            store.get_versioned(key, limit=refs.limits.REF_BYTES)
        assert refs._load(store, key, bundle_key) == (None, None)  # refused, removed, started over
        assert ("DELETE", f"/bucket/{key}") in server.requests
        assert server.sent < 64 * 1024 * 1024


class _ByPath(dict):
    """Routes found by path alone: a list request's query string (prefix, token) varies."""

    def get(self, key, default=None):
        return super().get(key.split("?")[0], default)


@pytest.mark.parametrize("route", ["huge_body", "endless_chunks"])
def test_a_list_page_is_read_no_further_than_its_bound(fake_credentials, route):
    """A hostile endpoint answers a listing (gc, verify, reindex, prefetch of a node's models) with a
    200 whose body never ends: botocore reads a successful answer that it does not stream whole, so
    the command would hold all of it in memory."""
    import hostile_http

    with hostile_http.HostileServer({}) as server:
        server.routes = _ByPath({"GET /bucket": getattr(hostile_http, route)})
        store = open_store("s3://bucket", endpoint_url=server.url)
        with pytest.raises(StoreError, match="over .* bytes"):
            list(store.list("packs"))
        assert server.requests == [("GET", server.requests[0][1])]  # refused, not retried
        assert server.sent < 64 * 1024 * 1024


def _reset_after(status: str, head: bytes):
    """An answer that promises 4000 bytes, sends `head` of them, then resets the connection."""

    def route(server, conn, request):
        server.send(conn, f"HTTP/1.1 {status}\r\nContent-Type: application/xml\r\nContent-Length: 4000\r\n\r\n".encode()
                    + head)  # fmt: skip
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close() sends RST

    return route


LIST_HEAD = b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><Name>bucket</Name>'


@pytest.mark.parametrize("status, head", [("503 Slow Down", b"<Error><Code>SlowDown</Code>"),
                                          ("200 OK", LIST_HEAD)], ids=["error-answer", "list-page"])  # fmt: skip
def test_a_body_cut_off_mid_answer_is_a_store_error(fake_credentials, monkeypatch, status, head):
    """The bounded read of an error answer or a list page ran outside botocore's own error handling:
    a reset mid-body came out as urllib3's ProtocolError, a bug exit (70) for verify, gc and restore."""
    import hostile_http

    monkeypatch.setenv("KCACHE_S3_MAX_ATTEMPTS", "2")
    with hostile_http.HostileServer({}) as server:
        server.routes = _ByPath({"GET /bucket": _reset_after(status, head)})
        store = open_store("s3://bucket", endpoint_url=server.url)
        with pytest.raises(StoreError):
            list(store.list("packs"))
        assert len(server.requests) > 1  # retried, as botocore retries a cut connection


def test_a_list_entry_without_its_size_or_date_is_a_store_error(fake_credentials):
    import hostile_http

    key = "packs/ab/" + "ab" * 32
    page = (LIST_HEAD + b"<Prefix>packs/</Prefix><KeyCount>1</KeyCount><MaxKeys>1000</MaxKeys>"
            b"<IsTruncated>false</IsTruncated><Contents><Key>" + key.encode() + b"</Key></Contents></ListBucketResult>")

    def route(server, conn, request):
        server.send(conn, b"HTTP/1.1 200 OK\r\nContent-Type: application/xml\r\nContent-Length: %d\r\n\r\n%s"
                    % (len(page), page))  # fmt: skip

    with hostile_http.HostileServer({}) as server:
        server.routes = _ByPath({"GET /bucket": route})
        store = open_store("s3://bucket", endpoint_url=server.url)
        with pytest.raises(StoreError, match="list"):
            list(store.list("packs"))


def test_credentials_a_signature_cannot_encode_are_a_config_error(fake_credentials, monkeypatch):
    """Signing encoded the secret on the first request: a byte no encoding names was UnicodeEncodeError, exit 70."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s\udcff")
    with pytest.raises(ConfigError, match="AWS_SECRET_ACCESS_KEY"):
        open_store("s3://bucket", endpoint_url="http://127.0.0.1:1")


def test_models_from_aws_data_path_still_come_first(s3_bucket, tmp_path, monkeypatch):
    """kcache's loader skips botocore's listing of every service, not the places AWS_DATA_PATH adds."""
    import json

    import botocore.loaders

    model = botocore.loaders.Loader().load_service_model("s3", "service-2")
    del model["operations"]["DeleteBucket"]
    (tmp_path / "models/s3/2006-03-01").mkdir(parents=True)
    (tmp_path / "models/s3/2006-03-01/service-2.json").write_text(json.dumps(model))
    url, endpoint = s3_bucket
    assert hasattr(open_store(url, endpoint_url=endpoint).client, "delete_bucket")
    monkeypatch.setenv("AWS_DATA_PATH", str(tmp_path / "models"))
    store = open_store(url, endpoint_url=endpoint)
    assert not hasattr(store.client, "delete_bucket")
    store.put_bytes("packs/aa/x", b"x")  # the rest of the model, and its endpoint rules, still work
    assert store.get_bytes("packs/aa/x") == b"x"


def test_a_virtual_hosted_endpoint_chosen_in_the_aws_config_is_used(s3_bucket, sqlite_index, fp, tmp_path,
                                                                     monkeypatch):  # fmt: skip
    """Some S3-compatible services answer virtual-hosted requests only (`<bucket>.<endpoint>`), and the
    AWS config file (`s3 = addressing_style = virtual`) is botocore's place to say so; with an endpoint
    given, kcache had forced path-style over it, and every request of such a pod was refused."""
    from urllib.parse import urlsplit

    from forward_proxy import ForwardProxy

    url, endpoint = s3_bucket
    bucket, port = url.removeprefix("s3://").split("/")[0], urlsplit(endpoint).port
    write_tree(tmp_path / "src", {"inductor/fxgraph/g": b"graph"})
    published = publish(open_store(url, endpoint_url=endpoint), sqlite_index, fp, sources.select(),
                        root=tmp_path / "src", env={})  # fmt: skip
    (tmp_path / "aws-config").write_text("[default]\ns3 =\n    addressing_style = virtual\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))
    for var in ("NO_PROXY", "no_proxy", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(var, raising=False)
    with ForwardProxy(("127.0.0.1", port)) as proxy:  # <bucket>.localhost resolves nowhere here
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        store = open_store(url, endpoint_url=f"http://localhost:{port}")
        result = restore(store, RefCatalog(store), fp, tmp_path / "dst")
    assert result.status == "hit" and result.bundle_id == published.bundle_id
    assert proxy.hosts and set(proxy.hosts) == {f"{bucket}.localhost:{port}"}


def _s3_error(code: str, message: str):
    """Every request answered as S3 refuses it: 403 with the error's XML (a HEAD's has no body)."""

    def route(server, conn, request):
        body = b"" if request.method == "HEAD" else (
            f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>{message}</Message>"
            "<RequestId>r</RequestId></Error>").encode()  # fmt: skip
        server.send(conn, b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/xml\r\nContent-Length: %d\r\n"
                          b"Connection: close\r\n\r\n%s" % (len(body), body))  # fmt: skip

    return route


class _Everything(dict):
    def get(self, key, default=None):
        return self["*"]


@pytest.mark.parametrize("code, message, said", [
    ("RequestTimeTooSkewed", "The difference between the request time and the current time is too large.", "clock"),
    ("InvalidAccessKeyId", "The AWS Access Key Id you provided does not exist in our records.", "credentials rejected"),
    ("SignatureDoesNotMatch", "The request signature we calculated does not match the signature you provided.",
     "credentials rejected"),
])  # fmt: skip
def test_a_refusal_that_is_not_about_the_policy_says_what_it_is_about(fake_credentials, code, message, said):
    """S3 answers a pod whose clock is more than 15 minutes off, and credentials it does not know, with a
    403 as it answers a policy that denies: every one of them read "access denied ... check credentials
    and policy", so an operator whose node clock had drifted went looking at IAM."""
    from hostile_http import HostileServer

    with HostileServer({}) as server:
        server.routes = _Everything({"*": _s3_error(code, message)})
        store = open_store("s3://bucket", endpoint_url=server.url)
        with pytest.raises(StoreError) as refused:
            store.get_bytes("refs/" + "ab" * 16)
    assert said in str(refused.value) and "access denied" not in str(refused.value)


@pytest.mark.parametrize("default_region, region, signed_for", [
    (None, "eu-west-3", "eu-west-3"),  # AWS_REGION alone: what the AWS CLI v2 and the other SDKs read
    ("ap-south-1", "eu-west-3", "ap-south-1"),  # botocore's own variable still wins where it is set
])  # fmt: skip
def test_requests_are_signed_for_the_region_the_pod_names(s3_bucket, monkeypatch, default_region, region,
                                                          signed_for):  # fmt: skip
    """A pod given AWS_REGION alone (many manifests set only it; botocore reads AWS_DEFAULT_REGION) had
    its requests signed for us-east-1: an endpoint that checks the region (MinIO or Ceph with one set)
    refused every one, and on AWS they went to the global endpoint, out of reach from a VPC whose
    only way to S3 is its region's endpoint."""
    url, endpoint = s3_bucket
    monkeypatch.delenv("AWS_DEFAULT_REGION")
    if default_region:
        monkeypatch.setenv("AWS_DEFAULT_REGION", default_region)
    monkeypatch.setenv("AWS_REGION", region)
    store = open_store(url, endpoint_url=endpoint)
    scopes = []
    store.client.meta.events.register(
        "before-send.s3.*", lambda request, **_kw: scopes.append(str(request.headers["Authorization"])))
    store.put_bytes("packs/aa/x", b"x")
    assert store.get_bytes("packs/aa/x") == b"x"
    assert scopes and all(f"/{signed_for}/s3/aws4_request" in scope for scope in scopes)


_PACK = "packs/ab/" + "ab" * 32
_REF = "refs/" + "ab" * 16


def _raw(head: bytes, body: bytes = b""):
    """Every request answered with `head` (status line and headers, without the blank line) and `body`."""
    return lambda server, conn, request: server.send(conn, head + b"\r\nConnection: close\r\n\r\n" + body)


@pytest.mark.parametrize("answer, call", [
    (_raw(b"HTTP/1.1 200 OK\r\nContent-Length: many\r\nETag: \"e\""), lambda store: store.size(_PACK)),
    (_raw(b"HTTP/1.1 200 OK\r\nETag: \"e\""), lambda store: store.size(_PACK)),  # no Content-Length
    (_raw(b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\nETag: \"e\""), lambda store: store.size(_PACK)),
    (_raw(b"HTTP/1.1 200 OK\r\nContent-Length: 2", b"{}"), lambda store: store.get_versioned(_REF, 1024)),  # no ETag
    (_raw(b"HTTP/1.1 200 OK\r\nETag: \"e\"\r\nTransfer-Encoding: chunked", b"2\r\n{}\r\n0\r\n\r\n"),
     lambda store: store.get_versioned(_REF, 1024)),  # no Content-Length
    (_raw(b"HTTP/1.1 206 Partial Content\r\nContent-Length: 5\r\nLast-Modified: yesterday\r\nETag: \"e\"", b"hello"),
     lambda store: store.open_range(_PACK, 0, 5)),
    (_raw(b"HTTP/1.1 206 Partial Content\r\nContent-Length: 5", b"hello"), lambda store: list(store.list("packs"))),
], ids=["length-not-a-number", "no-length", "negative-length", "ref-without-etag", "ref-without-length",
        "date-not-a-date", "list-page-not-xml"])  # fmt: skip
def test_an_answer_that_does_not_parse_is_a_store_error(fake_credentials, monkeypatch, answer, call):
    """A hostile endpoint (plain http on the path) or a broken S3-compatible server answers with a header
    botocore cannot parse, or without the Content-Length or ETag S3 always sends: botocore's ValueError,
    its ResponseParserError and a KeyError came out of the store, and every caller that handles a store's
    failure (the prefetch DaemonSet's round, a --fallback layers donor, gc, verify) took them for a bug
    in kcache: exit 70, and a DaemonSet that crash-looped instead of trying the next round."""
    from hostile_http import HostileServer

    monkeypatch.setenv("KCACHE_S3_MAX_ATTEMPTS", "1")
    with HostileServer({}) as server:
        server.routes = _Everything({"*": answer})
        store = open_store("s3://bucket", endpoint_url=server.url)
        with pytest.raises(StoreError):
            call(store)


def test_a_prefetch_round_whose_ref_answer_has_no_etag_is_a_store_error(fake_credentials, isolated_home, tmp_path,
                                                                         monkeypatch):  # fmt: skip
    """The prefetch DaemonSet keeps going after a round that failed with a store error; a KeyError out of
    the store ended the process as a bug in kcache (exit 70), so the node's pods lost their node cache
    for as long as the endpoint (or whoever is on its plain-http path) answered so."""
    from click.testing import CliRunner
    from hostile_http import HostileServer

    from kcache.cli import main
    from kcache.cli.errors import ExitCode

    monkeypatch.setenv("KCACHE_S3_MAX_ATTEMPTS", "1")
    with HostileServer({}) as server:
        server.routes = _Everything({"*": _raw(b"HTTP/1.1 200 OK\r\nContent-Length: 2", b"{}")})
        out = CliRunner().invoke(main, ["prefetch", "--once", "--bundle-key", "ab" * 16, "--store", "s3://bucket",
                                        "--s3-endpoint-url", server.url, "--index", "none",
                                        "--node-cache", str(tmp_path / "node")])  # fmt: skip
    assert out.exit_code == ExitCode.STORE, out.output
    assert "has no ETag" in out.output


def _multipart(upload_id: bytes | None):
    """A server that starts an upload (naming `upload_id`, or none) and answers each part without an ETag."""

    def route(server, conn, request):
        if request.method == "POST" and request.path.endswith("?uploads"):
            named = b"<UploadId>" + upload_id + b"</UploadId>" if upload_id else b""
            body = b"<InitiateMultipartUploadResult><Key>k</Key>%s</InitiateMultipartUploadResult>" % named
            return server.send(conn, b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                               % (len(body), body))  # fmt: skip
        return server.send(conn, b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    return route


@pytest.mark.parametrize("upload_id", [None, b"u1"], ids=["start-without-upload-id", "part-without-etag"])
def test_a_multipart_answer_without_upload_id_or_etag_is_a_store_error(fake_credentials, monkeypatch, tmp_path,
                                                                       upload_id):  # fmt: skip
    """A pack over the multipart threshold went up with the server's UploadId and each part's ETag read as
    S3 always sends them: a server that left one out raised a KeyError out of the store, and publish exited
    70 with a bug hint where every other answer without the ETag S3 sends is a store error."""
    from hostile_http import HostileServer

    monkeypatch.setenv("KCACHE_S3_MAX_ATTEMPTS", "1")
    monkeypatch.setattr(s3, "MULTIPART_THRESHOLD", 4)
    pack = tmp_path / "pack"
    pack.write_bytes(b"0123456789")
    with HostileServer({}) as server:
        server.routes = _Everything({"*": _multipart(upload_id)})
        store = open_store("s3://bucket", endpoint_url=server.url)
        with pytest.raises(StoreError):
            store.put_file(_PACK, pack)


# ---- AWS_IGNORE_CONFIGURED_ENDPOINT_URLS, as every AWS SDK reads it -----------------------------------


def _restore_through_env_endpoint(tmp_path, monkeypatch, url, endpoint, ignore):
    import json

    from click.testing import CliRunner

    from kcache.cli import main

    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:1")  # AWS's own endpoint (https) is refused at once
    monkeypatch.setenv("KCACHE_S3_MAX_ATTEMPTS", "1")
    if ignore is not None:
        monkeypatch.setenv("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", ignore)
    args = ["restore", "--into", str(tmp_path / f"r-{ignore}"), "--store", url, "--index", "none", "--model", "m",
            "--timeout", "30", "--json"]  # fmt: skip
    return json.loads(CliRunner().invoke(main, args, catch_exceptions=False).stdout)


@pytest.mark.parametrize("ignore", ["true", "TRUE"])
def test_ignoring_configured_endpoints_leaves_aws_endpoint_url_unused(tmp_path, s3_bucket, monkeypatch, ignore):
    # The SDKs' setting: endpoints from the environment and the config file are not used (only one the
    # command line names explicitly). kcache read AWS_ENDPOINT_URL itself and handed it to boto3 as
    # an explicit endpoint, so the setting never applied.
    url, endpoint = s3_bucket
    _publish_cli(tmp_path, url, endpoint)
    assert _restore_through_env_endpoint(tmp_path, monkeypatch, url, endpoint, None)["status"] == "hit"
    doc = _restore_through_env_endpoint(tmp_path, monkeypatch, url, endpoint, ignore)
    assert doc["status"] == "error" and endpoint not in doc["error"], doc


@pytest.mark.parametrize("ignore", ["false", "", "1"])
def test_endpoints_are_used_unless_ignoring_them_is_true(tmp_path, s3_bucket, monkeypatch, ignore):
    url, endpoint = s3_bucket
    _publish_cli(tmp_path, url, endpoint)
    assert _restore_through_env_endpoint(tmp_path, monkeypatch, url, endpoint, ignore)["status"] == "hit"


def test_an_explicit_s3_endpoint_url_is_used_though_configured_ones_are_ignored(tmp_path, s3_bucket, monkeypatch):
    url, endpoint = s3_bucket
    monkeypatch.setenv("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "true")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:1")
    published, _args = _publish_cli(tmp_path, url, endpoint)  # --s3-endpoint-url on the command line
    assert published["files"] == 20


def test_the_config_files_ignore_setting_leaves_aws_endpoint_url_unused(tmp_path, s3_bucket, monkeypatch):
    # The switch may come from the profile too (ignore_configured_endpoint_urls = true), and then
    # covers the environment's endpoints as well.
    url, endpoint = s3_bucket
    _publish_cli(tmp_path, url, endpoint)
    (tmp_path / "aws-config").write_text("[default]\nignore_configured_endpoint_urls = true\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))
    doc = _restore_through_env_endpoint(tmp_path, monkeypatch, url, endpoint, None)
    assert doc["status"] == "error" and endpoint not in doc["error"], doc


@pytest.mark.parametrize("token", ["missing", "directory"])
def test_a_web_identity_token_file_that_cannot_be_read_is_a_store_error(tmp_path, s3_bucket, monkeypatch, token):
    # EKS IRSA: botocore reads the projected token on the first request and let open()'s OSError out,
    # a bug exit (70) naming a path and nothing else; a pod without the mount, or whose user may not
    # read it, gets a store error that names the variable.
    url, endpoint = s3_bucket
    path = tmp_path / "token"
    if token == "directory":
        path.mkdir()
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ROLE_ARN", "arn:aws:iam::123456789012:role/kcache")
    monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(path))
    with pytest.raises(StoreError, match="AWS_WEB_IDENTITY_TOKEN_FILE"):
        open_store(url, endpoint_url=endpoint).get_bytes("kcache-store.json")
