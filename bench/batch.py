"""A batch below interactive traffic: the same interactive load alone, then with a 400-line batch, side by side.

One real head (daphne), mock-engine nodes in processes of their own (CPU-like: 20 decode steps a second, each
busy lane one token a step, so a lane's time is the same whatever else runs) and a real Celery worker running the
batch through the head, as in production. The interactive load is open-loop: streaming chat requests (SSE, their
own API key) arrive at random (Poisson) at --rate a second, each asking for --tokens tokens.

1. alone:      the interactive load for --alone-s seconds.
2. with_batch: the same load (same seed) while a --lines batch runs, until the batch is over.

Reported, from the client's clock and the head's generation records (each record's placement time and end):
- interactive time to first token p50 (and p95), alone and with the batch;
- idle_lane_share_used: of the lane time the interactive load left idle while the batch ran (lanes x the batch's
  run time, less the interactive generations' lane time in it), the share batch lines used;
- batch_lines_per_s: lines over the batch's run time (in_progress to completed).

    .venv/bin/python bench/batch.py [--lines 400] [--rate 4] [--alone-s 60]

Writes bench/results/batch.json as {"interactive_ttft_ms_p50": {"alone": a, "with_batch": b},
"idle_lane_share_used": u, "batch_lines_per_s": r, ...}. Targets (issue 12): b <= 1.2 a, u >= 0.8.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import openai  # noqa: E402

from tests.live import Head, make_head  # noqa: E402
from tests.mock_node import start_mock_node  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "batch.json"
MODEL = "smollm2"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))] if ordered else float("nan")


def _has_text(data: str) -> bool:
    """Whether an SSE chunk carries answer text (the first announces the role with empty content)."""
    choices = json.loads(data).get("choices") or [{}]
    return bool((choices[0].get("delta") or {}).get("content"))


async def one_stream(client: httpx.AsyncClient, key: str, i: int, tokens: int, ttfts: list[float],
                     failures: list[str]) -> None:
    body = {"model": MODEL, "stream": True, "max_tokens": tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Interactive question {i}: what is the weather on day {i}?"}]}
    start = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body,
                                 headers={"Authorization": f"Bearer {key}"}) as resp:
            if resp.status_code != 200:
                failures.append(f"{resp.status_code}: {(await resp.aread())[:200]!r}")
                return
            first = True
            async for line in resp.aiter_lines():
                if first and line.startswith("data: {") and _has_text(line[6:]):
                    ttfts.append((time.perf_counter() - start) * 1000)
                    first = False
    except httpx.HTTPError as exc:
        failures.append(repr(exc))


async def interactive_load(url: str, key: str, *, rate: float, tokens: int, seed: int, until) -> dict:
    """Poisson arrivals at `rate`/s until `until()` is true; waits for every stream to end."""
    rng = random.Random(seed)
    ttfts: list[float] = []
    failures: list[str] = []
    tasks = []
    limits = httpx.Limits(max_connections=500, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        i = 0
        next_at = time.perf_counter()
        while not until():
            next_at += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            tasks.append(asyncio.create_task(one_stream(client, key, i, tokens, ttfts, failures)))
            i += 1
        await asyncio.gather(*tasks)
    return {"requests": i, "ttfts": ttfts, "failures": failures}


def generation_lane_intervals(head: Head) -> tuple[dict[str, list[tuple[float, float]]], int, list]:
    """Each generation's lane time per API key name (from the head's DB): from each placement to the end of what
    ran there (the next placement's `after.at` for a line preempted or failed over, else the record's end). Also
    how many times batch lines were preempted."""
    script = (
        "import django, json; django.setup()\n"
        "from sessions.models import Generation\n"
        "rows = [(g.api_key.name if g.api_key else '', g.placement or {},"
        " g.finished_at.timestamp() if g.finished_at else None, g.created_at.timestamp(), g.ttft_ms)"
        " for g in Generation.objects.select_related('api_key')]\n"
        "print(json.dumps(rows))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=head.env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    by_key: dict[str, list[tuple[float, float]]] = {}
    preemptions = 0
    head_ttfts = []  # (started, ms) of interactive generations: the head's own clock, from the request to token 1
    for name, placement, finished, started, ttft_ms in json.loads(out.strip().splitlines()[-1]):
        if name == "interactive" and ttft_ms is not None:
            head_ttfts.append((started, ttft_ms))
        if not placement.get("placed_at") or not finished:
            continue
        later = placement.get("failover", [])
        starts = [placement["placed_at"], *(p["placed_at"] for p in later)]
        ends = [*((p.get("after") or {}).get("at", p["placed_at"]) for p in later), finished]
        by_key.setdefault(name, []).extend(zip(starts, ends, strict=True))
        preemptions += sum(1 for p in later if (p.get("after") or {}).get("code") == "preempted")
    return by_key, preemptions, head_ttfts


def overlap(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in intervals)


def batch_lines(lines: int, tokens: int) -> bytes:
    rows = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": MODEL, "max_tokens": tokens, "ignore_eos": True,
                      "messages": [{"role": "user", "content": f"Batch item {i}: summarize document {i}."}]}}
            for i in range(lines)]
    return ("\n".join(json.dumps(r) for r in rows) + "\n").encode()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=400)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--lanes", type=int, default=4, help="lanes per node")
    parser.add_argument("--decode-tps", type=float, default=20.0, help="each mock lane's tokens per second")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per interactive request and batch line")
    parser.add_argument("--rate", type=float, default=4.0, help="interactive requests a second")
    parser.add_argument("--alone-s", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    lanes = args.nodes * args.lanes

    head = make_head(Path(tempfile.mkdtemp(prefix="fleet-bench-batch-")), extra_env={
        "FLEET_QUOTA_REQUESTS_PER_MINUTE": "0", "FLEET_QUOTA_CONCURRENT_STREAMS": "0",
        "FLEET_QUOTA_TOKENS_PER_MINUTE": "0",
        "FLEET_BATCH_CONCURRENCY": str(lanes * 2), "FLEET_LOG_LEVEL": "WARNING"})
    made = head.manage("create_api_key", "--user", "admin", "--name", "interactive").stdout
    interactive_key = next(line.strip() for line in made.splitlines() if line.strip().startswith("fk-"))
    head.start()
    nodes = [start_mock_node(head, f"batch-node-{n}", lanes=args.lanes, decode_tps=args.decode_tps)
             for n in range(args.nodes)]
    worker = None
    try:
        head.wait_nodes(args.nodes, timeout=120)
        print(f"bench/batch.py: {args.nodes} mock nodes x {args.lanes} lanes at {args.decode_tps:g} tok/s a lane; "
              f"interactive {args.rate:g}/s x {args.tokens} tokens", flush=True)

        # 1. alone
        deadline = time.time() + args.alone_s
        alone_start = time.time()
        alone = asyncio.run(interactive_load(head.url, interactive_key, rate=args.rate, tokens=args.tokens,
                                             seed=args.seed, until=lambda: time.time() >= deadline))
        alone_end = time.time()
        print(f"alone: {alone['requests']} requests, ttft p50 {percentile(alone['ttfts'], 0.5):.0f} ms", flush=True)

        # 2. with the batch: a real worker, the batch created through the official client
        client = openai.OpenAI(base_url=f"{head.url}/v1", api_key=head.api_key, max_retries=0, timeout=60)
        source = client.files.create(file=("batch.jsonl", io.BytesIO(batch_lines(args.lines, args.tokens))),
                                     purpose="batch")
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "fleet", "worker", "--pool=solo", "--loglevel=WARNING",
             "-n", f"bench-batch-{head.port}@%h"],
            cwd=ROOT, env=head.env, stdout=open(head.home / "worker.log", "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT, start_new_session=True)
        batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        state = {"over": False, "last": 0.0}

        def batch_over() -> bool:
            if time.time() - state["last"] >= 1.0:
                state["last"] = time.time()
                state["over"] = client.batches.retrieve(batch.id).status in ("completed", "failed", "cancelled",
                                                                             "expired")
            return state["over"]

        with_batch = asyncio.run(interactive_load(head.url, interactive_key, rate=args.rate, tokens=args.tokens,
                                                  seed=args.seed, until=batch_over))
        done = client.batches.retrieve(batch.id)
        run_start, run_end = float(done.in_progress_at), float(done.completed_at or time.time())
        intervals, preemptions, head_ttfts = generation_lane_intervals(head)
        head_alone = [ms for at, ms in head_ttfts if at < alone_end]
        head_with = [ms for at, ms in head_ttfts if at >= alone_end]
        interactive_lane_s = overlap(intervals.get("interactive", []), run_start, run_end)
        batch_lane_s = overlap(intervals.get("tests", []), run_start, run_end)
        idle_lane_s = lanes * (run_end - run_start) - interactive_lane_s
        alone_lane_s = overlap(intervals.get("interactive", []), alone_start, alone_end)
        alone_busy = alone_lane_s / (lanes * (alone_end - alone_start))
        report = {
            "interactive_ttft_ms_p50": {"alone": round(percentile(alone["ttfts"], 0.5), 1),
                                        "with_batch": round(percentile(with_batch["ttfts"], 0.5), 1)},
            "interactive_ttft_ms_p95": {"alone": round(percentile(alone["ttfts"], 0.95), 1),
                                        "with_batch": round(percentile(with_batch["ttfts"], 0.95), 1)},
            "idle_lane_share_used": round(batch_lane_s / idle_lane_s, 3) if idle_lane_s > 0 else None,
            "batch_lines_per_s": round(args.lines / (run_end - run_start), 2),
            "interactive_ttft_ms": {phase: {f"p{q}": round(percentile(run["ttfts"], q / 100), 1)
                                            for q in (10, 25, 50, 75, 90)}
                                    for phase, run in (("alone", alone), ("with_batch", with_batch))},
            "head_ttft_ms_p50": {"alone": round(percentile(head_alone, 0.5), 1),
                                 "with_batch": round(percentile(head_with, 0.5), 1)},
            "preemptions": preemptions,
            "batch": {"status": done.status, "completed": done.request_counts.completed,
                      "failed": done.request_counts.failed, "run_s": round(run_end - run_start, 1)},
            "lane_share": {"interactive_alone": round(alone_busy, 3),
                           "interactive_with_batch": round(interactive_lane_s / (lanes * (run_end - run_start)), 3),
                           "batch": round(batch_lane_s / (lanes * (run_end - run_start)), 3)},
            "interactive": {"alone": {"requests": alone["requests"], "failures": len(alone["failures"])},
                            "with_batch": {"requests": with_batch["requests"],
                                           "failures": len(with_batch["failures"])}},
            "setup": {"nodes": args.nodes, "lanes_per_node": args.lanes, "decode_tps": args.decode_tps,
                      "tokens": args.tokens, "rate": args.rate, "lines": args.lines, "alone_s": args.alone_s,
                      "batch_share": float(head.env.get("FLEET_BATCH_SHARE", "0.5")),
                      "cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
                      "when": datetime.now().isoformat(timespec="seconds")},
        }
        for failure in (alone["failures"] + with_batch["failures"])[:5]:
            print("failure:", failure)
    finally:
        if worker is not None and worker.poll() is None:
            os.killpg(worker.pid, 15)
            worker.wait(30)
        for node in nodes:
            node.stop()
        head.stop()
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    ttft = report["interactive_ttft_ms_p50"]
    print(f"ttft p50 with/alone {ttft['with_batch'] / ttft['alone']:.2f} (target <= 1.2); "
          f"idle lane share used {report['idle_lane_share_used']} (target >= 0.8)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
