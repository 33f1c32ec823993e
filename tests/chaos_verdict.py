"""What the chaos soak's requests got, judged: tokens against the mock engine's own answer, records against requests.

The expected answer of a request is what `MockEngine` itself produces for that prompt, seed and max_tokens when
nothing interrupts it (run here, in process, with its timing costs set to nothing), so the soak spells out none
of the mock's rules. Mock tokens are whitespace-separated words, so answers are compared word by word.
"""

from __future__ import annotations

import difflib
import uuid
from collections import Counter, defaultdict
from typing import TYPE_CHECKING, Any

from nodes.agent.engine.base import EngineConfig
from nodes.agent.engine.mock import MockEngine
from nodes.link.messages import Done, Error, TokenBatch
from nodes.link.spec import GenerateSpec

if TYPE_CHECKING:
    from tests.chaos import Request

MODEL = "smollm2"
# The generation-stage codes: a request that ends with one of them reached the dispatcher, so it has a record.
DISPATCH_CODES = {"deadline_exceeded", "node_unavailable", "node_lost", "node_stuck", "engine_crashed",
                  "client_too_slow", "model_not_found", "internal_error"}


class Oracle:
    """The mock engine in this process: the uninterrupted answer to a request's spec."""

    def __init__(self) -> None:
        self.engine = MockEngine(EngineConfig(model_name=MODEL, lanes=1,
                                              mock={"decode_tps": 1e9, "prefill_ms_per_token": 0.0}))

    def answer(self, request: Request) -> list[str]:
        body = request.body
        spec = GenerateSpec(gen_id=f"oracle-{request.seed}", model=MODEL, prompt=body.get("prompt"),
                            messages=body.get("messages"), max_tokens=body["max_tokens"], seed=body["seed"],
                            temperature=body["temperature"])
        events = self.engine.submit(spec)
        while not any(isinstance(e, Done | Error) for e in events):
            events += self.engine.step()
        return "".join(t for e in events if isinstance(e, TokenBatch) for t in e.text).split()


def token_diff(expected: list[str], got: list[str]) -> tuple[int, int]:
    """(lost, duplicated): expected tokens missing from what came, and tokens that came beyond the expected."""
    matcher = difflib.SequenceMatcher(None, expected, got, autojunk=False)
    common = sum(block.size for block in matcher.get_matching_blocks())
    return len(expected) - common, len(got) - common


def judge_tokens(requests: list[Request], oracle: Oracle) -> dict[str, Any]:
    lost = duplicated = 0
    problems = []
    for request in requests:
        if request.status not in ("done", "error") or (request.status == "error" and not request.text):
            continue
        expected, got = oracle.answer(request), request.text.split()
        if request.status == "error":  # a stream cut by a clear error: what came must still be the answer's start
            if got != expected[: len(got)]:
                problems.append({**describe(request), "partial": True, "expected": expected, "got": got})
            continue
        missing, extra = token_diff(expected, got)
        usage_off = request.completion_tokens not in (None, len(got))
        if missing or extra or usage_off:
            problems.append({**describe(request), "expected": expected, "got": got,
                             "usage_completion_tokens": request.completion_tokens})
        lost, duplicated = lost + missing, duplicated + extra
    return {"lost": lost, "duplicated": duplicated, "problems": problems}


def judge_records(requests: list[Request], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Match Generation rows to requests by seed (unique per request); check each against what the client saw."""
    by_seed: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_seed[int(row["seed"]) if row["seed"] is not None else None].append(row)
    seeds = {r.seed for r in requests}
    unknown = sum(len(found) for seed, found in by_seed.items() if seed not in seeds)
    missing, duplicated, problems = 0, unknown, []
    for request in requests:
        found = by_seed.get(request.seed, [])
        duplicated += max(len(found) - 1, 0)
        if not found:
            if request.status == "done" or request.gen_id or request.code in DISPATCH_CODES:
                missing += 1
                problems.append({**describe(request), "record": None})
            continue
        problem = record_problem(request, found[0])
        if problem:
            problems.append({**describe(request), "record": found[0], "problem": problem})
    return {"missing": missing, "duplicated": duplicated, "problems": problems, "by_seed": by_seed,
            "failovers": sum(1 for row in rows if len(row["nodes_used"] or []) > 1),
            "statuses": dict(Counter(row["status"] for row in rows))}


def record_problem(request: Request, row: dict[str, Any]) -> str:
    if request.gen_id and uuid.UUID(row["id"]) != uuid.UUID(request.gen_id):
        return "the record's id is not the X-Fleet-Generation the client got"
    if request.status == "done" and row["status"] != "done":
        return f"the client got its answer but the record says {row['status']}"
    if request.status == "done" and row["completion_tokens"] != len(request.text.split()):
        return f"the record counts {row['completion_tokens']} completion tokens, the client got " \
               f"{len(request.text.split())}"
    if request.status == "error" and row["status"] == "done":
        return "the client got an error but the record says done"
    return ""


def describe(request: Request) -> dict[str, Any]:
    return {"seed": request.seed, "gen_id": request.gen_id, "kind": request.kind, "stream": request.stream,
            "head": request.head, "max_tokens": request.body["max_tokens"], "status": request.status,
            "code": request.code, "started": round(request.started, 2), "ended": round(request.ended, 2)}


def summarize(seconds: float, requests: list[Request], tokens: dict[str, Any], records: dict[str, Any],
              node_back_s: float | None) -> dict[str, Any]:
    """bench/results/soak.json: exactly these keys. Errors that are not clear ones count as `unclear: <what>`."""
    errors = Counter(r.code if r.status == "error" else f"unclear: {r.code}" for r in requests if r.status != "done")
    return {"seconds": round(seconds), "requests": len(requests),
            "completed": sum(1 for r in requests if r.status == "done"), "errors": dict(sorted(errors.items())),
            "failovers": records["failovers"], "lost_tokens": tokens["lost"],
            "duplicated_tokens": tokens["duplicated"], "records_missing": records["missing"],
            "records_duplicated": records["duplicated"], "node_back_s_max": node_back_s}
