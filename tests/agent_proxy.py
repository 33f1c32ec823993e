"""A proxy in front of a head for the agent CLIs' tool round trip (test_agents_cli_e2e).

SmolLM2-135M does not call an agent's tools on its own, so an agent's first turn here is answered by the proxy with
one scripted call to one of its tools, in the API's own streamed shape. The agent runs the tool and sends its result;
that request, and every later one, goes to the head unchanged, and the proxy keeps what it sent and got back.
"""

from __future__ import annotations

import http.client
import http.server
import json
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Forwarded:
    path: str
    body: dict[str, Any]
    status: int
    answer: bytes


@dataclass
class ToolCall:
    """The scripted first turn: a call to `name` with `arguments`."""

    name: str
    arguments: dict[str, Any]


def _sse(events: list[dict[str, Any]]) -> bytes:
    return b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)


def responses_call(model: str, call: ToolCall) -> bytes:
    """A streamed /v1/responses answer that is one function_call, as OpenAI's streams one."""
    item_id, call_id, args = f"fc_{uuid.uuid4().hex}", f"call_{uuid.uuid4().hex}", json.dumps(call.arguments)
    item = {"type": "function_call", "id": item_id, "call_id": call_id, "name": call.name, "arguments": args,
            "status": "completed"}
    started = {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "status": "in_progress", "model": model,
               "output": []}
    usage = {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2, "input_tokens_details": {"cached_tokens": 0},
             "output_tokens_details": {"reasoning_tokens": 0}}
    events = [{"type": "response.created", "response": started},
              {"type": "response.output_item.added", "output_index": 0,
               "item": {**item, "status": "in_progress", "arguments": ""}},
              {"type": "response.function_call_arguments.delta", "output_index": 0, "item_id": item_id, "delta": args},
              {"type": "response.function_call_arguments.done", "output_index": 0, "item_id": item_id,
               "arguments": args},
              {"type": "response.output_item.done", "output_index": 0, "item": item},
              {"type": "response.completed",
               "response": {**started, "status": "completed", "output": [item], "usage": usage}}]
    return _sse([{**event, "sequence_number": n} for n, event in enumerate(events)])


def messages_call(model: str, call: ToolCall) -> bytes:
    """A streamed /v1/messages answer that is one tool_use block, as Anthropic's streams one."""
    message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model,
               "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": 1, "output_tokens": 1}}
    block = {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex}", "name": call.name, "input": {}}
    return _sse([{"type": "message_start", "message": message},
                 {"type": "content_block_start", "index": 0, "content_block": block},
                 {"type": "content_block_delta", "index": 0,
                  "delta": {"type": "input_json_delta", "partial_json": json.dumps(call.arguments)}},
                 {"type": "content_block_stop", "index": 0},
                 {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                  "usage": {"output_tokens": 1}},
                 {"type": "message_stop"}])


def carries_a_tool_result(path: str, body: dict[str, Any]) -> bool:
    if path.startswith("/v1/responses"):
        return any(isinstance(i, dict) and i.get("type") == "function_call_output" for i in body.get("input") or [])
    return any(isinstance(b, dict) and b.get("type") == "tool_result"
               for m in body.get("messages") or [] if isinstance(m.get("content"), list) for b in m["content"])


@dataclass
class AgentProxy:
    """Listens on 127.0.0.1:`port` (a free one when 0); forwards to `head` ("host:port")."""

    head: str
    call: ToolCall
    forwarded: list[Forwarded] = field(default_factory=list)
    scripted: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                proxy._serve(self, "GET")

            def do_POST(self) -> None:
                proxy._serve(self, "POST")

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.shutdown()

    def _script(self, path: str, body: dict[str, Any]) -> bytes | None:
        if self.scripted or carries_a_tool_result(path, body):
            return None  # one scripted turn, the first generation: everything after it is the head's
        if path.startswith("/v1/responses"):
            return responses_call(body.get("model", ""), self.call)
        if path.startswith("/v1/messages") and not path.startswith("/v1/messages/count_tokens"):
            return messages_call(body.get("model", ""), self.call)
        return None

    def _serve(self, handler: http.server.BaseHTTPRequestHandler, method: str) -> None:
        raw = handler.rfile.read(int(handler.headers.get("content-length") or 0))
        body = json.loads(raw) if raw else {}
        answer = self._script(handler.path, body) if method == "POST" else None
        if answer is not None:
            self.scripted.append(handler.path)
            status, headers = 200, [("content-type", "text/event-stream")]
        else:
            conn = http.client.HTTPConnection(self.head, timeout=900)
            sent = {k: v for k, v in handler.headers.items() if k.lower() not in ("host", "content-length")}
            conn.request(method, handler.path, body=raw or None, headers={**sent, "content-length": str(len(raw))})
            reply = conn.getresponse()
            answer, status = reply.read(), reply.status
            headers = [(k, v) for k, v in reply.getheaders()
                       if k.lower() not in ("transfer-encoding", "content-length", "connection")]
            self.forwarded.append(Forwarded(handler.path, body, status, answer))
        handler.send_response(status)
        for name, value in headers:
            handler.send_header(name, value)
        handler.send_header("content-length", str(len(answer)))
        handler.end_headers()
        handler.wfile.write(answer)
