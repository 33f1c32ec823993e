"""The head under hundreds of streams: one head process, then two and four, against the mock nodes alone and a proxy.

Eight fast mock nodes (64 lanes each, --tps decode steps a second: each busy lane gets a token a step) run in
processes of their own, and 100, 500 and 1,000 streaming clients run closed-loop (a stream that ends starts the
next), in client processes of their own. Side by side in one run, at each stream count:

- direct: the same mock engine in bare node processes (bench/scale_load.py node) streaming straight to the clients,
  with no head: the nodes' own rate, and the time to first token and chunk gaps they give by themselves;
- proxy:  the same, through a minimal streaming reverse proxy written for the bench (bench/scale_load.py proxy):
  the cost of relaying alone;
- head:   the real head (daphne; SQLite and the in-memory layer for one process; with several, SQLite shared and a
  redis-server of the bench's own), the mock nodes joined over the encrypted link, half the clients on SSE
  (/v1/chat/completions) and half on the client websocket (/ws/v1/generate); with several heads each node is given
  one head and links every one (it learns the others there), and the clients are spread over every head.

Where the machine has two cores or more, the box in the middle (the proxy, or the one head) runs on a core of its
own and the nodes, the clients and this script on the others, so that its figures are its own work and not the
scheduler's (two heads, or --shared: every process on any core). The JSON says which (`head_core_own`,
`setup.cores`).

Reported per run: relayed tokens/s as the clients counted them; head CPU seconds per 1,000 tokens (the daphne
processes' user + system time over the window); added time to first token p50 and added chunk gap p99 (the head's,
less the direct run's at the same stream count: what the node sent); with several heads, the Redis round trips a
generation (RedisCounter). Targets at 500 streams, one head: >= 0.95x the nodes' own tok/s, <= 50 ms added gap p99,
<= 100 ms added TTFT p50, >= 0.9x the proxy's tok/s, < 0.05 CPU s per 1,000 tokens; with several heads: their CPU a
token summed <= 1.15x one head's, and <= 2 Redis round trips a generation. The JSON says how many cores the head
had and the load average; a target this machine cannot reach is reported as not met, with the reason.

    .venv/bin/python bench/scale.py [--quick] [--streams 100,500,1000] [--heads 1,1r,2,4] [--seconds 20] [--tokens 100]
                                    [--out FILE]
                                    [--profile DIR] [--shared]

Writes bench/results/scale.json as {"runs": [{"streams", "heads", "direct_tok_s", "proxy_tok_s", "head_tok_s",
"head_cpu_s_per_1k_tok", "added_ttft_ms_p50", "added_gap_ms_p99", ...}], "targets_met": ..., ...}. With --profile,
each head process runs under cProfile and writes DIR/head-<n>.prof when it stops.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fleet.daphne_options import daphne_limit_args  # noqa: E402
from tests.live import PYTHON, Head, free_port, make_head, make_peer_head, wait_for  # noqa: E402
from tests.mock_node import start_mock_node  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "scale.json"
LOAD = str(ROOT / "bench" / "scale_load.py")
NO_QUOTAS = {name: "0" for name in ("FLEET_QUOTA_REQUESTS_PER_MINUTE", "FLEET_QUOTA_TOKENS_PER_MINUTE",
                                    "FLEET_QUOTA_CONCURRENT_STREAMS")}
TARGETS = {"direct_ratio": 0.95, "added_gap_ms_p99": 50, "added_ttft_ms_p50": 100, "proxy_ratio": 0.9,
           "head_cpu_s_per_1k_tok": 0.05, "cpu_ratio": 1.15, "round_trips": 2}


def percentile(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))], 1) if ordered else None


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far (/proc/<pid>/stat fields 14 and 15)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


class Cores:
    """Which cores the processes run on. Pinned (the default where there are at least two), the box in the middle
    (the proxy, or the one head) runs on a core of its own and everything else (the nodes, the clients, this script)
    on the rest, so the middle box's figures are its own, not the scheduler's. Shared (`--shared`, and always with
    two heads), all run on any core."""

    def __init__(self, pin: bool):
        self.all = set(os.sched_getaffinity(0))
        self.pinned = pin and len(self.all) >= 2
        last = max(self.all)
        self.own, self.rest = ({last}, self.all - {last}) if self.pinned else (self.all, self.all)

    def phase(self, boxes: int) -> _affinity:
        """A context for a phase with `boxes` middle boxes: the processes started in it run on the rest."""
        return _affinity(self.rest if boxes == 1 else self.all)

    def middle(self, boxes: int) -> _affinity:
        """A context in which the processes started run on the middle box's core."""
        return _affinity(self.own if boxes == 1 else self.all)


