"""Idle keep-alive connections: the router must not close one that a client may still reuse.

A client pool decides to reuse an idle connection (httpx, and so the `openai` client: one idle for less
than 5 s whose socket shows no close yet) and sends on it a moment later; a busy client's moment can be
long. uvicorn's default keep-alive is 5 s too: when the router's timer closed the connection inside that
moment, the request met a closed socket and the client read a reset (`httpx.ReadError`: 1-5 failed
requests in 1024 with `benchmarks/serving.py` at 256 streams, many more with a shorter keep-alive). The
router keeps idle connections for `keep_alive_timeout` (75 s), longer than clients and load balancers do.
"""

from __future__ import annotations

import select
import socket
import time

import httpx
import pytest
from router_fakes import ServerThread, make_tokenizer_dir

from pdcluster.router.app import create_app
from pdcluster.router.cluster import StaticNodeSource
from pdcluster.router.settings import RouterSettings

REQUEST = b"GET /v1/models HTTP/1.1\r\nHost: router\r\n\r\n"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tokenizer_dir(str(tmp_path_factory.mktemp("tiny")), max_position_embeddings=128)


def serve(model_dir: str, **settings) -> ServerThread:
    return ServerThread(create_app(RouterSettings(model=model_dir, served_model_name="tiny", node_id="r-ka",
                                                  **settings), StaticNodeSource())).start()


def response(conn: socket.socket) -> bytes:
    """One whole HTTP response (b"" when the router closed or reset the connection instead)."""
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return b""
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        headers = dict(line.lower().split(b": ", 1) for line in head.split(b"\r\n")[1:])
        length = int(headers[b"content-length"])
        while len(body) < length:
            body += conn.recv(65536)
        return head + b"\r\n\r\n" + body
    except ConnectionResetError:
        return b""


def reuse(server: ServerThread, decide_at: float, send_at: float) -> bytes:
    """A second request on a connection, as a client pool sends it: the connection looked open when the pool
    picked it (`decide_at` s after the first response), the request goes out at `send_at`."""
    with socket.create_connection(("127.0.0.1", server.port)) as conn:
        conn.settimeout(10)
        conn.sendall(REQUEST)
        assert response(conn).startswith(b"HTTP/1.1 200")
        idle_since = time.monotonic()
        time.sleep(max(0.0, idle_since + decide_at - time.monotonic()))
        assert not select.select([conn], [], [], 0)[0], "closed before the pool would reuse it"   # httpcore's check
        time.sleep(max(0.0, idle_since + send_at - time.monotonic()))
        conn.sendall(REQUEST)
        return response(conn)


def test_the_default_keep_alive_outlives_client_pools() -> None:
    # httpx's pools (the openai client's too) keep an idle connection for 5 s; load balancers commonly 60 s.
    assert RouterSettings().keep_alive_timeout > max(httpx.Limits().keepalive_expiry, 60)


def test_a_connection_reused_late_is_served(model_dir) -> None:
    server = serve(model_dir)
    try:
        assert reuse(server, decide_at=0.4, send_at=1.0).startswith(b"HTTP/1.1 200")
    finally:
        server.stop()


def test_a_keep_alive_as_short_as_the_client_idle_time_loses_the_request(model_dir) -> None:
    """The failure the default avoids: the router closes the connection between the pool's check and its send."""
    server = serve(model_dir, keep_alive_timeout=0.5)
    try:
        assert reuse(server, decide_at=0.4, send_at=1.0) == b""
    finally:
        server.stop()
