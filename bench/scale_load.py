"""The processes bench/scale.py starts besides heads and mock nodes: a bare mock node that streams to clients with
no head (`node`), a minimal streaming reverse proxy (`proxy`) and the streaming clients (`clients`).

    python bench/scale_load.py node --port P --lanes 64 --tps 40
    python bench/scale_load.py proxy --port P --upstreams 127.0.0.1:P1,127.0.0.1:P2
    python bench/scale_load.py clients --mode sse|ws|raw --targets H:P[,H:P] --streams N --tokens T
                                       --start EPOCH --seconds S --out FILE [--key KEY]

Everything speaks HTTP/1.1 over raw asyncio streams, so the clients cost as little as a client can and the proxy is
nothing but the relaying. A client runs its streams closed-loop (a stream that ends starts the next) and keeps,
for the window [start, start + seconds): the tokens that arrived, each generation's time to first token (those that
started in the window) and the gaps between the token chunks of a stream.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPT = "Tell me about lane {i} of the fleet, briefly."


# --- a bare mock node: the engine the fleet's mock nodes run, streaming straight to its clients -----------------
async def node_main(args) -> None:
    from nodes.agent.engine.base import EngineConfig
    from nodes.agent.engine.worker import EngineWorker
    from nodes.link.messages import Done, Error, TokenBatch
    from nodes.link.spec import GenerateSpec

    queues: dict[str, asyncio.Queue] = {}
    worker = EngineWorker(EngineConfig(model_name="smollm2", lanes=args.lanes, mock={"decode_tps": args.tps}),
                          on_event=lambda e: queues[e.gen_id].put_nowait(e) if e.gen_id in queues else None)
    await worker.start()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):  # a client gone before asking (a window's end)
            writer.close()
            return
        tokens = int(head.split(b" ", 2)[1].rsplit(b"=", 1)[1])
        gen_id = uuid.uuid4().hex
        queue = queues[gen_id] = asyncio.Queue()
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
        await worker.submit(GenerateSpec(gen_id=gen_id, model="smollm2", max_tokens=tokens, ignore_eos=True,
                                         messages=[{"role": "user", "content": PROMPT.format(i=gen_id[:6])}]))
        try:
            while True:
                event = await queue.get()
                if isinstance(event, TokenBatch):
                    writer.write(b"data: " + json.dumps({"text": "".join(event.text)}).encode() + b"\n\n")
                    await writer.drain()
                elif isinstance(event, Done | Error):
                    break
            writer.write(b"data: [DONE]\n\n")
            await writer.drain()
        except ConnectionError:
            await worker.cancel(gen_id)
        finally:
            queues.pop(gen_id, None)
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", args.port, backlog=4096)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


# --- the minimal streaming reverse proxy: bytes both ways, upstreams in turn -----------------------------------
async def proxy_main(args) -> None:
    upstreams = itertools.cycle([(h, int(p)) for h, p in (u.split(":") for u in args.upstreams.split(","))])

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*next(upstreams))
        except OSError:
            writer.close()
            return
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    server = await asyncio.start_server(serve, "127.0.0.1", args.port, backlog=4096)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


# --- streaming clients ------------------------------------------------------------------------------------------
class Window:
    """What the clients saw within [start, end)."""

    def __init__(self, start: float, seconds: float) -> None:
        self.start, self.end = start, start + seconds
        self.tokens = 0
        self.ttfts: list[float] = []
        self.gaps: list[float] = []
        self.errors: dict[str, int] = {}
        self.handshakes: list[float] = []  # each websocket's opening handshake (ms), in the window or before it
        self.ended = 0  # streams whose end arrived in the window

    def finished(self) -> None:
        if self.start <= time.time() < self.end:
            self.ended += 1

    def chunk(self, text: str, last: float | None) -> float:
        now = time.time()
        if self.start <= now < self.end:
            self.tokens += len(text.split())
            if last is not None and last >= self.start:
                self.gaps.append((now - last) * 1000)
        return now

    def first(self, began: float, now: float) -> None:
        if self.start <= began < self.end:
            self.ttfts.append((now - began) * 1000)

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1


def _text_of(line: bytes, mode: str) -> str | None:
    body = line[6:].strip()
    if body == b"[DONE]":
        return None
    data = json.loads(body)
    if mode == "raw":
        return data["text"]
    choices = data.get("choices") or [{}]
    return (choices[0].get("delta") or {}).get("content") or ""


async def one_http_stream(target: tuple[str, int], mode: str, key: str, i: int, tokens: int, win: Window) -> None:
    reader, writer = await asyncio.open_connection(*target)
    try:
        if mode == "raw":
            request = f"GET /stream?tokens={tokens} HTTP/1.1\r\nhost: bench\r\n\r\n".encode()
        else:
            body = json.dumps({"model": "smollm2", "stream": True, "max_tokens": tokens, "ignore_eos": True,
                               "messages": [{"role": "user", "content": PROMPT.format(i=i)}]}).encode()
            request = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\nauthorization: Bearer {key}\r\n"
                       f"content-type: application/json\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n"
                       ).encode() + body
        began, last = time.time(), None
        writer.write(request)
        while line := await reader.readline():
            if not line.startswith(b"data: "):
                continue
            text = _text_of(line, mode)
            if text is None:
                win.finished()
                break
            if text:
                now = win.chunk(text, last)
                if last is None:
                    win.first(began, now)
                last = now
    finally:
        writer.close()


async def ws_streams(target: tuple[str, int], key: str, i: int, tokens: int, win: Window) -> None:
    import websockets

    dialed = time.time()
    async with websockets.connect(f"ws://{target[0]}:{target[1]}/ws/v1/generate?api_key={key}",
                                  max_queue=None) as ws:
        if dialed < win.end:
            win.handshakes.append((time.time() - dialed) * 1000)
        for n in itertools.count():
            await ws.send(json.dumps({"type": "generate", "id": f"g{n}", "model": "smollm2", "max_tokens": tokens,
                                      "ignore_eos": True, "messages": [{"role": "user",
                                                                        "content": PROMPT.format(i=i)}]}))
            began, last = time.time(), None
            while True:
                frame = json.loads(await ws.recv())
                if frame["type"] == "token":
                    now = win.chunk(frame["text"], last)
                    if last is None:
                        win.first(began, now)
                    last = now
                elif frame["type"] in ("done", "error"):
                    if frame["type"] == "error":
                        win.error(frame.get("code", "error"))
                    else:
                        win.finished()
                    break


async def client_loop(args, target: tuple[str, int], i: int, win: Window) -> None:
    while time.time() < win.end:
        try:
            if args.mode == "ws":
                await ws_streams(target, args.key, i, args.tokens, win)
            else:
                await one_http_stream(target, args.mode, args.key, i, args.tokens, win)
        except (OSError, ValueError, asyncio.IncompleteReadError) as exc:
            win.error(type(exc).__name__)
            await asyncio.sleep(0.2)
        except Exception as exc:  # a websocket closed under us, and the like: count it, go on
            win.error(type(exc).__name__)
            await asyncio.sleep(0.2)


async def clients_main(args) -> None:
    targets = [(h, int(p)) for h, p in (t.split(":") for t in args.targets.split(","))]
    win = Window(args.start, args.seconds)
    tasks = [asyncio.ensure_future(client_loop(args, targets[i % len(targets)], i, win)) for i in range(args.streams)]
    await asyncio.sleep(max(win.end - time.time(), 0))
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    Path(args.out).write_text(json.dumps({"tokens": win.tokens, "ttfts": win.ttfts, "gaps": win.gaps,
                                          "errors": win.errors, "ended": win.ended,
                                          "handshakes": win.handshakes}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", choices=["node", "proxy", "clients"])
    parser.add_argument("--port", type=int)
    parser.add_argument("--lanes", type=int, default=64)
    parser.add_argument("--tps", type=float, default=40.0)
    parser.add_argument("--upstreams", default="")
    parser.add_argument("--mode", choices=["sse", "ws", "raw"], default="raw")
    parser.add_argument("--targets", default="")
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--start", type=float, default=0.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--key", default="")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    run = {"node": node_main, "proxy": proxy_main, "clients": clients_main}[args.role]
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
