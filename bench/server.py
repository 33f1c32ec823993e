"""Our engine vs llama.cpp's own `llama-server` at its defaults, side by side in one run on the same model.

Aggregate decode tokens/s at 1, 2, 4 and 8 concurrent greedy generations (the same chats, 64 new tokens each,
end of generation ignored so both produce every token), and the time to read a ~420-token prompt with nothing
cached (median of several distinct prompts). Runs are interleaved and each runner keeps its best try, as in
bench/engine.py.

- ours:   nodes.agent.engine.llama.LlamaEngine in-process, a default node's settings (flash attention auto);
- server: llama-server with its defaults (flash attention auto, n_batch 2048, n_ubatch 512, weight repacking on,
          a persistent ggml threadpool; one KV stream per slot, as ours: with -np given it leaves kv_unified off,
          its log says kv_unified = 'false'), given only the model, the threads, 8 slots and 8 x the per-lane
          window, driven over HTTP with streamed completions; first and last token are timed where they arrive.

The JSON records the lanes our generations took at each level (`our_lanes`): llama.cpp reads consecutive lanes in
one pass of the weights, so a spread set costs extra passes per step. bench/server_settings.py measures that and
the context differences on their own, per decode step and paired.

llama-server is not part of the project. Build it from the llama.cpp that llama-cpp-python vendors, so both run
the same llama.cpp (about 5 minutes on 2 cores):

    .venv/bin/pip download llama-cpp-python==$(.venv/bin/python -c 'import llama_cpp; print(llama_cpp.__version__)') \
        --no-deps --no-binary :all: -d /tmp/lcp
    cd /tmp/lcp && tar xzf llama_cpp_python-*.tar.gz && cd llama_cpp_python-*/vendor/llama.cpp
    cmake -B build -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release
    cmake --build build --target llama-server -j2

Then, from the repository root:  .venv/bin/python bench/server.py --server /tmp/lcp/.../build/bin/llama-server
Writes bench/results/server.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import llama_cpp as L  # noqa: E402
from engine import LEVELS, chats, run_batched  # noqa: E402

from nodes.agent.engine.base import EngineConfig  # noqa: E402
from nodes.agent.engine.llama import LlamaEngine  # noqa: E402
from nodes.agent.engine.local import bundled_model_path, run_local  # noqa: E402
from nodes.link.spec import GenerateSpec  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "server.json"
LONG_PROMPT = " ".join(f"Note {i}: the fleet keeps every node's lanes busy and its caches warm." for i in range(30))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(binary: str, model: str, threads: int, window: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [binary, "-m", model, "-t", str(threads), "-tb", str(threads), "-np", str(max(LEVELS)),
         "-c", str(window * max(LEVELS)), "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited with status {proc.returncode}")
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("llama-server did not become healthy within 120 s")


async def _stream_one(client: httpx.AsyncClient, url: str, prompt: str, n_new: int) -> tuple[float, float, int]:
    """(first token time, last token time, tokens) of one streamed completion."""
    body = {"prompt": prompt, "n_predict": n_new, "temperature": 0, "ignore_eos": True, "stream": True,
            "cache_prompt": False}
    first = last = 0.0
    n = 0
    async with client.stream("POST", f"{url}/completion", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("content") or chunk.get("tokens"):
                last = time.perf_counter()
                first = first or last
                n += 1
            if chunk.get("stop"):
                break
    return first, last, n


def run_server(url: str, prompts: list[str], n_new: int) -> tuple[float, int]:
    async def go():
        async with httpx.AsyncClient(timeout=600) as client:
            return await asyncio.gather(*[_stream_one(client, url, p, n_new) for p in prompts])

    got = asyncio.run(go())
    first, last = min(g[0] for g in got), max(g[1] for g in got)
    tokens = sum(g[2] - 1 for g in got)
    return tokens / (last - first), tokens


def server_prompt_ms(url: str, prompt: str) -> tuple[float, int]:
    body = {"prompt": prompt, "n_predict": 1, "temperature": 0, "cache_prompt": False}
    timings = httpx.post(f"{url}/completion", json=body, timeout=600).json()["timings"]
    return float(timings["prompt_ms"]), int(timings["prompt_n"])


def ours_prompt_ms(engine: LlamaEngine, prompt: str, tag: str) -> tuple[float, int]:
    spec = GenerateSpec(gen_id=f"p-{tag}", prompt=prompt, max_tokens=1, temperature=0)
    done = run_local(engine, [spec])[spec.gen_id].done
    assert done is not None and done.usage["cached_tokens"] == 0, done
    return float(done.timings["prompt_ms"]), int(done.usage["prompt_tokens"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", default=os.environ.get("LLAMA_SERVER"), help="path to a llama-server binary")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--window", type=int, default=1024, help="per-lane context window")
    parser.add_argument("--repeats", type=int, default=2, help="tries per runner and level; the best counts")
    parser.add_argument("--prompt-runs", type=int, default=5, help="distinct long prompts read by each side")
    args = parser.parse_args()
    if not args.server or not os.access(args.server, os.X_OK):
        parser.error("give --server PATH (or LLAMA_SERVER) to a llama-server binary; the docstring says how to "
                     "build one")
    path = bundled_model_path()
    load_before = os.getloadavg()
    engine = LlamaEngine(EngineConfig(model_path=path, lanes=max(LEVELS), max_context=args.window))
    proc, url = start_server(args.server, path, engine.threads, args.window)
    try:
        texts = chats()
        rendered = [engine.model.render_chat(chat) for chat in texts]
        run_batched(engine, texts[:2], 4)  # warm up both
        run_server(url, rendered[:2], 4)
        best: dict[str, dict[str, tuple]] = {str(level): {} for level in LEVELS}
        for _ in range(args.repeats):
            for level in LEVELS:
                specs_ours = [GenerateSpec(gen_id=f"g{i}", messages=m, max_tokens=args.new_tokens, temperature=0,
                                           ignore_eos=True) for i, m in enumerate(texts[:level])]
                tries = {"ours": _rate(engine, specs_ours),
                         "server": run_server(url, rendered[:level], args.new_tokens)}
                for name, value in tries.items():
                    if value[0] > best[str(level)].get(name, (0.0, 0))[0]:
                        best[str(level)][name] = value
        prompt_ms: dict[str, list[float]] = {"ours": [], "server": []}
        prompt_tokens: dict[str, int] = {}
        for i in range(args.prompt_runs):
            prompt = f"Run {i} of {time.time_ns()}. {LONG_PROMPT}"  # distinct each time: nothing to reuse
            ms, n = ours_prompt_ms(engine, prompt, str(i))
            prompt_ms["ours"].append(ms)
            prompt_tokens["ours"] = n
            ms, n = server_prompt_ms(url, prompt)
            prompt_ms["server"].append(ms)
            prompt_tokens["server"] = n
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    results = {}
    for level in LEVELS:
        b = best[str(level)]
        ours, server = b["ours"][0], b["server"][0]
        results[str(level)] = {"ours": round(ours, 2), "server": round(server, 2),
                               "ours_over_server": round(ours / server, 3),
                               "decode_tokens": {name: value[1] for name, value in b.items()},
                               "our_lanes": b["ours"][2]}
        print(f"concurrency {level}: ours {ours:7.1f} tok/s  llama-server {server:7.1f}  "
              f"ours/server {ours / server:.2f}", flush=True)
    medians = {name: round(statistics.median(values), 1) for name, values in prompt_ms.items()}
    print(f"prompt of {prompt_tokens['ours']} tokens: ours {medians['ours']} ms  llama-server {medians['server']} ms "
          f"(median of {args.prompt_runs})")
    targets = {"level_or_better_at_4_and_8": all(results[k]["ours_over_server"] >= 1.0 for k in ("4", "8"))}
    out = {
        "concurrency": results,
        "prompt_read_ms_median": medians,
        "prompt_tokens": prompt_tokens,
        "targets_met": targets,
        "settings": {"new_tokens": args.new_tokens, "window": args.window, "threads": engine.threads,
                     "repeats": args.repeats, "ours_flash_attn": engine.info()["flash_attn"]},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "llama_cpp": L.__version__,
                    "load_average_before": load_before, "load_average_after": os.getloadavg()},
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(f"targets: {targets}\nwrote {RESULTS}")
    engine.close()
    return 0


def _rate(engine: LlamaEngine, specs: list[GenerateSpec]) -> tuple[float, int, list[int]]:
    """Decode tokens/s, tokens, and the lanes the generations took (one weight pass a step when consecutive)."""
    outcomes = run_local(engine, specs).values()
    done = [o.done for o in outcomes]
    first = min(d.timings["ttft_ms"] for d in done)  # type: ignore[union-attr]
    last = max(d.timings["total_ms"] for d in done)  # type: ignore[union-attr]
    tokens = sum(d.usage["completion_tokens"] - 1 for d in done)  # type: ignore[union-attr]
    return tokens / ((last - first) / 1000), tokens, sorted(o.accepted.lane for o in outcomes if o.accepted)


if __name__ == "__main__":
    raise SystemExit(main())
