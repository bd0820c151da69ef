"""One HTTP request with a deadline on the whole exchange and a cap on the reply's size
(stdlib ``http.client``): what every reward client that talks to a server goes through.

Why not ``urllib``'s ``timeout``: it bounds each socket operation, not the request, so a
server that trickles one byte every few seconds keeps a reader waiting forever; and
``read()`` takes a reply of any size into memory. Here a timer shuts the socket down when
``deadline_s`` has passed since the request started (connect, send, status line, headers and
body all count), and the body is read in chunks that stop at ``max_reply_bytes`` (a
``Content-Length`` over the cap is refused before any of the body is read).
"""
from __future__ import annotations

import http.client
import socket
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

DEFAULT_MAX_REPLY_BYTES = 16 * 2 ** 20  # a reply of rewards is kilobytes; far above, and bounded
_CHUNK = 1 << 16


class DeadlineExceeded(TimeoutError):
    """No whole reply within the deadline."""


class ReplyTooLarge(ValueError):
    """The reply is (or announces itself) larger than the cap."""


@dataclass
class Reply:
    status: int
    body: bytes


def _connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http(s) URL")
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return cls(parts.hostname, parts.port, timeout=timeout), path


def request(url: str, *, body: bytes | None = None, method: str | None = None,
            headers: dict[str, str] | None = None, deadline_s: float,
            max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES) -> Reply:
    """Send one request; the status and the whole body, or DeadlineExceeded / ReplyTooLarge /
    OSError / http.client.HTTPException."""
    method = method or ("GET" if body is None else "POST")
    conn, path = _connection(url, deadline_s)
    fired = threading.Event()

    def abort() -> None:
        fired.set()
        sock = conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked recv/send in the caller
            except OSError:
                pass

    timer = threading.Timer(deadline_s, abort)
    timer.daemon = True
    start = time.monotonic()
    timer.start()
    try:
        conn.request(method, path, body=body, headers=dict(headers or {}))
        reply = conn.getresponse()
        announced = reply.getheader("Content-Length")
        if announced is not None and announced.isdigit() and int(announced) > max_reply_bytes:
            raise ReplyTooLarge(f"reply announces {int(announced)} bytes, over the cap of "
                                f"{max_reply_bytes}")
        chunks, size = [], 0
        while chunk := reply.read1(_CHUNK):
            size += len(chunk)
            if size > max_reply_bytes:
                raise ReplyTooLarge(f"reply passed the cap of {max_reply_bytes} bytes")
            chunks.append(chunk)
        if fired.is_set():
            raise DeadlineExceeded(f"no whole reply within {deadline_s:g} s")
        if announced is not None and announced.isdigit() and size != int(announced):
            raise http.client.IncompleteRead(b"".join(chunks), int(announced) - size)
        return Reply(reply.status, b"".join(chunks))
    except (OSError, http.client.HTTPException) as exc:
        if fired.is_set() or time.monotonic() - start >= deadline_s:
            raise DeadlineExceeded(f"no whole reply within {deadline_s:g} s") from exc
        raise
    finally:
        timer.cancel()
        conn.close()