class _affinity:
    def __init__(self, cpus: set[int]):
        self.cpus = cpus

    def __enter__(self):
        self.before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, self.cpus)  # a child inherits it when it starts

    def __exit__(self, *exc):
        os.sched_setaffinity(0, self.before)


def spawn(*args: str) -> subprocess.Popen:
    proc = subprocess.Popen([PYTHON, LOAD, *args], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError(f"bench/scale_load.py {args[0]} did not start")
    return proc


def distinct_ports(n: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(free_port())
    return sorted(ports)


def stop(procs: list) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


class RedisCounter:
    """A Redis server of the bench's own (the machine's may serve others too), and what it was asked over a window.

    Round trips are counted with MONITOR (tests/redis_monitor.py: each command a client sent, a MULTI ... EXEC block
    as one, a script's own commands left out), by kind: `redis_round_trips_per_generation` every subsystem's (the
    placement's choose and finish, the quotas, the metrics, the revocation stamp, heartbeats and head beats, the
    channel layer's control) over the generations, `redis_placement_round_trips_per_generation` the placement
    state's alone (its scripts and its `pl:` keys), `redis_round_trips_by_kind` each kind's. INFO commandstats counts a
    script's inner commands as well: `redis_commands_per_generation`, before/after."""

    def __init__(self, tmp: Path) -> None:
        import redis

        from tests.redis_monitor import Monitor

        self.port = free_port()
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--save", "", "--appendonly", "no",
                                      "--dir", str(tmp)], stdout=subprocess.DEVNULL, start_new_session=True)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.r = redis.Redis.from_url(self.url)
        wait_for(self._up, 20, "the bench's redis-server did not start")
        self.monitor = Monitor(self.r, db=0, prefix="")

    def _up(self) -> bool:
        try:
            return bool(self.r.ping())
        except Exception:  # redis.ConnectionError: not up yet
            return False

    def start(self) -> None:
        """Count what clients send from now until `stop_counting`."""
        self._calls0 = self.calls()
        self.monitor.start()

    def stop_counting(self) -> None:
        """The window's end: what came after it (the clients cancelling the streams they had open) is not counted."""
        self.kinds, self._calls1 = self.monitor.stop(), self.calls()

    def per_generation(self, generations: float) -> dict:
        from fleet.placement_lua import SCRIPTS

        kinds, calls1 = self.kinds, self._calls1
        per = max(generations, 1)
        delta = {k: v - self._calls0.get(k, 0) for k, v in calls1.items() if v - self._calls0.get(k, 0) > 0}
        delta.pop("monitor", None)

        def placement(kind: str) -> bool:
            return " pl:" in kind or "[pl:" in kind or kind.split(" ")[-1] in SCRIPTS

        return {"redis_round_trips_per_generation": round(sum(kinds.values()) / per, 2),
                "redis_placement_round_trips_per_generation": round(
                    sum(n for k, n in kinds.items() if placement(k)) / per, 2),
                "redis_round_trips_by_kind": {k: round(n / per, 3) for k, n in kinds.most_common()},
                "redis_commands_per_generation": round(sum(delta.values()) / per, 2),
                "redis_commands": dict(sorted(delta.items(), key=lambda kv: -kv[1])[:12])}

    def calls(self) -> dict[str, int]:
        return {name.removeprefix("cmdstat_"): int(stat["calls"])
                for name, stat in self.r.info("commandstats").items()}

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def measure(args, tmp: Path, groups: list[tuple[str, list[str], str]], pids: list[int],
            redis_counter: RedisCounter | None = None) -> dict:
    """Run client processes (mode, targets, key) for one window; what they saw, and the CPU `pids` spent in it."""
    start = time.time() + args.warmup
    per = max(args.streams_now // len(groups), 1)
    procs, outs = [], []
    for n, (mode, targets, key) in enumerate(groups):
        outs.append(tmp / f"clients-{n}-{time.monotonic_ns()}.json")
        procs.append(subprocess.Popen([PYTHON, LOAD, "clients", "--mode", mode, "--targets", ",".join(targets),
                                       "--streams", str(per), "--tokens", str(args.tokens), "--start", str(start),
                                       "--seconds", str(args.seconds), "--key", key, "--out", str(outs[-1])],
                                      cwd=ROOT, start_new_session=True))
    time.sleep(max(start - time.time(), 0))
    cpu0, load0 = cpu_seconds(pids), os.getloadavg()[0]
    if redis_counter:
        redis_counter.start()
    time.sleep(max(start + args.seconds - time.time(), 0))
    cpu1, load1 = cpu_seconds(pids), os.getloadavg()[0]
    if redis_counter:
        redis_counter.stop_counting()
    for proc in procs:
        proc.wait(120)
    seen = [json.loads(out.read_text()) for out in outs]
    tokens = sum(s["tokens"] for s in seen)
    errors: dict[str, int] = {}
    for s in seen:
        for k, v in s["errors"].items():
            errors[k] = errors.get(k, 0) + v
    time.sleep(args.settle)  # let the cancelled streams drain before the next run
    generations = tokens / args.tokens  # each asks for --tokens (ignore_eos): the generations' worth in the window
    # Redis's calls are per generation ended in the window: under saturation a generation outlasts the warmup, and
    # the first wave's ends (and the next wave's choices) fall in the window, more than its tokens' worth
    ended = sum(s.get("ended", 0) for s in seen)
    redis = redis_counter.per_generation(ended or generations) if redis_counter else {
        "redis_round_trips_per_generation": 0, "redis_placement_round_trips_per_generation": 0,
        "redis_commands_per_generation": 0}
    return {"tok_s": round(tokens / args.seconds, 1), "tokens": tokens, "generations": round(generations, 1),
            "generations_ended": ended,
            **redis,
            "cpu_s": round(cpu1 - cpu0, 2), "load_avg_1m": [round(load0, 2), round(load1, 2)],
            "ttft_ms_p50": percentile([t for s in seen for t in s["ttfts"]], 0.5),
            "gap_ms_p99": percentile([g for s in seen for g in s["gaps"]], 0.99),
            "gap_ms_p999": percentile([g for s in seen for g in s["gaps"]], 0.999),
            "gap_ms_max": max((g for s in seen for g in s["gaps"]), default=None),
            "gap_ms_p50": percentile([g for s in seen for g in s["gaps"]], 0.5), "errors": errors,
            **handshake_figures([h for s in seen for h in s.get("handshakes", [])])}


def handshake_figures(handshakes: list[float]) -> dict:
    """The websocket clients' opening handshakes (most at the warmup's start, when every client dials at once)."""
    if not handshakes:
        return {}
    return {"ws_handshakes": len(handshakes), "ws_handshake_ms_p50": percentile(handshakes, 0.5),
            "ws_handshake_ms_p99": percentile(handshakes, 0.99), "ws_handshake_ms_max": round(max(handshakes), 1)}


def bare_phase(args, tmp: Path) -> dict[int, dict[str, dict]]:
    """direct and proxy at every stream count: bare mock nodes, then the same through the minimal proxy."""
    with args.cores.phase(1):
        return _bare_phase(args, tmp)


def _bare_phase(args, tmp: Path) -> dict[int, dict[str, dict]]:
    ports = distinct_ports(args.nodes + 1)  # free_port alone gave two nodes one port (the second did not start)
    proxy_port = ports.pop()
    nodes = [spawn("node", "--port", str(p), "--lanes", str(args.lanes), "--tps", str(args.tps)) for p in ports]
    with args.cores.middle(1):
        proxy = spawn("proxy", "--port", str(proxy_port), "--upstreams", ",".join(f"127.0.0.1:{p}" for p in ports))
    out: dict[int, dict[str, dict]] = {}
    try:
        for streams in args.streams:
            args.streams_now = streams
            direct = [("raw", [f"127.0.0.1:{p}" for p in ports], "")] * 2
            out[streams] = {"direct": measure(args, tmp, direct, [n.pid for n in nodes])}
            via = [("raw", [f"127.0.0.1:{proxy_port}"], "")] * 2
            out[streams]["proxy"] = measure(args, tmp, via, [proxy.pid])
            print(f"{streams} streams: direct {out[streams]['direct']['tok_s']} tok/s, "
                  f"proxy {out[streams]['proxy']['tok_s']} tok/s", flush=True)
    finally:
        stop([proxy, *nodes])
    return out


def start_head(head: Head, profile: Path | None, n: int) -> None:
    """As Head.start, optionally under cProfile (the event loop runs on daphne's main thread)."""
    head.log_path = head.home / f"daphne-{head.port}.log"
    wrap = ["-m", "cProfile", "-o", str(profile / f"head-{n}.prof")] if profile else []
    head.proc = subprocess.Popen([PYTHON, *wrap, "-m", "daphne", "-b", "127.0.0.1", "-p", str(head.port),
                                  *daphne_limit_args(), "fleet.asgi:application"], cwd=ROOT, env=head.env,
                                 stdout=open(head.log_path, "ab"), stderr=subprocess.STDOUT,  # noqa: SIM115
                                 start_new_session=True)
    wait_for(lambda: head.health() is not None, 60, f"head on port {head.port} did not start: {head.log()}")


def head_phase(args, tmp: Path, heads_n: int, on_redis: bool) -> dict[int, dict]:
    with args.cores.phase(heads_n):
        return _head_phase(args, tmp, heads_n, on_redis)


def _head_phase(args, tmp: Path, heads_n: int, on_redis: bool) -> dict[int, dict]:
    env = dict(NO_QUOTAS)
    counter = RedisCounter(tmp) if on_redis else None
    if counter is not None:
        env["REDIS_URL"] = counter.url
    heads = [make_head(tmp, extra_env=env)]
    heads += [make_peer_head(heads[0], tmp) for _ in range(heads_n - 1)]
    nodes = []
    out: dict[int, dict] = {}
    try:
        with args.cores.middle(heads_n):
            for n, head in enumerate(heads):
                start_head(head, args.profile, heads_n * 10 + n)
        for i in range(args.nodes):  # each given one head: it learns the others there and links every one
            nodes.append(start_mock_node(heads[i % heads_n], f"scale-{i}", lanes=args.lanes, decode_tps=args.tps))
        for head in heads:
            head.wait_nodes(args.nodes, timeout=180)
        if counter is not None:
            counter.monitor.prefix = heads[0].env["FLEET_REDIS_PREFIX"]
        targets = [h.address for h in heads]
        pids = [h.proc.pid for h in heads]
        for streams in args.streams:
            args.streams_now = streams
            groups = [("sse", targets, heads[0].api_key), ("ws", targets, heads[0].api_key)]
            out[streams] = measure(args, tmp, groups, pids, counter)
            out[streams]["head_cores"] = len(os.sched_getaffinity(pids[0]))
            out[streams]["pinned"] = args.cores.pinned and heads_n == 1
            where = " on Redis" if on_redis else ""
            print(f"{streams} streams, {heads_n} head(s){where}: {out[streams]['tok_s']} tok/s, "
                  f"{out[streams]['cpu_s']} CPU s, errors {out[streams]['errors']}", flush=True)
    finally:
        for node in nodes:
            node.stop()
        for head in heads:
            head.stop()
        if counter is not None:
            counter.stop()
    return out


def row(streams: int, heads: int, on_redis: bool, bare: dict[str, dict], head: dict) -> dict:
    direct, proxy = bare["direct"], bare["proxy"]

    def added(key: str) -> float | None:
        return round(head[key] - direct[key], 1) if head[key] is not None and direct[key] is not None else None

    return {"streams": streams, "heads": heads, "redis": on_redis,
            "direct_tok_s": direct["tok_s"], "proxy_tok_s": proxy["tok_s"],
            "head_tok_s": head["tok_s"],
            "head_cpu_s_per_1k_tok": round(head["cpu_s"] / head["tokens"] * 1000, 4) if head["tokens"] else None,
            "added_ttft_ms_p50": added("ttft_ms_p50"), "added_gap_ms_p99": added("gap_ms_p99"),
            "added_gap_ms_p999": added("gap_ms_p999"),
            "redis_round_trips_per_generation": head["redis_round_trips_per_generation"],
            "redis_placement_round_trips_per_generation": head.get("redis_placement_round_trips_per_generation", 0),
            "head_cores": head["head_cores"], "head_core_own": head["pinned"], "load_avg_1m": head["load_avg_1m"],
            "detail": {"direct": direct, "proxy": proxy, "head": head}}


def targets_met(runs: list[dict], cores: int) -> dict:
    """The targets (issue 17's latency ones, issue 32's scale-out ones), each with its value and, when not met, why."""
    run = next((r for r in runs if r["streams"] == 500 and r["heads"] == 1 and not r["redis"]), None)
    if run is None:
        return {"all": False, "reason": "no run at 500 streams with one head (--quick or --streams left it out)"}
    checks = {
        "direct_ratio": (round(run["head_tok_s"] / max(run["direct_tok_s"], 1), 3),
                         run["head_tok_s"] >= TARGETS["direct_ratio"] * run["direct_tok_s"]),
        "added_gap_ms_p99": (run["added_gap_ms_p99"], (run["added_gap_ms_p99"] or 1e9) <= TARGETS["added_gap_ms_p99"]),
        "added_ttft_ms_p50": (run["added_ttft_ms_p50"],
                              (run["added_ttft_ms_p50"] or 1e9) <= TARGETS["added_ttft_ms_p50"]),
        "proxy_ratio": (round(run["head_tok_s"] / max(run["proxy_tok_s"], 1), 3),
                        run["head_tok_s"] >= TARGETS["proxy_ratio"] * run["proxy_tok_s"]),
        "head_cpu_s_per_1k_tok": (run["head_cpu_s_per_1k_tok"],
                                  (run["head_cpu_s_per_1k_tok"] or 1e9) < TARGETS["head_cpu_s_per_1k_tok"]),
    }
    for r in runs:  # several heads: their CPU a token summed, against one head's at the same stream count
        one = next((o for o in runs if o["heads"] == 1 and not o["redis"] and o["streams"] == r["streams"]), None)
        one_redis = next((o for o in runs if o["heads"] == 1 and o["redis"] and o["streams"] == r["streams"]), None)
        if r["heads"] > 1 and one and one["head_cpu_s_per_1k_tok"] and r["head_cpu_s_per_1k_tok"]:
            ratio = round(r["head_cpu_s_per_1k_tok"] / one["head_cpu_s_per_1k_tok"], 3)
            checks[f"cpu_ratio_{r['heads']}_heads_{r['streams']}"] = (ratio, ratio <= TARGETS["cpu_ratio"])
        if r["heads"] > 1 and one_redis and one_redis["head_cpu_s_per_1k_tok"] and r["head_cpu_s_per_1k_tok"]:
            # against one head on the same Redis: what more processes cost, the shared state's own cost aside
            ratio = round(r["head_cpu_s_per_1k_tok"] / one_redis["head_cpu_s_per_1k_tok"], 3)
            checks[f"cpu_ratio_over_one_on_redis_{r['heads']}_heads_{r['streams']}"] = (ratio,
                                                                                       ratio <= TARGETS["cpu_ratio"])
        if r["redis"]:  # every Redis call a generation (timers' included), and the placement's alone
            for kind in ("redis_round_trips", "redis_placement_round_trips"):
                trips = r[f"{kind}_per_generation"]
                checks[f"{kind}_{r['heads']}_heads_{r['streams']}"] = (trips, trips <= TARGETS["round_trips"])
    target = {"cpu_ratio": TARGETS["cpu_ratio"], "redis_round_trips": TARGETS["round_trips"],
              "redis_placement_round_trips": TARGETS["round_trips"]}
    out = {name: {"value": value, "target": TARGETS.get(name, target.get(name.rsplit("_", 3)[0])), "met": met}
           for name, (value, met) in checks.items()}
    busy = [k for k, v in out.items() if not v["met"] and "reason" not in v]
    where = (f"the head on a core of its own, the {run['streams']} clients and the nodes on the other {cores - 1}"
             if run["head_core_own"] else f"the head sharing {cores} cores with {run['streams']} clients and the nodes")
    for name in busy:
        out[name]["reason"] = f"measured with {where} (load average {run['load_avg_1m'][1]})"
    out["all"] = all(v["met"] for v in out.values() if isinstance(v, dict))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100 and 500 streams, 8 s windows")
    parser.add_argument("--streams", default="100,500,1000")
    parser.add_argument("--heads", default="1,1r,2,4", help="head processes a run; 1r: one head on Redis")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=8.0, help="seconds before the window opens")
    parser.add_argument("--settle", type=float, default=3.0)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--lanes", type=int, default=64)
    parser.add_argument("--tps", type=float, default=40.0, help="each mock node's decode steps a second")
    parser.add_argument("--tokens", type=int, default=100, help="tokens each generation asks for")
    parser.add_argument("--profile", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"where the JSON goes (default {RESULTS.name})")
    parser.add_argument("--shared", action="store_true",
                        help="run the proxy and the head on any core, not on one of their own")
    args = parser.parse_args()
    args.cores = Cores(pin=not args.shared)
    if args.quick:
        args.streams, args.seconds, args.warmup = "100,500", 8.0, 6.0
    args.streams = [int(s) for s in args.streams.split(",")]
    # "1r": one head on the bench's Redis (the fleet-wide state as several heads use it), beside "1" on the default
    heads = [(int(h.rstrip("r")), h.endswith("r") or int(h.rstrip("r")) > 1) for h in args.heads.split(",")]
    for name in ("REDIS_URL", "DATABASE_URL"):
        os.environ.pop(name, None)  # one head: the embedded default; more: SQLite shared, the bench's own Redis
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="fleet-bench-scale-"))
    bare = bare_phase(args, tmp)
    runs = [row(s, h, on_redis, bare[s], result) for h, on_redis in heads
            for s, result in head_phase(args, tmp, h, on_redis).items()]
    cores = os.cpu_count() or 1
    result = {"runs": runs, "targets_met": targets_met(runs, cores),
              "setup": {"nodes": args.nodes, "lanes": args.lanes, "decode_tps": args.tps, "tokens": args.tokens,
                        "seconds": args.seconds, "quick": args.quick, "machine_cores": cores,
                        "cores": {"middle_box": sorted(args.cores.own), "rest": sorted(args.cores.rest),
                                  "pinned": args.cores.pinned},
                        "clients": "closed-loop; with the head, half SSE and half websocket"},
              "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(f"{'streams':>8}{'heads':>7}{'direct':>9}{'proxy':>9}{'head':>9}{'cpu/1k':>8}{'+ttft50':>9}{'+gap99':>8}"
          f"{'trips':>7}")
    for r in runs:
        label = f"{r['heads']}{'r' if r['redis'] and r['heads'] == 1 else ''}"
        print(f"{r['streams']:>8}{label:>7}{r['direct_tok_s']:>9}{r['proxy_tok_s']:>9}{r['head_tok_s']:>9}"
              f"{r['head_cpu_s_per_1k_tok']!s:>8}{r['added_ttft_ms_p50']!s:>9}{r['added_gap_ms_p99']!s:>8}"
              f"{r['redis_round_trips_per_generation']!s:>7}")
    print(json.dumps(result["targets_met"], indent=2))
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
