"""A TCP forwarder on 127.0.0.1 that stops forwarding on cue and keeps its sockets open, as a
wedged pgbouncer or cloud SQL proxy does after a client has logged in.

    client ──► WedgingForwarder ──► upstream (PostgreSQL on 127.0.0.1:5432)

Bytes pass untouched until the client sends a chunk that holds `cue` (a statement's text, say):
from then on, that chunk and everything after it, either way and on every connection, is read and
dropped. The sockets stay open, so the client's kernel sees a live peer that ACKs every byte and
every keepalive probe: only the client's own bound ends its wait. `close()` closes them all.
"""

from __future__ import annotations

import socket
import threading


class WedgingForwarder:
    def __init__(self, upstream: tuple[str, int], cue: bytes):
        self._upstream, self._cue = upstream, cue
        self.wedged = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, name="wedging-forwarder", daemon=True).start()

    def url(self, database_url: str) -> str:
        """`database_url` (a SQLAlchemy URL on the upstream) through this forwarder."""
        host, port = self._upstream
        return database_url.replace(f"@{host}:{port}/", f"@127.0.0.1:{self.port}/", 1)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            upstream = socket.create_connection(self._upstream)
            with self._lock:
                self._open += [client, upstream]
            for source, sink, watch in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pump, args=(source, sink, watch), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, watch: bool) -> None:
        while True:
            try:
                chunk = source.recv(65536)
            except OSError:
                return
            if not chunk:
                break
            if watch and self._cue in chunk:
                self.wedged.set()
            if self.wedged.is_set():
                continue  # read and dropped: the peer's writes never block, nothing answers them
            try:
                sink.sendall(chunk)
            except OSError:
                return
        if not self.wedged.is_set():
            try:
                sink.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            for sock in self._open:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

    def __enter__(self) -> WedgingForwarder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
