"""Prefix reuse across a five-turn chat: tokens actually read and time to first token, with and without reuse.

Each turn resends the whole conversation (a ~400-token system prompt, the earlier turns, the new question),
as an OpenAI-style client does. With reuse the engine finds the lane holding the conversation so far and
reads only what is new; without reuse every turn starts from a cleared cache. Both read the same prompts:
the answers come from the reuse run and are replayed into the conversation for both.
Then a second conversation starts on the same system prompt: with reuse the engine copies the prefix from the
first conversation's lane into its free lane (a KV copy, no prompt read), and the first conversation's next
turn still finds its whole history cached.
Run from the repository root:  .venv/bin/python bench/prefix.py     Writes bench/results/prefix.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nodes.agent.engine.base import EngineConfig  # noqa: E402
from nodes.agent.engine.llama import LlamaEngine  # noqa: E402
from nodes.agent.engine.local import bundled_model_path, run_local  # noqa: E402
from nodes.link.spec import GenerateSpec  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "prefix.json"
QUESTIONS = [
    "What should I pack for a weekend hike?",
    "How much water should I bring?",
    "What if it rains?",
    "Which snacks keep well?",
    "How do I plan the route?",
]


def system_prompt() -> str:
    rules = [
        "Answer briefly and concretely.",
        "Prefer lists when there are several items.",
        "Mention safety first when it matters.",
        "Do not invent facts about places you do not know.",
        "Use metric units.",
        "Keep a friendly, calm tone.",
    ]
    body = " ".join(f"Guideline {i + 1}: {rules[i % len(rules)]}" for i in range(30))
    return "You are a hiking assistant for a small outdoor club. " + body


def forget(engine: LlamaEngine) -> None:
    """Clear every lane's KV cache: the next generation reads its whole prompt."""
    for lane in engine.lanes:
        engine._trim_lane(lane, 0)
        lane.tokens, lane.holders = [], []


def turn(engine: LlamaEngine, gen_id: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    spec = GenerateSpec(gen_id=gen_id, messages=messages, max_tokens=32, temperature=0)
    outcome = run_local(engine, [spec])[gen_id]
    assert outcome.done is not None, outcome.error
    return {"text": outcome.text, "usage": outcome.done.usage, "timings": outcome.done.timings}


def main() -> int:
    config = EngineConfig(model_path=bundled_model_path(), lanes=2, max_context=2048)
    warm, cold = LlamaEngine(config), LlamaEngine(config)  # with reuse / a cleared cache every turn
    for engine in (warm, cold):
        turn(engine, "warmup", [{"role": "user", "content": "Hi."}])
        forget(engine)
    messages = [{"role": "system", "content": system_prompt()}]
    rows = []
    for index, question in enumerate(QUESTIONS, start=1):
        messages.append({"role": "user", "content": question})
        reused = turn(warm, f"turn{index}", list(messages))
        forget(cold)
        fresh = turn(cold, f"cold{index}", list(messages))
        usage = reused["usage"]
        rows.append(
            {
                "prompt_tokens": usage["prompt_tokens"],
                "read_tokens": usage["prompt_tokens"] - usage["cached_tokens"],
                "ttft_ms": reused["timings"]["ttft_ms"],
                "ttft_ms_no_reuse": fresh["timings"]["ttft_ms"],
                "read_tokens_no_reuse": fresh["usage"]["prompt_tokens"] - fresh["usage"]["cached_tokens"],
            }
        )
        r = rows[-1]
        print(
            f"turn {index}: prompt {r['prompt_tokens']:4d} tokens, read {r['read_tokens']:4d} "
            f"({r['read_tokens'] / r['prompt_tokens']:.0%}), ttft {r['ttft_ms']:7.1f} ms "
            f"vs {r['ttft_ms_no_reuse']:7.1f} ms without reuse ({r['ttft_ms_no_reuse'] / r['ttft_ms']:.1f}x)",
            flush=True,
        )
        messages.append({"role": "assistant", "content": reused["text"]})
    last = rows[-1]
    copies = warm.stats()["prefix_copies"]
    other = [{"role": "system", "content": system_prompt()}, {"role": "user", "content": "Is a bike trip easier?"}]
    copied = turn(warm, "other1", other)
    forget(cold)
    fresh = turn(cold, "other-cold", other)
    messages.append({"role": "user", "content": "Thanks, anything else?"})
    back = turn(warm, "turn6", list(messages))
    shared = {
        "prompt_tokens": copied["usage"]["prompt_tokens"],
        "read_tokens": copied["usage"]["prompt_tokens"] - copied["usage"]["cached_tokens"],
        "prefix_copied": warm.stats()["prefix_copies"] == copies + 1,
        "ttft_ms": copied["timings"]["ttft_ms"],
        "ttft_ms_no_reuse": fresh["timings"]["ttft_ms"],
        "first_conversation_next_turn_read_tokens": back["usage"]["prompt_tokens"] - back["usage"]["cached_tokens"],
        "first_conversation_next_turn_prompt_tokens": back["usage"]["prompt_tokens"],
    }
    print(
        f"second conversation on the same system prompt: prompt {shared['prompt_tokens']} tokens, read "
        f"{shared['read_tokens']} (prefix copied: {shared['prefix_copied']}), ttft {shared['ttft_ms']:.1f} ms vs "
        f"{shared['ttft_ms_no_reuse']:.1f} ms without reuse; the first conversation's next turn read "
        f"{shared['first_conversation_next_turn_read_tokens']} of "
        f"{shared['first_conversation_next_turn_prompt_tokens']}",
        flush=True,
    )
    out = {
        "turns": rows,
        "turn5_read_fraction": round(last["read_tokens"] / last["prompt_tokens"], 4),
        "target_met": last["read_tokens"] < 0.2 * last["prompt_tokens"],
        "shared_system_prompt": shared,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(f"turn 5 read {out['turn5_read_fraction']:.1%} of its prompt; target (<20%) met: {out['target_met']}")
    print(f"wrote {RESULTS}")
    warm.close()
    cold.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
