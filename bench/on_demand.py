"""On-demand models against a fixed assignment: three models, two nodes that hold two of them at a time, a workload
that shifts between the models, side by side in one run.

One real head (daphne) with the bundled SmolLM2 file in its registry under three names (each pulled by name, so a
node's first load of one really pulls its 98 MB over the head's blob API), and two mock-engine nodes in processes of
their own, each with a --memory-budget that holds one on-demand model (2 lanes x 1,024 tokens: 157 MB needed, 146 MB
held): the fleet holds two of the three at a time. Loading takes --load-s on the mock engine (a real engine's load).
The workload is open-loop: streaming chat requests arrive at random (Poisson) at --rate a second for --phases phases of
--phase-s seconds; in phase k, 80% ask for model k mod 3 and 20% for model k+1 mod 3, so the hot pair shifts.

1. on_demand: the three models on demand (keep-alive 15 minutes), no node serving any at the start.
2. fixed:     a fresh head and nodes; a deployment each puts model 0 on one node and model 1 on the other (waited for
              before the load starts); model 2 has no node, so its requests fail (404) as they would for a model an
              operator did not place.

Reported for each, from the client's clock and the head's generation records (placement.queue.loading says a
request waited for a load, and on which node):
- ttft_ms_p50: cold (the first request that waited for a model's load on a node that had to pull it), warm (the first
  that waited for a load of a file the node held already), hot (requests whose model was served);
- loads_per_min, unloads_per_min (fleet_on_demand_changes_total over the workload's run);
- waited_for_load_share (requests that waited for a load), failed_share (requests that got no answer).

    .venv/bin/python bench/on_demand.py [--rate 2] [--phases 6] [--phase-s 15] [--load-s 1]

Writes bench/results/on_demand.json as {"ttft_ms_p50": {"cold": a, "warm": b, "hot": c}, "loads_per_min": l,
"unloads_per_min": u, "waited_for_load_share": w, "failed_share": f, "fixed_assignment": {...the same figures...}}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from nodes.agent.engine.local import bundled_model_path  # noqa: E402
from tests.live import make_head, wait_for  # noqa: E402
from tests.mock_node import start_mock_node  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "on_demand.json"
MODELS = ("od-0", "od-1", "od-2")
BUDGET = 210_000_000  # one on-demand model (157 MB needed free, 146 MB held), not two
NODES = ("bench-a", "bench-b")


def p50(values: list[float]) -> float | None:
    return round(statistics.median(values), 1) if values else None


def start_fleet(tmp: Path, load_s: float):
    head = make_head(tmp, extra_env={"FLEET_ON_DEMAND_LANES": "2", "FLEET_ON_DEMAND_CONTEXT": "1024",
                                     "FLEET_HEARTBEAT_S": "1"})
    for name in MODELS:
        head.manage("model_add", bundled_model_path(), "--name", name)
    head.start()
    nodes = [start_mock_node(head, identity, model=f"base-{identity}", lanes=2, decode_tps=50, load_s=load_s,
                             options={"memory_budget": BUDGET, "offline": False}) for identity in NODES]
    head.wait_nodes(len(nodes), timeout=120)
    return head, nodes


def rest(head) -> httpx.Client:
    return httpx.Client(base_url=head.url, headers={"Authorization": f"Bearer {head.api_key}"}, timeout=60)


def served(head) -> set[str]:
    with rest(head) as client:
        return {m["id"] for m in client.get("/v1/models").json()["data"]}


def changes(head) -> dict[str, float]:
    """load / unload -> how many, from /metrics."""
    text = httpx.get(f"{head.url}/metrics", headers={"Authorization": f"Bearer {head.env['FLEET_METRICS_TOKEN']}"}).text
    out = {"load": 0.0, "unload": 0.0}
    for labels, value in re.findall(r"^fleet_on_demand_changes_total\{(.*?)\} (\S+)$", text, re.M):
        out[dict(re.findall(r'(\w+)="([^"]*)"', labels))["change"]] += float(value)
    return out


async def one(client: httpx.AsyncClient, key: str, model: str, i: int, rows: list[dict]) -> None:
    body = {"model": model, "stream": True, "max_tokens": 8, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Question {i} for {model}"}]}
    start = time.perf_counter()
    row = {"model": model, "start": start, "ttft_ms": None, "gen": None}
    rows.append(row)
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body,
                                 headers={"Authorization": f"Bearer {key}"}) as resp:
            row["gen"] = resp.headers.get("x-fleet-generation")
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                row["error"] = f"{resp.status_code} {json.loads(body).get('error', {}).get('code', '')}"
                return
            async for line in resp.aiter_lines():
                if row["ttft_ms"] is None and line.startswith("data: {") and '"content":"' in line \
                        and '"content":""' not in line:
                    row["ttft_ms"] = (time.perf_counter() - start) * 1000
                if line.startswith("data: {") and '"error"' in line:
                    row["error"] = json.loads(line[6:])["error"].get("code", "stream error")
    except httpx.HTTPError as exc:
        row["error"] = repr(exc)


async def workload(head, *, rate: float, phases: int, phase_s: float, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows: list[dict] = []
    tasks = []
    async with httpx.AsyncClient(base_url=head.url, timeout=300) as client:
        begin = time.monotonic()
        i = 0
        for phase in range(phases):
            end = begin + (phase + 1) * phase_s
            while (now := time.monotonic()) < end:
                main, other = MODELS[phase % 3], MODELS[(phase + 1) % 3]
                tasks.append(asyncio.create_task(one(client, head.api_key, main if rng.random() < 0.8 else other,
                                                     i, rows)))
                i += 1
                await asyncio.sleep(min(rng.expovariate(rate), max(end - now, 0)))
        await asyncio.gather(*tasks)
    return rows


def records(head, rows: list[dict]) -> None:
    """Each row's record: the node it ran on and whether it waited for a load (placement.queue.loading)."""
    with rest(head) as client:
        for row in rows:
            if row["gen"] is None or row.get("error"):
                continue
            for _ in range(50):
                answer = client.get(f"/api/generations/{row['gen']}/")
                if answer.status_code == 200:
                    body = answer.json()
                    row["node"] = body["node_identity"]
                    row["loading"] = (body.get("placement") or {}).get("queue", {}).get("loading")
                    break
                time.sleep(0.1)


