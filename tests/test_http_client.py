"""kcache.http_client: URLs checked before any request, the request target sent as written, and one
deadline that covers name resolution too. Real servers on 127.0.0.1 (and 'localhost' from /etc/hosts)."""

import datetime
import gc
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kcache import http_client
from kcache.errors import ConfigError


class Recorder:
    """Answers every GET 200 and records (path, Host header); `server_name` holds a TLS client's SNI."""

    def __init__(self, tls: ssl.SSLContext | None = None):
        self.seen: list[tuple[str, str]] = []
        self.server_names: list[str | None] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                owner.seen.append((self.path, self.headers.get("Host")))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls is not None:
            tls.sni_callback = lambda _sock, name, _ctx: self.server_names.append(name)
            self._server.socket = tls.wrap_socket(self._server.socket, server_side=True)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


@pytest.mark.parametrize("bad", ["http://[::1/health", "http://[::1:8000", "http://a..b:8000/health",
                                 "http://" + "x" * 64 + ".example/health"])  # fmt: skip
def test_a_malformed_url_is_a_config_error_not_a_crash(bad):
    with pytest.raises(ConfigError) as caught:
        http_client.split_url(bad)
    assert caught.value.what == "--url"


def test_split_url_keeps_its_prefix_semantics_for_warmup():
    assert http_client.split_url("http://127.0.0.1:8000/v1/?x=1") == ("http", "127.0.0.1", 8000, "/v1")
    assert http_client.split_url("http://[::1]:8000") == ("http", "::1", 8000, "")


@pytest.mark.parametrize("path", ["/v2/health/ready/", "/status?format=json", "/", "/h?a=1&b=%2F"])
def test_the_request_target_is_sent_as_written(path):
    with Recorder() as server:
        answer = http_client.request("GET", f"http://127.0.0.1:{server.port}{path}", timeout=5, max_body=1024)
    assert answer.status == 200 and server.seen == [(path, f"127.0.0.1:{server.port}")]


def test_a_url_without_a_path_asks_for_the_root():
    with Recorder() as server:
        http_client.request("GET", f"http://127.0.0.1:{server.port}", timeout=5, max_body=1024)
        http_client.request("GET", f"http://127.0.0.1:{server.port}?q=1#frag", timeout=5, max_body=1024)
    assert [path for path, _ in server.seen] == ["/", "/?q=1"]


def test_a_value_http_client_refuses_is_a_failed_request_not_a_crash():
    with Recorder() as server, pytest.raises(http_client.RequestFailed) as caught:
        http_client.request("GET", f"http://127.0.0.1:{server.port}/", timeout=5, max_body=1024,
                            headers={"X-Bad": "a\nb"})  # fmt: skip
    assert not caught.value.transient and "ValueError" in caught.value.why and server.seen == []


def test_a_host_name_is_resolved_and_sent_as_the_host_header():
    with Recorder() as server:  # localhost may resolve to ::1 first: the client tries each address
        answer = http_client.request("GET", f"http://localhost:{server.port}/health", timeout=5, max_body=1024)
    assert answer.status == 200 and server.seen == [("/health", f"localhost:{server.port}")]


