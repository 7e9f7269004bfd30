"""A trivial OpenAI-style SSE server, to measure the benchmark client's own ceiling.

``python -m tserve.bench.echo_server [--port P] [--itl SECONDS]`` answers
``POST /v1/completions`` and ``/v1/chat/completions`` with ``max_tokens``
one-word chunks (one socket write each, ``--itl`` seconds apart, or
``echo_itl`` from the request body; ``echo_close`` closes the connection
afterwards, as servers do to idle keep-alive connections), a usage
chunk and ``[DONE]``, over keep-alive HTTP/1.1 with chunked encoding, and
``GET /v1/models`` and ``/health``. It does no other work, so a client that
it can outrun is measuring itself: ``python -m tserve bench --self-test``
starts it in a child process and reports chunks/s and requests/s.

It binds 127.0.0.1 only and prints ``echo_server: listening on URL`` once
it accepts connections.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import anyio
import anyio.abc
import msgspec

__all__ = ["main", "serve"]

_MODEL = "echo"
_MAX_BODY = 1 << 20


def _chunk(payload: bytes) -> bytes:
    """One SSE event as one HTTP chunk."""
    event = b"data: " + payload + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(event), event)


def _head(status: str, content_type: str, length: int | None) -> bytes:
    framing = "Transfer-Encoding: chunked" if length is None else f"Content-Length: {length}"
    return f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n{framing}\r\n\r\n".encode()


def _json(status: str, body: object) -> bytes:
    data = msgspec.json.encode(body)
    return _head(status, "application/json", len(data)) + data


def _events(chat: bool, n: int) -> tuple[bytes, bytes, bytes]:
    """The bytes of a token chunk, the last token chunk, and the tail (usage, DONE, end)."""
    if chat:
        token = {"choices": [{"index": 0, "delta": {"content": " tok"}, "finish_reason": None}]}
        last = {"choices": [{"index": 0, "delta": {"content": " tok"}, "finish_reason": "length"}]}
    else:
        token = {"choices": [{"index": 0, "text": " tok", "finish_reason": None}]}
        last = {"choices": [{"index": 0, "text": " tok", "finish_reason": "length"}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": n}}
    tail = _chunk(msgspec.json.encode(usage)) + _chunk(b"[DONE]") + b"0\r\n\r\n"
    return _chunk(msgspec.json.encode(token)), _chunk(msgspec.json.encode(last)), tail


class _Body(msgspec.Struct):
    max_tokens: int = 16
    stream: bool = False
    echo_itl: float | None = None  # this request's seconds between chunks
    echo_close: bool = False  # close the connection after answering, unannounced


async def _stream(stream: anyio.abc.ByteStream, chat: bool, n: int, itl: float) -> None:
    token, last, tail = _events(chat, n)
    await stream.send(_head("200 OK", "text/event-stream", None))
    for i in range(n):
        if itl > 0:
            await anyio.sleep(itl)
        await stream.send(last if i == n - 1 else token)
    await stream.send(tail)


async def _answer(
    stream: anyio.abc.ByteStream, method: bytes, path: bytes, body: bytes, itl: float
) -> None:
    if method == b"GET" and path in (b"/health", b"/v1/models"):
        await stream.send(_json("200 OK", {"object": "list", "data": [{"id": _MODEL}]}))
        return
    if method != b"POST" or path not in (b"/v1/completions", b"/v1/chat/completions"):
        await stream.send(_json("404 Not Found", {"error": {"message": "not found"}}))
        return
    try:
        req = msgspec.json.decode(body, type=_Body)
    except msgspec.DecodeError as exc:
        await stream.send(_json("400 Bad Request", {"error": {"message": str(exc)}}))
        return
    if not req.stream:
        await stream.send(_json("400 Bad Request", {"error": {"message": "stream only"}}))
        return
    gap = itl if req.echo_itl is None else req.echo_itl
    await _stream(stream, path.endswith(b"/chat/completions"), max(1, req.max_tokens), gap)
    if req.echo_close:  # as a server does to an idle keep-alive connection
        raise anyio.EndOfStream


async def _connection(stream: anyio.abc.ByteStream, itl: float) -> None:
    """Serve requests on one keep-alive connection until the client closes it."""
    buf = b""
    async with stream:
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    buf += await stream.receive()
                    if len(buf) > _MAX_BODY:
                        return
                head, buf = buf.split(b"\r\n\r\n", 1)
                lines = head.split(b"\r\n")
                method, path, _ = lines[0].split(b" ", 2)
                length = 0
                for line in lines[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                if length > _MAX_BODY:
                    return
                while len(buf) < length:
                    buf += await stream.receive()
                body, buf = buf[:length], buf[length:]
                await _answer(stream, method, path, body, itl)
        except (anyio.EndOfStream, anyio.BrokenResourceError, ValueError):
            return


async def serve(
    port: int = 0,
    itl: float = 0.0,
    *,
    task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve on 127.0.0.1:``port`` until cancelled; ``task_status`` gets the base URL."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=port)
    bound = listener.extra(anyio.abc.SocketAttribute.local_port)
    task_status.started(f"http://127.0.0.1:{bound}")

    async def handle(stream: anyio.abc.SocketStream) -> None:
        await _connection(stream, itl)

    await listener.serve(handle)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tserve.bench.echo_server", description=__doc__)
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0: any)")
    parser.add_argument("--itl", type=float, default=0.0, help="seconds between chunks")
    parser.add_argument("--backend", default="trio", choices=("trio", "asyncio"))
    args = parser.parse_args(argv)

    async def run() -> None:
        async with anyio.create_task_group() as tg:
            url = await tg.start(serve, args.port, args.itl)
            print(f"echo_server: listening on {url}", flush=True)

    try:
        anyio.run(run, backend=args.backend)
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