def figures(rows: list[dict], moved: dict[str, float], minutes: float) -> dict:
    """The report's figures; a load is cold when it was the first of that model on that node (it pulled)."""
    pulled: set[tuple[str, str]] = set()
    cold, warm, hot, waited = [], [], [], 0
    load_end: dict[tuple[str, str], float] = {}  # (model, node) -> when the requests of its current load were placed
    for row in sorted(rows, key=lambda r: r.get("loading", {}).get("since", 0) if r.get("loading") else r["start"]):
        if row["ttft_ms"] is None:
            continue
        loading = row.get("loading")
        if not loading:
            hot.append(row["ttft_ms"])
            continue
        waited += 1
        key, placed_at = (row["model"], loading["node"]), loading["since"] + loading["ms"] / 1000
        if loading["since"] <= load_end.get(key, -1.0):  # began waiting before that load was done: the same load
            load_end[key] = max(load_end[key], placed_at)
            continue
        load_end[key] = placed_at  # the first request of a load: only these are counted as cold or warm
        (warm if key in pulled else cold).append(row["ttft_ms"])
        pulled.add(key)
    total = len(rows) or 1
    return {"ttft_ms_p50": {"cold": p50(cold), "warm": p50(warm), "hot": p50(hot)},
            "loads_per_min": round(moved["load"] / minutes, 2), "unloads_per_min": round(moved["unload"] / minutes, 2),
            "waited_for_load_share": round(waited / total, 3),
            "failed_share": round(sum(1 for r in rows if r["ttft_ms"] is None) / total, 3),
            "failures": dict(Counter(str(r.get("error", "no token")) for r in rows if r["ttft_ms"] is None)),
            "requests": len(rows), "loads_counted": {"cold": len(cold), "warm": len(warm)}}


def run(mode: str, args) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bench-on-demand-{mode}-") as tmp:
        head, nodes = start_fleet(Path(tmp), args.load_s)
        try:
            with rest(head) as client:
                ids = {m["name"]: m["id"] for m in client.get("/api/models/").json()["results"]}
                if mode == "on_demand":
                    for name in MODELS:
                        assert client.patch(f"/api/models/{ids[name]}/", json={"on_demand": True}).status_code == 200
                else:
                    for name, node in zip(MODELS[:2], NODES, strict=True):
                        made = client.post("/api/deployments/", json={"model": name, "nodes": [node], "lanes": 2,
                                                                      "context": 1024})
                        assert made.status_code == 201, made.text
                    wait_for(lambda: set(MODELS[:2]) <= served(head), 180, "the fixed assignment never loaded")
            before = changes(head)
            started = time.monotonic()
            rows = asyncio.run(workload(head, rate=args.rate, phases=args.phases, phase_s=args.phase_s,
                                        seed=args.seed))
            minutes = (time.monotonic() - started) / 60
            after = changes(head)
            records(head, rows)
            return figures(rows, {k: after[k] - before[k] for k in after}, minutes)
        finally:
            for node in nodes:
                node.stop()
            head.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=2.0, help="requests a second")
    parser.add_argument("--phases", type=int, default=6)
    parser.add_argument("--phase-s", type=float, default=15.0)
    parser.add_argument("--load-s", type=float, default=1.0, help="the mock engine's load time")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    report = run("on_demand", args)
    report["fixed_assignment"] = run("fixed", args)
    report["setup"] = {"rate": args.rate, "phases": args.phases, "phase_s": args.phase_s, "load_s": args.load_s,
                       "models": list(MODELS), "nodes": list(NODES), "memory_budget_bytes": BUDGET,
                       "machine": platform.platform(), "at": datetime.now().isoformat(timespec="seconds")}
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    od, fixed = report, report["fixed_assignment"]
    print(f"failed share: on demand {od['failed_share']:.3f} vs fixed {fixed['failed_share']:.3f}; hot TTFT p50 "
          f"{od['ttft_ms_p50']['hot']} vs {fixed['ttft_ms_p50']['hot']} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
