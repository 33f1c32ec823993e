"""Our engine's llama.cpp context settings vs the ones llama-server runs with, per decode step, paired.

bench/server.py compares whole runs, and on this 2-core machine another busy process slows a run by up to 6x,
so one run against the next says little. Here every variant gets its own context on the same model, holds the
same greedy generations, and the variants' decode steps alternate one by one (the order rotating each step), so
contention lands on all of them alike. A step is what the bare loop in bench/engine.py does per step: read each
sequence's logits (argmax), add the next tokens, one llama_decode.

- ours:       the engine's context (nodes.agent.engine.llama.context_settings: one KV stream per sequence, flash
              attention auto; n_batch = n_ubatch = 512; no threadpool attached, so ggml makes one per graph);
- threadpool: ours with a persistent ggml threadpool attached (llama_attach_threadpool, poll level 50), as
              llama-server's common_init_from_params does;
- server:     all of llama-server's differences at once: that threadpool, n_batch 2048 / n_ubatch 512, and the
              model loaded with its extra buffer types (weight repacking) on, as llama-server loads it.

llama-server with -np 8 keeps one KV stream per slot too (its log: kv_unified = 'false'), so that is not a
difference, but which sequence ids a step holds is: with one stream per sequence, llama.cpp puts only sequences
with consecutive increasing ids into one ubatch (llama_batch_allocr::split_equal, `sequential`), so a step of
lanes 0, 1, 5, 6 is computed as two ubatches, each a pass over all the weights. The second table holds 4
generations on lanes 0-3 against the spread lane sets our engine's lane choice gave in bench/server.py's runs.
Prints, per concurrency, the median step time of each variant and the median of the per-step ratios
(ours' step time over the variant's: above 1, the variant is faster). Run from the repository root:
.venv/bin/python bench/server_settings.py   Writes bench/results/server_settings.json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import llama_cpp as L  # noqa: E402
import numpy as np  # noqa: E402
from engine import LEVELS, chats  # noqa: E402

from nodes.agent.engine.llama import DecodeBatch, context_settings  # noqa: E402
from nodes.agent.engine.local import bundled_model_path  # noqa: E402
from nodes.agent.engine.model import LoadedModel  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "server_settings.json"
LANES = 8


class ThreadpoolParams(ctypes.Structure):
    """ggml.h's struct ggml_threadpool_params (GGML_MAX_N_THREADS = 512); llama_cpp does not bind threadpools."""

    _fields_ = [("cpumask", ctypes.c_bool * 512), ("n_threads", ctypes.c_int), ("prio", ctypes.c_int),
                ("poll", ctypes.c_uint32), ("strict_cpu", ctypes.c_bool), ("paused", ctypes.c_bool)]


_LIB = Path(L.__file__).parent / "lib"
_BASE, _CPU = ctypes.CDLL(str(_LIB / "libggml-base.so")), ctypes.CDLL(str(_LIB / "libggml-cpu.so"))
_BASE.ggml_threadpool_params_default.restype = ThreadpoolParams
_BASE.ggml_threadpool_params_default.argtypes = [ctypes.c_int]
_CPU.ggml_threadpool_new.restype = ctypes.c_void_p
_CPU.ggml_threadpool_new.argtypes = [ctypes.POINTER(ThreadpoolParams)]
_CPU.ggml_threadpool_free.argtypes = [ctypes.c_void_p]
L.llama_cpp._lib.llama_attach_threadpool.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
POOLS: list[int] = []  # the caller owns an attached threadpool: freed after the contexts


def attach_threadpool(ctx: Any, threads: int) -> None:
    """A persistent threadpool with ggml's default parameters (poll 50), attached for single and batch decodes."""
    params = _BASE.ggml_threadpool_params_default(threads)
    POOLS.append(_CPU.ggml_threadpool_new(ctypes.byref(params)))
    L.llama_cpp._lib.llama_attach_threadpool(ctx, POOLS[-1], None)


def new_context(model: Any, window: int, threads: int, n_batch: int, threadpool: bool) -> Any:
    params = L.llama_context_default_params()
    params.n_ctx, params.n_seq_max, params.n_batch, params.n_ubatch = window * LANES, LANES, n_batch, 512
    params.n_threads = params.n_threads_batch = threads
    settings = context_settings(batch_invariant=False)
    params.kv_unified, params.flash_attn_type = settings["unified_kv"], settings["flash_attn"]
    ctx = L.llama_init_from_model(model, params)
    if threadpool:
        attach_threadpool(ctx, threads)
    return ctx


