"""Fair shares when the fleet is full: a light key beside a key sending ten times its rate, deadline order vs fair.

One real head (daphne) per waiting order, side by side in one run: FLEET_WAITING_ORDER=deadline (the order before
fair shares: class, then deadline), FLEET_WAITING_ORDER=fair (class, then keys in turn, then deadline; with
FLEET_PREEMPTING_CLASSES=high and FLEET_SHARE_PREEMPTING_CLASSES=normal: a key under its share takes a lane from one
over it) and the same fair order without FLEET_SHARE_PREEMPTING_CLASSES (`fair_waiting`: within a class a key waits
for the next lane to free, first in turn). Each has the same mock-engine node in a process of its own (--lanes lanes at
--decode-tps tokens a second a lane, so a generation holds its lane --tokens / --decode-tps seconds) and the same
open-loop load (Poisson arrivals, streaming chat requests over SSE, each asking for --tokens tokens, same seeds):

1. alone:       the light key (--light-rate a second) and the high-priority key (same rate) with nothing else,
                --alone-s seconds: the fleet is not full;
2. flood:       the heavy key at ten times the light key's rate (above what the lanes serve, so the fleet is full
                and a queue builds) with the light key, --flood-s seconds;
3. high_flood:  the heavy key's flood again with the high-priority key (priority high), --flood-s seconds.

Between phases the head drains (every stream ends). Reported, from the client's clock: the light key's time to
first token p50 and p95 alone, under the flood with deadline order and with fair shares; the high-priority key's
TTFT p50 alone and under the flood (fair head: it preempts a normal generation when no lane is free; the deadline
head's figure, without preemption, is in `details`, as is the fair_waiting head's); from the head's records, the
lanes' busy share during the flood (generations' lane time from each placement to its end or its preemption, over
lanes x the phase).

    .venv/bin/python bench/fairness.py [--flood-s 30] [--alone-s 15]

Writes bench/results/fairness.json as {"light_ttft_ms_p50": {"alone": a, "deadline_order": b, "fair": c},
"light_ttft_ms_p95": {...}, "lane_busy_share": {"deadline_order": x, "fair": y}, "high_priority_ttft_ms_p50":
{"alone": h, "under_flood": f}, "details": {...}}. Targets (issue 37): c <= 1.5 a, y >= 0.98 x, f <= 1.2 h.
"""

from __future__ import annotations

import argparse
import asyncio
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

from tests.live import Head, make_head  # noqa: E402
from tests.mock_node import start_mock_node  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "fairness.json"
MODEL = "smollm2"
KEYS = {"light": {}, "heavy": {}, "high": {"priority": "high"}}
_MAKE_KEYS = """
import django, json; django.setup()
from django.contrib.auth import get_user_model
from api.services import api_key_create
admin = get_user_model().objects.get(username="admin")
print(json.dumps({name: api_key_create(owner=admin, name=name, quotas=share)[1]
                  for name, share in json.loads(%r).items()}))
"""
_LANE_TIME = """
import django, json; django.setup()
from sessions.models import Generation
print(json.dumps([((g.placement or {}).get("placed_at"), g.finished_at.timestamp() if g.finished_at else None,
                   [(f.get("placed_at"), (f.get("after") or {}).get("at")) for f in (g.placement or {}).get("failover",
                                                                                                        [])])
                  for g in Generation.objects.all()]))
"""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))] if ordered else float("nan")


def _has_text(data: str) -> bool:
    choices = json.loads(data).get("choices") or [{}]
    return bool((choices[0].get("delta") or {}).get("content"))


async def one_stream(client: httpx.AsyncClient, key: str, i: int, tokens: int, out: dict) -> None:
    body = {"model": MODEL, "stream": True, "max_tokens": tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Question {i}: what is the weather on day {i}?"}]}
    start = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body,
                                 headers={"Authorization": f"Bearer {key}"}) as resp:
            if resp.status_code != 200:
                out["failures"].append(f"{resp.status_code}: {(await resp.aread())[:200]!r}")
                return
            first = True
            async for line in resp.aiter_lines():
                if first and line.startswith("data: {") and _has_text(line[6:]):
                    out["ttfts"].append((time.perf_counter() - start) * 1000)
                    first = False
    except httpx.HTTPError as exc:
        out["failures"].append(repr(exc))


async def load(client: httpx.AsyncClient, key: str, *, rate: float, tokens: int, seed: int, seconds: float,
               out: dict) -> None:
    """Poisson arrivals at `rate`/s for `seconds`; returns once every stream ended."""
    rng, tasks = random.Random(seed), []
    ends = next_at = time.perf_counter()
    ends += seconds
    while True:
        next_at += rng.expovariate(rate)
        if next_at >= ends:
            break
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        tasks.append(asyncio.create_task(one_stream(client, key, len(tasks), tokens, out)))
    out["requests"] = len(tasks)
    await asyncio.gather(*tasks)


