"""A lean HTTP/1.1 client for the load generator: one keep-alive connection, POST JSON, read the SSE events.

A load generator on the same cores as the server must cost little per streamed token, or it is what gets
measured: httpx's streaming path (httpcore, anyio, line decoding) spent 25-33 µs of CPU per SSE event
here, as much as the router per token. This reads the chunked body with asyncio streams and splits events
on the blank line: a few µs per event. Plain HTTP/1.1 as servers speak it to clients (status line,
headers, chunked or Content-Length body, `Connection: close`), and nothing else.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from typing import AsyncIterator
from urllib.parse import urlsplit


class HTTPError(Exception):
    """The connection failed or the server answered something this client does not read."""


class SSEConnection:
    """No timeouts of its own: the caller bounds a whole request (one timer per request, not per read)."""

    def __init__(self, url: str, ssl_context: ssl.SSLContext | None = None) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = (ssl_context or ssl.create_default_context()) if parts.scheme == "https" else None
        self.authority = parts.netloc
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.reader = self.writer = None

    async def post_events(self, path: str, body: bytes) -> tuple[int, AsyncIterator[bytes]]:
        """(status, the `data:` payloads of the response's SSE events); a non-200 body comes as one item."""
        if self.reader is not None and self.reader.at_eof():   # the server closed it while idle (keep-alive timeout)
            await self.close()
        if self.writer is None or self.writer.is_closing():
            try:
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port, ssl=self.ssl)
            except OSError as exc:
                raise HTTPError(f"connect: {exc}") from None
            self.writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.writer.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                          b"Accept: text/event-stream\r\nContent-Length: %d\r\n\r\n%s"
                          % (path.encode(), self.authority.encode(), len(body), body))
        head = await self._read(self.reader.readuntil(b"\r\n\r\n"))
        lines = head.split(b"\r\n")
        try:
            status = int(lines[0].split(b" ", 2)[1])
        except (IndexError, ValueError):
            raise HTTPError(f"bad status line {lines[0][:80]!r}") from None
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip().lower()
        return status, self._events(headers, status)

    async def _events(self, headers: dict[bytes, bytes], status: int) -> AsyncIterator[bytes]:
        pending = b""
        async for data in self._body(headers):
            pending += data
            if status != 200:   # an error body: returned whole below
                continue
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if event.startswith(b"data: "):
                    yield event[6:]
        if status != 200:
            yield pending
        if headers.get(b"connection") == b"close":
            await self.close()

    async def _body(self, headers: dict[bytes, bytes]) -> AsyncIterator[bytes]:
        reader = self.reader
        if headers.get(b"transfer-encoding") == b"chunked":
            while True:
                size_line = await self._read(reader.readuntil(b"\r\n"))
                try:
                    size = int(size_line.split(b";", 1)[0], 16)
                except ValueError:
                    raise HTTPError(f"bad chunk size {size_line[:40]!r}") from None
                if size == 0:
                    await self._read(reader.readuntil(b"\r\n"))   # no trailers from our servers
                    return
                chunk = await self._read(reader.readexactly(size + 2))
                yield chunk[:-2]
        elif b"content-length" in headers:
            yield await self._read(reader.readexactly(int(headers[b"content-length"])))
        else:
            yield await self._read(reader.read())
            await self.close()

    async def _read(self, awaitable):
        try:
            return await awaitable
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            await self.close()
            raise HTTPError(f"{type(exc).__name__}: {exc}") from None
