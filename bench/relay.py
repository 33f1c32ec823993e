"""The head's cost on a stream: SSE through a real head and node vs the same generation on the engine directly.

Both sides run the same engine code (an EngineWorker process on the bundled model, the same lanes and context);
the difference is everything the head adds: HTTP and SSE, placement, the encrypted link and the relay.
Runs alternate (head, direct, head, direct, ...) so machine load drifts hit both alike.

    .venv/bin/python bench/relay.py [--runs 12] [--tokens 64] [--tracing]

Prints the decode tokens/s ratio (head / direct) and the added time to first token (p50, p95), and writes
bench/results/relay.json as {"ratio": x, "ttft_added_ms_p50": y, "ttft_added_ms_p95": z, ...}.

`--tracing` adds a second head and node with OpenTelemetry on, exporting to a real OTLP/HTTP receiver in this
process (tests/otlp.py), to the rotation (traced head, head, direct, ...): the same figures for it beside tracing
off, in bench/results/relay_tracing.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from nodes.agent.engine.base import EngineConfig  # noqa: E402
from nodes.agent.engine.worker import EngineWorker  # noqa: E402
from nodes.agent.models import resolve_model  # noqa: E402
from nodes.link.messages import Done, Error, TokenBatch  # noqa: E402
from nodes.link.spec import GenerateSpec  # noqa: E402

PROMPT = [{"role": "user", "content": "Write a short story about a lighthouse keeper and a storm."}]
LANES = 2


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def through_head(client: httpx.Client, url: str, key: str, tokens: int) -> tuple[float, float, int]:
    """(ttft_ms, decode tok/s after the first token, tokens) of one SSE stream through the head."""
    body = {
        "model": "smollm2",
        "messages": PROMPT,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = last = None
    count = 0
    with client.stream(
        "POST", f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                count = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                now = time.perf_counter()
                first = first or now
                last = now
    return (first - start) * 1000, (count - 1) / max(last - first, 1e-9), count


async def direct(worker: EngineWorker, queue: asyncio.Queue, tokens: int) -> tuple[float, float, int]:
    """The same generation submitted straight to an engine worker."""
    spec = GenerateSpec(
        gen_id=uuid.uuid4().hex, model="smollm2", messages=PROMPT, max_tokens=tokens, temperature=0, ignore_eos=True
    )
    start = time.perf_counter()
    first = last = None
    count = 0
    await worker.submit(spec)
    while True:
        event = await queue.get()
        if event.gen_id != spec.gen_id:
            continue
        if isinstance(event, TokenBatch):
            now = time.perf_counter()
            first = first or now
            last = now
            count += len(event.ids)
        elif isinstance(event, Done | Error):
            break
    # The head's client sees batches too; measure both from first to last batch the same way.
    return (first - start) * 1000, (count - 1) / max(last - first, 1e-9), count


def start_fleet(tmp: Path, receiver=None):
    """A head and its node; with `receiver` (tests.otlp.OtlpReceiver), both export their spans to it."""
    from tests.live import make_head, start_node
    from tests.otlp import tracing_env

    head = make_head(tmp, extra_env=tracing_env(receiver, "bench-head") if receiver else None)
    head.start()
    node = start_node(head, "--max-batch", str(LANES), identity="bench-node",
                      extra_env=tracing_env(receiver, "bench-node") if receiver else None)
    head.wait_nodes(1, timeout=240)
    return head, node


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--tracing", action="store_true", help="also a head and node tracing to a local receiver")
    args = parser.parse_args()
    os.environ.pop("DATABASE_URL", None)
    os.environ.pop("REDIS_URL", None)
    tmp = Path(tempfile.mkdtemp(prefix="fleet-bench-relay-"))
    head, node = start_fleet(tmp)
    fleets = {"head": (head, node)}
    receiver = None
    if args.tracing:
        from tests.otlp import OtlpReceiver

        receiver = OtlpReceiver().start()
        fleets["head_traced"] = start_fleet(tmp, receiver)
    queue: asyncio.Queue = asyncio.Queue()
    path, _ = resolve_model("smollm2")
    worker = EngineWorker(
        EngineConfig(model_path=str(path), model_name="smollm2", lanes=LANES), on_event=queue.put_nowait
    )
    await worker.start()
    rows = {name: [] for name in (*fleets, "direct")}
    try:
        with httpx.Client(timeout=300) as client:
            for h, _ in fleets.values():  # warm every side: caches, first-call costs
                through_head(client, h.url, h.api_key, 8)
            await direct(worker, queue, 8)
            for run in range(args.runs):
                # the heads swap places each round: neither always follows the direct run (whose engine threads
                # may still hold the cores a moment)
                for name, (h, _) in (list(fleets.items()) if run % 2 else list(reversed(fleets.items()))):
                    rows[name].append(await asyncio.to_thread(through_head, client, h.url, h.api_key, args.tokens))
                rows["direct"].append(await direct(worker, queue, args.tokens))
    finally:
        await worker.stop()
        for h, n in fleets.values():
            n.stop()
            h.stop()
        if receiver is not None:
            receiver.stop()
    report(rows, args, spans=len(receiver.spans) if receiver is not None else None)


def report(rows: dict[str, list[tuple[float, float, int]]], args, spans: int | None = None) -> None:
    ttft = {k: [r[0] for r in v] for k, v in rows.items()}
    tps = {k: statistics.median(r[1] for r in v) for k, v in rows.items()}
    added = [h - d for h, d in zip(ttft["head"], ttft["direct"], strict=True)]
    result = {
        "ratio": round(tps["head"] / tps["direct"], 3),
        "ttft_added_ms_p50": round(percentile(added, 0.5), 1),
        "ttft_added_ms_p95": round(percentile(added, 0.95), 1),
        "decode_tok_s": {k: round(v, 1) for k, v in tps.items()},
        "ttft_ms_p50": {k: round(percentile(v, 0.5), 1) for k, v in ttft.items()},
        "runs": args.runs,
        "tokens": args.tokens,
        "lanes": LANES,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if spans is not None:
        traced = [h - d for h, d in zip(ttft["head_traced"], ttft["direct"], strict=True)]
        result["tracing"] = {
            "ratio": round(tps["head_traced"] / tps["direct"], 3),
            "ttft_added_ms_p50": round(percentile(traced, 0.5), 1),
            "ttft_added_ms_p95": round(percentile(traced, 0.95), 1),
            "ratio_change": round((tps["head_traced"] - tps["head"]) / tps["direct"], 3),
            "ttft_added_by_tracing_ms_p50": round(percentile(traced, 0.5) - percentile(added, 0.5), 1),
            "spans_received": spans,
        }
    print(f"{'':12}{'decode tok/s (p50)':>20}{'ttft ms (p50)':>16}")
    for k in rows:
        print(f"{k:12}{result['decode_tok_s'][k]:>20}{result['ttft_ms_p50'][k]:>16}")
    print(f"relay ratio (head/direct tok/s): {result['ratio']}   target >= 0.95")
    print(
        f"added time to first token: p50 {result['ttft_added_ms_p50']} ms (target <= 10), "
        f"p95 {result['ttft_added_ms_p95']} ms"
    )
    if spans is not None:
        t = result["tracing"]
        print(f"tracing on: ratio {t['ratio']} ({t['ratio_change']:+} beside off, target within 0.02), added ttft "
              f"p50 {t['ttft_added_ms_p50']} ms ({t['ttft_added_by_tracing_ms_p50']:+} beside off, target within 2), "
              f"{spans} spans received")
    out = ROOT / "bench" / "results" / ("relay_tracing.json" if spans is not None else "relay.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    asyncio.run(main())