def test_name_resolution_counts_against_the_deadline(monkeypatch):
    release, asked = threading.Event(), threading.Event()
    resolve = socket.getaddrinfo

    def slow_resolver(host, *args, **kwargs):
        if host == "slow.example":
            asked.set()
            release.wait(10)  # a resolver that does not answer (released at teardown; 10 s: a bound, no more)
        return resolve(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", slow_resolver)
    started = time.monotonic()
    try:
        with pytest.raises(http_client.RequestFailed) as caught:
            http_client.request("GET", "http://slow.example:8000/health", timeout=0.3, max_body=1024)
        took = time.monotonic() - started
    finally:
        release.set()
    assert asked.is_set() and took < 2.0
    assert caught.value.timed_out and caught.value.transient
    assert caught.value.why == "no complete answer within 0.3 s (resolving slow.example did not finish)"


def test_a_name_that_does_not_resolve_is_a_transient_failure(monkeypatch):
    def no_such_host(host, *args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_such_host)
    with pytest.raises(http_client.RequestFailed) as caught:
        http_client.request("GET", "http://nowhere.example:8000/health", timeout=5, max_body=1024)
    assert caught.value.transient and not caught.value.timed_out and "gaierror" in caught.value.why


def _self_signed(tmp_path):
    """A certificate for 'localhost' and its key, as PEM files."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))  # fmt: skip
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))  # fmt: skip
    return cert_file, key_file


def test_https_to_a_resolved_name_verifies_and_sends_that_name(tmp_path, monkeypatch):
    cert_file, key_file = _self_signed(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert_file))  # the client's default context trusts it
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert_file, key_file)
    with Recorder(tls) as server:
        answer = http_client.request("GET", f"https://localhost:{server.port}/health", timeout=5, max_body=1024)
        with pytest.raises(http_client.RequestFailed) as wrong_name:  # the certificate names localhost only
            http_client.request("GET", f"https://127.0.0.1:{server.port}/health", timeout=5, max_body=1024)
    assert answer.status == 200 and server.seen == [("/health", f"localhost:{server.port}")]
    assert server.server_names[0] == "localhost" and "CERTIFICATE_VERIFY_FAILED" in wrong_name.value.why


def _answer_once(head: str) -> tuple[socket.socket, threading.Thread]:
    listener = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(head.encode() + b"ok")

    worker = threading.Thread(target=answer, daemon=True)
    worker.start()
    return listener, worker


@pytest.mark.parametrize("declared", ["9" * 5000, "\u00b2"], ids=["past-int-digits", "superscript"])
def test_a_content_length_int_cannot_read_is_no_crash(declared):
    """An engine's Content-Length passed isdigit() and then could make int() raise: 5000 digits (past
    Python's 4300) crashed the request with ValueError. Digits that many are over any cap; what is no
    ASCII number is no declared length, and the answer is read up to the cap."""
    listener, worker = _answer_once(f"HTTP/1.1 200 OK\r\nContent-Length: {declared}\r\nConnection: close\r\n\r\n")
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/"
    try:
        if declared.isascii():
            with pytest.raises(http_client.RequestFailed, match="over the 1024-byte limit"):
                http_client.request("GET", url, timeout=10, max_body=1024)
        else:
            got = http_client.request("GET", url, timeout=10, max_body=1024)
            assert (got.status, got.body) == (200, b"ok")
    finally:
        worker.join(10)
        listener.close()


@pytest.mark.parametrize("head", ["Content-Length: 5242880\r\n", "", "Connection: close\r\n"],
                         ids=["declared-too-long", "grows-too-long", "connection-close"])  # fmt: skip
def test_a_refused_answer_closes_its_connection_while_the_failure_is_still_held(head):
    """An answer over the cap is refused; its socket must close then, not when the last reference to
    the failure goes. A failed warmup batch holds its failures in a reference cycle (future, exception,
    traceback, the frames' locals), and with them every refused answer's connection, and the engine's
    handler writing into it, until the next garbage collection."""
    listener = socket.create_server(("127.0.0.1", 0))
    closed = threading.Event()

    def answer() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            try:  # 5 MiB is past what the socket buffers take: it ends only when the client closes
                conn.sendall(f"HTTP/1.1 200 OK\r\n{head}\r\n".encode() + b"x" * (5 * 1024 * 1024))
            except OSError:
                closed.set()

    worker = threading.Thread(target=answer, daemon=True)
    worker.start()
    gc.disable()  # a collection would free what the failure holds, and hide a connection left open
    try:
        with pytest.raises(http_client.RequestFailed, match="1024-byte limit") as failure:
            http_client.request("GET", f"http://127.0.0.1:{listener.getsockname()[1]}/", timeout=30, max_body=1024)
        assert closed.wait(10), "the refused answer's connection stayed open while its failure was held"
        assert failure.value.__traceback__ is not None  # (held until here)
    finally:
        gc.enable()
        listener.close()
        worker.join(30)
