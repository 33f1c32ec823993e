"""A prompt prefix's KV cache moved between two engines against reading it again (issue 53, item 1).

For each prefix size (128, 512, 1024 tokens by default) a raw prompt of that many tokens plus one or two is read by
an exporter engine, which then exports its whole-block prefix (`export_prefix`); a second engine, on the same model,
imports it (`import_prefix`) and serves the same prompt, reading only the token or two after it. Side by side, in
the same run and on the same importer, the prompt is served cold: every token read. Reported per size (median of
the interleaved tries): export ms, payload bytes a token, import ms, the importer's time to first token with the
prefix imported and cold, and their ratios. No network is in it (the node-to-node channel is item 4): the transfer
is given as the bandwidth at which moving breaks even with reading the prefix again.

Run from the repository root:  .venv/bin/python bench/kv_move.py     Writes bench/results/kv_move.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nodes.agent.engine.base import EngineConfig  # noqa: E402
from nodes.agent.engine.llama import LlamaEngine  # noqa: E402
from nodes.agent.engine.local import bundled_model_path, run_local  # noqa: E402
from nodes.link.spec import GenerateSpec  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "kv_move.json"
WORDS = ("lane", "node", "head", "prefix", "cache", "block", "token", "fleet", "model", "window", "batch", "decode",
         "prompt", "answer", "route", "drain", "replica", "park", "engine", "worker", "link", "channel", "payload")


def forget(engine: LlamaEngine) -> None:
    """Clear every lane's KV cache: the next generation reads its whole prompt."""
    for lane in engine.lanes:
        engine._trim_lane(lane, 0)
        lane.tokens, lane.holders = [], []


def prompt_of(engine: LlamaEngine, n: int) -> tuple[str, list[int]]:
    """A raw prompt of at least n + 1 tokens, as few more as its words allow, and its token ids."""
    words: list[str] = []
    while True:
        words.append(f"{WORDS[len(words) % len(WORDS)]}{len(words) % 7}")
        text = " ".join(words)
        ids = engine.model.tokenize(text, True, True)
        if len(ids) > n:
            return text, ids


def serve(engine: LlamaEngine, gen_id: str, text: str) -> dict[str, Any]:
    spec = GenerateSpec(gen_id=gen_id, prompt=text, max_tokens=1, temperature=0, ignore_eos=True)
    out = run_local(engine, [spec])[gen_id]
    assert out.done is not None, out.error
    return {"ttft_ms": out.done.timings["ttft_ms"], "cached": out.done.usage["cached_tokens"],
            "prompt": out.done.usage["prompt_tokens"]}


def trial(exporter: LlamaEngine, importer: LlamaEngine, n: int, text: str, ids: list[int], i: int) -> dict[str, Any]:
    forget(exporter)
    serve(exporter, f"read{n}-{i}", text)
    started = time.perf_counter()
    exported = exporter.export_prefix(tokens=ids[:n])
    export_ms = (time.perf_counter() - started) * 1000
    assert exported["ok"] and exported["tokens"] == n, exported
    forget(importer)
    cold = serve(importer, f"cold{n}-{i}", text)
    forget(importer)
    started = time.perf_counter()
    imported = importer.import_prefix(exported["payload"])
    import_ms = (time.perf_counter() - started) * 1000
    assert imported["ok"], imported
    moved = serve(importer, f"moved{n}-{i}", text)
    assert moved["cached"] == n and cold["cached"] == 0, (moved, cold)
    return {"export_ms": export_ms, "import_ms": import_ms, "bytes": exported["bytes"], "cold_ttft_ms": cold["ttft_ms"],
            "moved_ttft_ms": moved["ttft_ms"], "prompt_tokens": cold["prompt"]}


def summary(n: int, tries: list[dict[str, Any]]) -> dict[str, Any]:
    med = {key: statistics.median(t[key] for t in tries) for key in tries[0]}
    cold, moved = med["cold_ttft_ms"], med["moved_ttft_ms"]
    spent = med["export_ms"] + med["import_ms"]
    # moving pays while export + transfer + import + the rest's read < reading the prefix again
    budget_s = (cold - moved - spent) / 1000
    return {
        "prefix_tokens": n, "prompt_tokens": int(med["prompt_tokens"]), "payload_bytes": int(med["bytes"]),
        "bytes_per_token": round(med["bytes"] / n), "export_ms": round(med["export_ms"], 1),
        "import_ms": round(med["import_ms"], 1), "cold_ttft_ms": round(cold, 1), "moved_ttft_ms": round(moved, 1),
        "export_over_cold": round(med["export_ms"] / cold, 3), "import_over_cold": round(med["import_ms"] / cold, 3),
        "moved_with_export_over_cold": round((spent + moved) / cold, 3),
        "break_even_mbit_s": round(med["bytes"] * 8 / 1e6 / budget_s, 1) if budget_s > 0 else None,
        "tries": tries,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--tries", type=int, default=5)
    args = parser.parse_args()
    config = EngineConfig(model_path=bundled_model_path(), model_name="smollm2", lanes=2, max_context=2048)
    exporter, importer = LlamaEngine(config), LlamaEngine(config)
    prompts = {n: prompt_of(exporter, n) for n in args.sizes}
    for engine in (exporter, importer):  # first decodes are slower: warm both up
        serve(engine, "warmup", prompts[args.sizes[0]][0])
    tries: dict[int, list[dict[str, Any]]] = {n: [] for n in args.sizes}
    for i in range(args.tries):
        for n in args.sizes:  # interleaved, so a busy moment on the machine hits every size alike
            tries[n].append(trial(exporter, importer, n, *prompts[n], i))
    rows = [summary(n, tries[n]) for n in args.sizes]
    for r in rows:
        print(f"prefix {r['prefix_tokens']:5d} tokens: payload {r['payload_bytes'] / 1e6:6.2f} MB "
              f"({r['bytes_per_token']} B/token), export {r['export_ms']:6.1f} ms, import {r['import_ms']:6.1f} ms; "
              f"first token {r['moved_ttft_ms']:6.1f} ms imported vs {r['cold_ttft_ms']:7.1f} ms cold; "
              f"export/cold {r['export_over_cold']:.3f}, import/cold {r['import_over_cold']:.3f}, "
              f"(export+import+first token)/cold {r['moved_with_export_over_cold']:.3f}; "
              f"moving pays above {r['break_even_mbit_s']} Mbit/s", flush=True)
    out = {"machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                       "processor": platform.processor() or platform.machine()},
           "model": os.path.basename(bundled_model_path()), "threads": exporter.threads,
           "flash_attn": exporter.info()["flash_attn"], "rows": rows}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    exporter.close()
    importer.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
