"""Per-lane samplers on llama.cpp's sampler chains, grammar compilation and logprobs."""

from __future__ import annotations

import ctypes
import math
import secrets
import time
from dataclasses import dataclass
from typing import Any

import llama_cpp as L
import numpy as np

from nodes.agent.engine.base import EngineError
from nodes.agent.engine.model import LoadedModel
from nodes.link.codes import ErrorCode
from nodes.link.gbnf import repetition_problem
from nodes.link.spec import GenerateSpec

PENALTY_LAST_N = 64  # llama.cpp's default window for repeat/frequency/presence penalties
MAX_TOP_LOGPROBS = 20
GRAMMAR_PROBE_TOKENS = 512
# A grammar whose filter of the vocabulary would take longer is refused (JSON schemas' grammars take 0.01-0.07 s on
# this machine, and the filter runs only on the steps where the chain's pick breaks the grammar)
GRAMMAR_FILTER_BUDGET_S = 2.0
_TOKEN_DATA_SIZE = ctypes.sizeof(L.llama_token_data)
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])  # llama_token_data


@dataclass
class LaneSampler:
    """A generation's sampler chain. `argmax` marks plain greedy decoding, which skips the chain: an argmax
    over the logits gives the same token without llama.cpp copying the whole vocabulary each step.

    The grammar is kept out of the chain. Running it over the whole vocabulary costs far more than a decode
    step of a small model, so (as llama.cpp's own common sampler does) the chain picks a token first and the
    grammar checks only that one; only when it refuses does the grammar filter every candidate and the chain
    pick again.

    A sampled (not greedy) generation draws its token at position n with a generator seeded by (seed, n)
    rather than from one running stream: a generation resumed on another node after n tokens then draws the
    same numbers the first node would have, however many picks the grammar made it redo. The chain does
    everything up to the pick (bias, penalties, truncation, temperature); `seed` is None for a greedy chain.
    """

    chain: Any
    grammar: Any = None  # owned here, not by the chain
    argmax: bool = False
    seed: int | None = None
    position: int = 0  # tokens accepted so far (resumed ones included): the next draw's index
    _candidates: Any = None  # numpy llama_token_data[n_vocab]
    _probe: Any = None

    def sample(self, ctx: Any, index: int, n_vocab: int) -> int:
        if self.argmax:
            logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, index), shape=(n_vocab,))
            self.position += 1
            return int(logits.argmax())
        if self.grammar is not None:
            return self._sample_checked(ctx, index, n_vocab)
        if self.seed is None:
            self.position += 1
            return int(L.llama_sampler_sample(self.chain, ctx, index))  # greedy chain; it accepts the token
        array = self._candidates_from(ctx, index, n_vocab)
        token_id = self._pick(array)
        L.llama_sampler_accept(self.chain, token_id)
        self.position += 1
        return token_id

    def _pick(self, array: Any) -> int:
        """Run the chain over `array` and return the token it selects (-1 for none). A sampled chain stops
        before the pick: the token is drawn here from the chain's probabilities with this position's generator."""
        L.llama_sampler_apply(self.chain, ctypes.byref(array))
        if self.seed is None:
            return int(array.data[array.selected].id) if 0 <= array.selected < array.size else -1
        if array.size == 0:
            return -1
        kept = np.ctypeslib.as_array(array.data, shape=(array.size,))
        logits = kept["logit"].astype(np.float64)
        allowed = np.isfinite(logits)
        if not allowed.any():
            return -1
        weights = np.where(allowed, np.exp(logits - logits[allowed].max()), 0.0)
        draw = np.random.Generator(np.random.PCG64([self.seed, self.position])).random() * weights.sum()
        chosen = min(int(np.searchsorted(np.cumsum(weights), draw, side="right")), len(weights) - 1)
        while not allowed[chosen]:  # a draw at the very top can land on a trailing forbidden entry
            chosen -= 1
        array.selected = chosen
        return int(kept["id"][chosen])

    def _candidates_from(self, ctx: Any, index: int, n_vocab: int):
        if self._candidates is None:
            self._candidates = np.zeros(n_vocab, dtype=_TOKEN_DATA)
            self._candidates["id"] = np.arange(n_vocab, dtype=np.int32)
        cur = self._candidates
        cur["id"] = np.arange(n_vocab, dtype=np.int32)  # a previous apply may have sorted or truncated them
        cur["logit"] = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, index), shape=(n_vocab,))
        cur["p"] = 0.0
        return L.llama_token_data_array(cur.ctypes.data_as(ctypes.POINTER(L.llama_token_data)), n_vocab, -1, False)

    def allows(self, token_id: int) -> bool:
        """Whether the grammar, in its current state, allows this one token."""
        if self._probe is None:
            self._probe = (L.llama_token_data * 1)()
        self._probe[0].id, self._probe[0].logit, self._probe[0].p = token_id, 0.0, 0.0
        probe = L.llama_token_data_array(self._probe, 1, -1, False)
        L.llama_sampler_apply(self.grammar, ctypes.byref(probe))
        return math.isfinite(self._probe[0].logit)

    def _sample_checked(self, ctx: Any, index: int, n_vocab: int) -> int:
        """Pick with the chain, check the pick against the grammar, and filter everything only when it refuses.
        The pick is checked before the grammar accepts it: accepting a forbidden token aborts llama.cpp."""
        array = self._candidates_from(ctx, index, n_vocab)
        token_id = self._pick(array)
        if token_id < 0 or not self.allows(token_id):
            array = self._candidates_from(ctx, index, n_vocab)
            L.llama_sampler_apply(self.grammar, ctypes.byref(array))
            token_id = self._pick(array)
            if not 0 <= array.selected < array.size or not math.isfinite(array.data[array.selected].logit):
                raise EngineError(ErrorCode.INVALID_GRAMMAR,
                                  "the grammar allows no further token; check that it can end")
        L.llama_sampler_accept(self.grammar, token_id)
        L.llama_sampler_accept(self.chain, token_id)
        self.position += 1
        return token_id

    def accept(self, token_id: int) -> None:
        if self.grammar is not None:
            L.llama_sampler_accept(self.grammar, token_id)
        L.llama_sampler_accept(self.chain, token_id)
        self.position += 1

    def free(self) -> None:
        if self.chain:
            L.llama_sampler_free(self.chain)
            self.chain = None
        if self.grammar:
            L.llama_sampler_free(self.grammar)
            self.grammar = None