async def phase(url: str, keys: dict[str, str], loads: dict[str, float], args) -> dict:
    """The named keys' loads at once (key name -> rate); each key's TTFTs and failures, and the phase's window."""
    outs = {name: {"ttfts": [], "failures": []} for name in loads}
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
    seconds = args.flood_s if "heavy" in loads else args.alone_s
    started = time.time()
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        await asyncio.gather(*(load(client, keys[name], rate=rate, tokens=args.tokens, seed=args.seed + n,
                                    seconds=seconds, out=outs[name]) for n, (name, rate) in enumerate(loads.items())))
    return {"outs": outs, "window": (started, started + seconds)}


def lane_intervals(head: Head) -> list[tuple[float, float]]:
    """Each placement's lane time: from its placement to the generation's end, or to the failure or preemption after
    which it was placed again (a preempted generation's wait for its next lane holds none)."""
    out = subprocess.run([sys.executable, "-c", _LANE_TIME], cwd=ROOT, env=head.env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    intervals = []
    for placed, finished, failovers in json.loads(out.strip().splitlines()[-1]):
        if not (placed and finished):
            continue
        starts = [placed, *(again for again, _ in failovers)]
        ends = [*(left for _, left in failovers), finished]
        intervals += [(a, b) for a, b in zip(starts, ends, strict=True) if a and b]
    return intervals


def busy_share(intervals: list[tuple[float, float]], window: tuple[float, float], lanes: int) -> float:
    start, end = window
    busy = sum(max(0.0, min(b, end) - max(a, start)) for a, b in intervals)
    return busy / (lanes * (end - start))


# Each head's waiting room: its order and what preempts.
HEADS = {
    "deadline": {"FLEET_WAITING_ORDER": "deadline", "FLEET_PREEMPTING_CLASSES": "",
                 "FLEET_SHARE_PREEMPTING_CLASSES": ""},
    "fair": {"FLEET_WAITING_ORDER": "fair", "FLEET_PREEMPTING_CLASSES": "high",
             "FLEET_SHARE_PREEMPTING_CLASSES": "normal"},
    "fair_waiting": {"FLEET_WAITING_ORDER": "fair", "FLEET_PREEMPTING_CLASSES": "high",
                     "FLEET_SHARE_PREEMPTING_CLASSES": ""},
}


def run_order(order: str, args) -> dict:
    env = {"FLEET_QUOTA_REQUESTS_PER_MINUTE": "0", "FLEET_QUOTA_CONCURRENT_STREAMS": "0",
           "FLEET_QUOTA_TOKENS_PER_MINUTE": "0", "FLEET_LOG_LEVEL": "WARNING", "FLEET_DEFAULT_DEADLINE_MS": "600000",
           **HEADS[order]}
    head = make_head(Path(tempfile.mkdtemp(prefix=f"fleet-bench-fairness-{order}-")), extra_env=env)
    made = subprocess.run([sys.executable, "-c", _MAKE_KEYS % json.dumps(KEYS)], cwd=ROOT, env=head.env,
                          capture_output=True, text=True, timeout=120, check=True).stdout
    keys = json.loads(made.strip().splitlines()[-1])
    head.start()
    node = start_mock_node(head, f"fairness-{order}", lanes=args.lanes, decode_tps=args.decode_tps,
                           decode_slowdown_ms=0.0)
    try:
        head.wait_nodes(1, timeout=120)
        heavy = args.light_rate * 10
        alone = asyncio.run(phase(head.url, keys, {"light": args.light_rate, "high": args.light_rate}, args))
        flood = asyncio.run(phase(head.url, keys, {"heavy": heavy, "light": args.light_rate}, args))
        high_flood = asyncio.run(phase(head.url, keys, {"heavy": heavy, "high": args.light_rate}, args))
        intervals = lane_intervals(head)
    finally:
        node.stop()
        head.stop()
    result = {
        "light_alone": alone["outs"]["light"]["ttfts"], "high_alone": alone["outs"]["high"]["ttfts"],
        "light_flood": flood["outs"]["light"]["ttfts"], "high_flood": high_flood["outs"]["high"]["ttfts"],
        "heavy_flood": flood["outs"]["heavy"]["ttfts"],
        "busy_share": busy_share(intervals, flood["window"], args.lanes),
        "busy_share_high_flood": busy_share(intervals, high_flood["window"], args.lanes),
        "requests": {f"{p}.{k}": o["requests"] for p, run in (("alone", alone), ("flood", flood),
                                                               ("high_flood", high_flood))
                     for k, o in run["outs"].items()},
        "failures": [f for run in (alone, flood, high_flood) for o in run["outs"].values() for f in o["failures"]],
    }
    print(f"{order}: light ttft p50 alone {percentile(result['light_alone'], 0.5):.0f} ms, under the flood "
          f"{percentile(result['light_flood'], 0.5):.0f} ms; lanes busy {result['busy_share']:.3f}; high p50 alone "
          f"{percentile(result['high_alone'], 0.5):.0f} ms, under the flood {percentile(result['high_flood'], 0.5):.0f}"
          f" ms; {len(result['failures'])} failures", flush=True)
    return result


def report(runs: dict[str, dict], args) -> dict:
    deadline, fair, waiting = runs["deadline"], runs["fair"], runs["fair_waiting"]

    def ms(values: list[float], q: float) -> float:
        return round(percentile(values, q), 1)

    return {
        "light_ttft_ms_p50": {"alone": ms(fair["light_alone"], 0.5), "deadline_order": ms(deadline["light_flood"], 0.5),
                              "fair": ms(fair["light_flood"], 0.5)},
        "light_ttft_ms_p95": {"alone": ms(fair["light_alone"], 0.95), "deadline_order": ms(deadline["light_flood"],
                                                                                            0.95),
                              "fair": ms(fair["light_flood"], 0.95)},
        "lane_busy_share": {"deadline_order": round(deadline["busy_share"], 3), "fair": round(fair["busy_share"], 3)},
        "high_priority_ttft_ms_p50": {"alone": ms(fair["high_alone"], 0.5), "under_flood": ms(fair["high_flood"], 0.5)},
        "details": {
            "light_ttft_ms_p50_alone_on_the_deadline_head": ms(deadline["light_alone"], 0.5),
            "fair_waiting": {"light_ttft_ms_p50": {"alone": ms(waiting["light_alone"], 0.5),
                                                   "flood": ms(waiting["light_flood"], 0.5)},
                             "light_ttft_ms_p95_flood": ms(waiting["light_flood"], 0.95),
                             "lane_busy_share": round(waiting["busy_share"], 3),
                             "heavy_ttft_ms_p50": ms(waiting["heavy_flood"], 0.5)},
            "high_priority_ttft_ms_p50_without_preemption": {"alone": ms(deadline["high_alone"], 0.5),
                                                             "under_flood": ms(deadline["high_flood"], 0.5)},
            "heavy_ttft_ms_p50": {"deadline_order": ms(deadline["heavy_flood"], 0.5),
                                  "fair": ms(fair["heavy_flood"], 0.5)},
            "lane_busy_share_high_flood": {"deadline_order": round(deadline["busy_share_high_flood"], 3),
                                           "fair": round(fair["busy_share_high_flood"], 3)},
            "requests": {order: run["requests"] for order, run in runs.items()},
            "failures": {order: len(run["failures"]) for order, run in runs.items()},
            "setup": {"lanes": args.lanes, "decode_tps": args.decode_tps, "tokens": args.tokens,
                      "light_rate": args.light_rate, "heavy_rate": args.light_rate * 10,
                      "capacity_per_s": round(args.lanes * args.decode_tps / args.tokens, 2),
                      "alone_s": args.alone_s, "flood_s": args.flood_s, "cpus": os.cpu_count(),
                      "machine": platform.machine(), "python": platform.python_version(),
                      "when": datetime.now().isoformat(timespec="seconds")},
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lanes", type=int, default=8)
    parser.add_argument("--decode-tps", type=float, default=40.0, help="each mock lane's tokens per second")
    parser.add_argument("--tokens", type=int, default=16, help="tokens each request asks for")
    parser.add_argument("--light-rate", type=float, default=2.2, help="the light key's requests a second; the heavy "
                        "key sends ten times this")
    parser.add_argument("--alone-s", type=float, default=15.0)
    parser.add_argument("--flood-s", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=37)
    args = parser.parse_args()
    print(f"bench/fairness.py: 1 mock node x {args.lanes} lanes at {args.decode_tps:g} tok/s a lane, {args.tokens} "
          f"tokens a request (about {args.lanes * args.decode_tps / args.tokens:.1f} generations/s); light "
          f"{args.light_rate:g}/s, heavy {args.light_rate * 10:g}/s", flush=True)
    runs = {order: run_order(order, args) for order in HEADS}
    result = report(runs, args)
    for order, run in runs.items():
        for failure in run["failures"][:3]:
            print(f"failure ({order}):", failure)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    light, busy, high = result["light_ttft_ms_p50"], result["lane_busy_share"], result["high_priority_ttft_ms_p50"]
    waiting = result["details"]["fair_waiting"]["light_ttft_ms_p50"]
    print(f"light p50 fair/alone {light['fair'] / light['alone']:.2f} (target <= 1.5; without share preemption "
          f"{waiting['flood'] / waiting['alone']:.2f}), deadline order/alone "
          f"{light['deadline_order'] / light['alone']:.2f}; lanes busy fair/deadline order "
          f"{busy['fair'] / busy['deadline_order']:.3f} (target >= 0.98); high p50 under the flood/alone "
          f"{high['under_flood'] / high['alone']:.2f} (target <= 1.2)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