class Lanes:
    """One variant's context holding len(prompts) greedy generations, stepped one decode at a time."""

    def __init__(self, ctx: Any, n_vocab: int, prompts: list[list[int]], seqs: list[int]) -> None:
        self.ctx, self.n_vocab, self.batch = ctx, n_vocab, DecodeBatch(512)
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        self.index = {seq: self.batch.add(p, 0, seq, True) for seq, p in zip(seqs, prompts, strict=True)}
        self.pos = {seq: len(p) for seq, p in zip(seqs, prompts, strict=True)}
        self.batch.batch.n_tokens = self.batch.n
        assert L.llama_decode(ctx, self.batch.batch) == 0

    def step(self) -> float:
        started = time.perf_counter()
        logits = {s: L.llama_get_logits_ith(self.ctx, i) for s, i in self.index.items()}
        tokens = {s: int(np.ctypeslib.as_array(p, shape=(self.n_vocab,)).argmax()) for s, p in logits.items()}
        self.batch.clear()
        self.index = {s: self.batch.add([t], self.pos[s], s, True) for s, t in tokens.items()}
        self.pos = {s: p + 1 for s, p in self.pos.items()}
        self.batch.batch.n_tokens = self.batch.n
        assert L.llama_decode(self.ctx, self.batch.batch) == 0
        return time.perf_counter() - started


def paired_steps(ctxs: dict[str, Any], n_vocab: int, prompts: list[list[int]], steps: int,
                 seqs: dict[str, list[int]] | None = None) -> dict[str, list[float]]:
    """Each variant's step times; `seqs` gives a variant's sequence ids (else 0, 1, ...)."""
    ids = {name: (seqs or {}).get(name, list(range(len(prompts)))) for name in ctxs}
    lanes = {name: Lanes(ctx, n_vocab, prompts, ids[name]) for name, ctx in ctxs.items()}
    names, times = list(ctxs), {name: [] for name in ctxs}
    for i in range(steps):
        for name in names[i % len(names):] + names[: i % len(names)]:
            times[name].append(lanes[name].step())
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=63, help="decode steps per try (64 new tokens: 63 steps)")
    parser.add_argument("--repeats", type=int, default=3, help="tries per concurrency; their steps are pooled")
    parser.add_argument("--window", type=int, default=1024, help="per-lane context window")
    args = parser.parse_args()
    ours = LoadedModel(bundled_model_path())  # extra buffer types off, as the engine loads it
    repacked = L.llama_model_load_from_file(ours.path.encode(), L.llama_model_default_params())  # llama-server's
    threads = len(os.sched_getaffinity(0))
    ctxs = {"ours": new_context(ours.model, args.window, threads, 512, False),
            "threadpool": new_context(ours.model, args.window, threads, 512, True),
            "server": new_context(repacked, args.window, threads, 2048, True)}
    prompts = [ours.tokenize(ours.render_chat(chat), False, True) for chat in chats()]
    paired_steps(ctxs, ours.n_vocab, prompts[:2], 4)  # warm up: first decodes allocate compute buffers
    load_before = os.getloadavg()
    results: dict[str, dict[str, Any]] = {}
    for level in LEVELS:
        pooled: dict[str, list[float]] = {name: [] for name in ctxs}
        for _ in range(args.repeats):
            for name, times in paired_steps(ctxs, ours.n_vocab, prompts[:level], args.steps).items():
                pooled[name] += times
        row: dict[str, Any] = {}
        for name, times in pooled.items():
            ratio = statistics.median(a / b for a, b in zip(pooled["ours"], times, strict=True))
            row[name] = {"step_ms_median": round(statistics.median(times) * 1000, 2),
                         "ours_over_this_step_time": round(ratio, 3)}
        results[str(level)] = row
        print(f"concurrency {level}: " + "  ".join(f"{name} {r['step_ms_median']:6.2f} ms/step "
              f"(x{r['ours_over_this_step_time']:.3f})" for name, r in row.items()), flush=True)
    spread = {"0,1,2,3": [0, 1, 2, 3], "0,1,5,6": [0, 1, 5, 6], "0,1,4,7": [0, 1, 4, 7], "0,2,4,6": [0, 2, 4, 6]}
    lane_ctxs = {name: new_context(ours.model, args.window, threads, 512, False) for name in spread}
    pooled = {name: [] for name in spread}
    for _ in range(args.repeats):
        for name, times in paired_steps(lane_ctxs, ours.n_vocab, prompts[:4], args.steps, spread).items():
            pooled[name] += times
    lanes_at_4 = {name: {"step_ms_median": round(statistics.median(times) * 1000, 2),
                         "this_over_lanes_0_3_step_time": round(statistics.median(
                             a / b for a, b in zip(times, pooled["0,1,2,3"], strict=True)), 3)}
                  for name, times in pooled.items()}
    print("4 generations on lanes " + "  ".join(f"{name}: {r['step_ms_median']:6.2f} ms/step "
          f"(x{r['this_over_lanes_0_3_step_time']:.2f})" for name, r in lanes_at_4.items()), flush=True)
    ctxs.update({f"lanes {name}": ctx for name, ctx in lane_ctxs.items()})
    out = {"concurrency": results, "lanes_at_4": lanes_at_4,
           "settings": {"steps": args.steps, "repeats": args.repeats, "window": args.window, "threads": threads},
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "llama_cpp": L.__version__,
                       "load_average_before": load_before, "load_average_after": os.getloadavg()}}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    for ctx in ctxs.values():
        L.llama_free(ctx)
    for pool in POOLS:
        _CPU.ggml_threadpool_free(pool)
    L.llama_model_free(repacked)
    ours.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