def compile_grammar(spec: GenerateSpec) -> str | None:
    """The GBNF the generation must follow: its grammar, or its JSON schema converted to GBNF."""
    if spec.grammar is not None and spec.json_schema is not None:
        raise EngineError(ErrorCode.INVALID_REQUEST, "send either grammar or json_schema, not both")
    if spec.json_schema is None:
        return spec.grammar
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    try:
        return json_schema_to_gbnf(spec.json_schema)
    except Exception as exc:  # the converter raises plain ValueError/KeyError/... on bad schemas
        raise EngineError(ErrorCode.INVALID_GRAMMAR, f"json_schema could not be turned into a grammar: {exc}") from exc


def validate(spec: GenerateSpec, n_vocab: int) -> None:
    """Reject sampling settings llama.cpp would misbehave on (some of them abort the process)."""
    checks = [
        (spec.max_tokens >= 1, f"max_tokens must be at least 1, got {spec.max_tokens}"),
        (math.isfinite(spec.temperature), "temperature must be a finite number"),
        (spec.repeat_penalty > 0, f"repeat_penalty must be greater than 0, got {spec.repeat_penalty}"),
        (math.isfinite(spec.frequency_penalty), "frequency_penalty must be a finite number"),
        (math.isfinite(spec.presence_penalty), "presence_penalty must be a finite number"),
        (0 <= spec.top_logprobs <= MAX_TOP_LOGPROBS, f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}"),
    ]
    for ok, message in checks:
        if not ok:
            raise EngineError(ErrorCode.INVALID_REQUEST, message)
    for token_id, bias in spec.logit_bias.items():
        if not 0 <= int(token_id) < n_vocab:
            raise EngineError(ErrorCode.INVALID_REQUEST, f"logit_bias names token {token_id}, outside the vocabulary")
        if math.isnan(bias):
            raise EngineError(ErrorCode.INVALID_REQUEST, f"logit_bias for token {token_id} is not a number")


def build_sampler(model: LoadedModel, spec: GenerateSpec) -> LaneSampler:
    """The chain llama.cpp's own samplers use, in their order: bias, penalties, grammar, truncation, temperature."""
    validate(spec, model.n_vocab)
    gbnf = compile_grammar(spec)
    biases = {int(k): float(v) for k, v in spec.logit_bias.items()}
    if spec.ignore_eos and gbnf is None:
        # With a grammar, the end of the grammar is the end of the generation, so EOG stays allowed.
        biases.update({t: -math.inf for t in model.eog_ids})
    penalised = spec.repeat_penalty != 1.0 or spec.frequency_penalty != 0.0 or spec.presence_penalty != 0.0
    greedy = spec.temperature <= 0
    params = L.llama_sampler_chain_default_params()
    params.no_perf = True
    chain = L.llama_sampler_chain_init(params)
    seed = None if greedy else (secrets.randbits(32) if spec.seed is None else spec.seed & 0xFFFFFFFF)
    sampler = LaneSampler(chain, argmax=greedy and not biases and not penalised and gbnf is None, seed=seed)
    try:
        _add_bias(chain, model.n_vocab, biases)
        if penalised:
            L.llama_sampler_chain_add(
                chain,
                L.llama_sampler_init_penalties(
                    model.n_vocab, PENALTY_LAST_N, spec.repeat_penalty, spec.frequency_penalty, spec.presence_penalty
                ),
            )
        if gbnf is not None:
            sampler.grammar = _grammar(model, gbnf)
        _add_pick(chain, spec, greedy)
    except EngineError:
        sampler.free()
        raise
    return sampler


def _add_bias(chain: Any, n_vocab: int, biases: dict[int, float]) -> None:
    if not biases:
        return
    entries = (L.llama_logit_bias * len(biases))()
    for slot, (token_id, bias) in zip(entries, biases.items(), strict=True):
        slot.token, slot.bias = token_id, bias
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_logit_bias(n_vocab, len(biases), entries))


def _grammar(model: LoadedModel, gbnf: str) -> Any:
    if problem := repetition_problem(gbnf):  # a JSON schema's grammar, or a head that did not check
        raise EngineError(ErrorCode.INVALID_GRAMMAR, f"the grammar's {problem}")
    grammar = L.llama_sampler_init_grammar(model.vocab, gbnf.encode("utf-8"), b"root")
    if not grammar:
        raise EngineError(ErrorCode.INVALID_GRAMMAR, "the grammar does not parse as GBNF with a `root` rule")
    cost = _full_filter_cost_s(grammar, model.n_vocab)
    if cost > GRAMMAR_FILTER_BUDGET_S:
        L.llama_sampler_free(grammar)
        raise EngineError(ErrorCode.INVALID_GRAMMAR, f"the grammar is too costly to sample: filtering the vocabulary "
                          f"would take about {cost:.1f} s a token (at most {GRAMMAR_FILTER_BUDGET_S} s)")
    return grammar


def _full_filter_cost_s(grammar: Any, n_vocab: int) -> float:
    """What one filter of the whole vocabulary by `grammar` would take, timed on up to GRAMMAR_PROBE_TOKENS of it:
    what the static check cannot see shows here, beside the decode loop (nodes.agent.engine.beside). The sample is
    filtered in doubling chunks, and the probe stops as soon as its time so far is over the whole sample's share of
    the budget (the whole would take longer still): a costly grammar is found out after a token or two, not after the
    whole sample (llama.cpp cannot be interrupted inside one). Not extrapolated from a part: one token's time is
    mostly the call's own. Applying leaves the grammar's state as it was (only accepting a token moves it)."""
    count = min(GRAMMAR_PROBE_TOKENS, n_vocab)
    share = GRAMMAR_FILTER_BUDGET_S * count / n_vocab
    data = (L.llama_token_data * count)(*(L.llama_token_data(i, 0.0, 0.0) for i in range(count)))
    done, chunk, spent = 0, 1, 0.0
    started = time.thread_time()  # this thread's own time: not the GIL's or the CPUs' waits beside a decode
    while done < count and spent <= share:
        size = min(chunk, count - done)
        window = ctypes.cast(ctypes.byref(data, done * _TOKEN_DATA_SIZE), ctypes.POINTER(L.llama_token_data))
        array = L.llama_token_data_array(window, size, -1, False)
        L.llama_sampler_apply(grammar, ctypes.byref(array))
        done, chunk = done + size, chunk * 2
        spent = time.thread_time() - started
    return spent * n_vocab / count


def _add_pick(chain: Any, spec: GenerateSpec, greedy: bool) -> None:
    if greedy:
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
        return
    if spec.top_k > 0:
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_k(spec.top_k))
    if spec.top_p < 1.0:
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_p(spec.top_p, 1))
    if spec.min_p > 0.0:
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_min_p(spec.min_p, 1))
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(spec.temperature))
    # no dist sampler: LaneSampler draws the token itself, by position


def accept_resume(sampler: LaneSampler, tokens: list[int]) -> None:
    """Feed already-streamed tokens through the sampler (penalties and grammar state), checking each one
    against the grammar first: llama.cpp aborts the process when a grammar accepts a token it forbids."""
    for token_id in tokens:
        if sampler.grammar is not None and not sampler.allows(token_id):
            raise EngineError(ErrorCode.INVALID_REQUEST, "resume_text does not follow the generation's grammar")
        sampler.accept(token_id)


def token_logprobs(model: LoadedModel, ctx: Any, index: int, token_id: int, n_top: int) -> dict[str, Any]:
    """The sampled token's log-probability under the model (log-softmax of the raw logits) and the top
    `n_top` alternatives."""
    logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, index), shape=(model.n_vocab,)).astype(np.float64)
    peak = logits.max()
    log_z = peak + math.log(np.exp(logits - peak).sum())
    top: list[dict[str, Any]] = []
    if n_top > 0:
        best = np.argpartition(-logits, n_top)[:n_top]
        best = best[np.argsort(-logits[best])]
        top = [{**_piece(model, int(t)), "logprob": float(logits[t] - log_z)} for t in best]
    return {**_piece(model, token_id), "logprob": float(logits[token_id] - log_z), "top": top}


def _piece(model: LoadedModel, token_id: int) -> dict[str, Any]:
    """A token's text and its raw UTF-8 bytes: one character can span several tokens (an emoji is often
    three), so a piece on its own may not decode and only the bytes put the text back together."""
    raw = model.piece(token_id)
    return {"token": raw.decode("utf-8", errors="replace"), "bytes": list(raw)}
