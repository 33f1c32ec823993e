"""Placement (the replica rule), its lifecycle and prefix keys: nodes.link.placement.PlacementState,
nodes.link.lifecycle.PlacementLifecycle and nodes.link.prefix. test_placement_redis.py runs them all again on Redis.

No database, no Django: the placement state is plain in-process Python shared by the head and by replicas.
"""

from __future__ import annotations

import zlib

from nodes.link import lifecycle as lifecycle_module
from nodes.link import prefix
from nodes.link.lifecycle import PlacementLifecycle, aio
from nodes.link.placement import NodeSlot, PlacementState
from nodes.link.spec import GenerateSpec

MODEL = "m"
BLOCK_CHARS = 4 * prefix.BLOCK_TOKENS


class FourChars:
    """A stand-in tokenizer with exact, easy counts: every 4 characters are a token. (The real ones, llama.cpp's,
    are tested in test_tokenizers.py.)"""

    fingerprint = "four-chars"
    inline = True

    @staticmethod
    def tokenize(text: str) -> list[int]:
        return [zlib.crc32(text[i:i + 4].encode()) % 2**31 for i in range(0, len(text), 4)]


TOKENIZER = FourChars()


def prefix_keys(*, model: str, prompt: str | None = None, messages: list[dict] | None = None) -> list[prefix.PrefixKey]:
    return prefix.prefix_keys(space=model, tokenize=TOKENIZER.tokenize, prompt=prompt, messages=messages)


def placement_keys(spec: GenerateSpec) -> list[prefix.PrefixKey]:
    return lifecycle_module.placement_keys(spec, TOKENIZER)


def slot(node_id: str, *, lanes: int = 4, running: int = 0, models: tuple[str, ...] = (MODEL,)) -> NodeSlot:
    return NodeSlot(node_id, f"node-{node_id}", list(models), lanes, running=running)


def fleet(*node_ids: str, load_tokens: int = 3000, max_keys: int = 200_000, lanes: int = 4) -> PlacementState:
    state = PlacementState(load_tokens=load_tokens, max_keys=max_keys)
    for node_id in node_ids:
        state.node_up(slot(node_id, lanes=lanes))
    return state


def running(state: PlacementState) -> dict[str, int]:
    return {s.node_id: s.running for s in state.nodes()}


def chat(system: str, *turns: str) -> list[dict[str, str]]:
    """A conversation: the system prompt, then user / assistant turns alternating."""
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return messages


# --- the cost formula ------------------------------------------------------------------------------


def test_cost_is_tokens_to_read_again_plus_load_penalty_per_running_generation():
    # Given a 1024-character prompt (256 tokens at 4 chars a token) whose first half node a already holds,
    # while a runs one generation and b runs none
    keys = prefix_keys(model=MODEL, prompt="x" * 1024)
    assert [k.tokens for k in keys] == [64, 128, 192, 256]
    state = PlacementState(load_tokens=100)
    state.node_up(slot("a", running=1))
    state.node_up(slot("b"))
    state.record("a", "g0", keys[:2])

    # When a generation is placed, a costs 128 to read again + 100 for its running one; b costs all 256
    choice = state.choose(MODEL, keys)

    assert choice is not None
    assert (choice.node_id, choice.cost, choice.matched_tokens, choice.prompt_tokens_estimate) == ("a", 228, 128, 256)
    assert choice.runner_up == {"node": "node-b", "cost": 256, "matched_tokens": 0}
    assert running(state) == {"a": 2, "b": 0}


def test_a_heavier_load_penalty_sends_the_same_prompt_to_the_idle_node():
    keys = prefix_keys(model=MODEL, prompt="x" * 1024)
    state = PlacementState(load_tokens=200)
    state.node_up(slot("a", running=1))
    state.node_up(slot("b"))
    state.record("a", "g0", keys[:2])

    choice = state.choose(MODEL, keys)

    # a would cost 128 + 200 = 328, more than b's 256
    assert (choice.node_id, choice.cost, choice.matched_tokens) == ("b", 256, 0)
    assert choice.runner_up == {"node": "node-a", "cost": 328, "matched_tokens": 128}


def test_matching_stops_at_the_first_key_the_node_does_not_hold():
    keys = prefix_keys(model=MODEL, prompt="y" * 1024)
    state = fleet("a", load_tokens=0)
    state.record("a", "g0", [keys[0], keys[2], keys[3]])  # a hole at the second block

    choice = state.choose(MODEL, keys)

    assert (choice.matched_tokens, choice.cost) == (64, 192)


def test_no_keys_costs_only_the_load():
    state = PlacementState(load_tokens=50)
    state.node_up(slot("a", running=3))
    choice = state.choose(MODEL, [])
    assert (choice.cost, choice.matched_tokens, choice.prompt_tokens_estimate) == (150, 0, 0)


def test_costs_count_the_keys_own_tokens_whatever_the_node_reports_having_read():
    # The keys carry exact token counts (the model's tokenizer), so what a node reports it read (its prompt_tokens,
    # which also count its chat template) changes no cost: nothing is estimated, nothing learned.
    keys = prefix_keys(model=MODEL, prompt="z" * 1024)
    state = fleet("a", "b", load_tokens=0)
    for i in range(30):
        PlacementLifecycle(state).done("a", GenerateSpec(gen_id=f"g{i}", model=MODEL, prompt="z" * 1024), keys,
                                       answer="", usage={"prompt_tokens": 128}, tokenizer=TOKENIZER)

    choice = state.choose(MODEL, keys)
    assert (choice.prompt_tokens_estimate, choice.matched_tokens, choice.cost) == (256, 256, 0)
    assert choice.runner_up == {"node": "node-b", "cost": 256, "matched_tokens": 0}


def test_nodes_cost_the_same_for_a_prompt_nobody_holds():
    # a has done many generations, b none: a prompt neither holds costs both its whole token count, so the
    # tie-break, not the node's history, picks the node.
    state = fleet("a", "b", load_tokens=0)
    seen = prefix_keys(model=MODEL, prompt="k" * 1024)
    for i in range(40):
        state.record("a", f"g{i}", seen)
    for _ in range(3):  # idle nodes take turns: a, b, a
        state.release(state.choose(MODEL, []).node_id)

    fresh = prefix_keys(model=MODEL, prompt="q" * 1024)
    choice = state.choose(MODEL, fresh)
    assert (choice.node_id, choice.cost) == ("b", choice.runner_up["cost"])  # the least routed, at the same cost
    assert choice.cost == fresh[-1].tokens == 256
    assert state.choose(MODEL, fresh).node_id == "a"  # then the least loaded


# --- tie-breaks ------------------------------------------------------------------------------------


def test_equal_cost_goes_to_the_least_loaded_node():
    state = PlacementState(load_tokens=0)  # load adds no cost, so every node costs the same
    state.node_up(slot("a", running=2))
    state.node_up(slot("b", running=1))
    state.node_up(slot("c", running=3))

    assert state.choose(MODEL, []).node_id == "b"
    assert state.choose(MODEL, []).node_id in {"a", "b"}  # both now run 2
    assert running(state)["c"] == 3


def test_idle_nodes_share_the_work_least_routed_first():
    state = fleet("a", "b", "c")
    placed = []
    for _ in range(6):  # one generation at a time: every node is idle at each choice
        choice = state.choose(MODEL, [])
        placed.append(choice.node_id)
        state.release(choice.node_id)

    assert placed == ["a", "b", "c", "a", "b", "c"]
    assert {s.node_id: s.routed for s in state.nodes()} == {"a": 2, "b": 2, "c": 2}


def test_concurrent_generations_spread_over_idle_nodes():
    state = fleet("a", "b", "c")
    placed = [state.choose(MODEL, []).node_id for _ in range(6)]
    assert sorted(placed) == ["a", "a", "b", "b", "c", "c"]
    assert running(state) == {"a": 2, "b": 2, "c": 2}


# --- a conversation goes back to its node ------------------------------------------------------------


def test_next_turn_returns_to_its_node_until_that_node_is_busier_by_more_than_the_reread():
    system = "You are a careful assistant for the fleet. " * 40  # 1720 chars: about 430 tokens
    state = fleet("a", "b", "c", load_tokens=300)
    turn1 = chat(system, "Hello, who are you?")
    first = state.choose(MODEL, prefix_keys(model=MODEL, messages=turn1))
    assert (first.node_id, first.matched_tokens) == ("a", 0)
    answer = "I am the fleet's assistant."
    held = prefix_keys(model=MODEL, messages=[*turn1, {"role": "assistant", "content": answer}])
    state.record("a", "g1", held)
    state.release("a")
    keys2 = prefix_keys(model=MODEL, messages=chat(system, "Hello, who are you?", answer, "Tell me more."))
    whole, new = keys2[-1].tokens, keys2[-1].tokens - held[-1].tokens
    assert 0 < new < whole - 300 and whole < 2 * 300

    # When a runs one generation more than b and c: 300 + the new turn is cheaper than the whole prompt
    state.choose(MODEL, [], exclude={"b", "c"})
    again = state.choose(MODEL, keys2)
    assert (again.node_id, again.matched_tokens, again.cost) == ("a", held[-1].tokens, new + 300)
    assert again.runner_up == {"node": "node-b", "cost": whole, "matched_tokens": 0}
    state.release("a")

    # When it runs two more (600 > the whole prompt), the turn is read again on an idle node
    state.choose(MODEL, [], exclude={"b", "c"})
    assert running(state) == {"a": 2, "b": 0, "c": 0}
    elsewhere = state.choose(MODEL, keys2)
    assert (elsewhere.node_id, elsewhere.matched_tokens, elsewhere.cost) == ("b", 0, whole)
    assert elsewhere.runner_up == {"node": "node-c", "cost": whole, "matched_tokens": 0}
    assert state.holders(held[-1].key) == {"a"}  # a still holds the conversation for the turn after


# --- forgetting: restart, cache cleared, eviction ------------------------------------------------------


def test_a_restarted_node_is_forgotten_and_its_routed_count_reset():
    keys = prefix_keys(model=MODEL, prompt="r" * 512)
    state = fleet("a", "b")
    state.record("a", "g1", keys)
    state.record("b", "g2", keys)
    state.choose(MODEL, [])
    state.release("a")

    state.node_up(slot("a"), cache_cleared=True)

    assert state.holders(keys[-1].key) == {"b"}
    assert state.choose(MODEL, keys).node_id == "b"
    assert {s.node_id: s.routed for s in state.nodes()}["a"] == 0


def test_a_reconnect_without_cache_loss_keeps_what_the_node_holds():
    keys = prefix_keys(model=MODEL, prompt="r" * 512)
    state = fleet("a", "b")
    state.record("a", "g1", keys)
    state.choose(MODEL, keys)
    state.release("a")

    state.node_up(slot("a"), cache_cleared=False)

    assert state.holders(keys[-1].key) == {"a"}
    assert {s.node_id: s.routed for s in state.nodes()}["a"] == 1
    assert state.choose(MODEL, keys).matched_tokens == keys[-1].tokens


def test_forget_node_drops_everything_the_node_held_and_node_down_only_its_slot():
    keys = prefix_keys(model=MODEL, prompt="f" * 512)
    state = fleet("a", "b")
    state.record("a", "g1", keys)
    state.record("b", "g2", keys)

    state.forget_node("a")
    assert state.holders(keys[0].key) == {"b"}
    state.evict("a", ["g1"])  # a late eviction report for a forgotten generation changes nothing
    assert state.holders(keys[0].key) == {"b"}

    state.node_down("b")
    assert [s.node_id for s in state.nodes()] == ["a"]
    assert state.choose(MODEL, keys).matched_tokens == 0  # b is gone from placement
    state.release("a")
    state.node_up(slot("b"), cache_cleared=False)  # back with its cache (a link blip): placed by it at once
    assert state.choose(MODEL, keys).node_id == "b"


def test_a_parked_restart_keeps_exactly_what_its_restored_lanes_hold():
    system = prefix_keys(model=MODEL, messages=chat("p" * 600, "question one"))
    other = prefix_keys(model=MODEL, messages=chat("q" * 600, "question two"))
    state = fleet("a", "b")
    state.record("a", "g-restored", system)
    state.record("a", "g-lost", other)
    state.node_down("a")

    state.node_up(slot("a"), cache_cleared=True, warm=["g-restored"])

    assert state.holders(system[-1].key) == {"a"} and state.holders(other[-1].key) == set()
    choice = state.choose(MODEL, system)
    assert choice.node_id == "a" and choice.matched_tokens == system[-1].tokens
    state.release("a")
    state.evict("a", ["g-restored"])  # and the kept generation can still be evicted as before
    assert state.holders(system[-1].key) == set()


def test_eviction_drops_only_the_keys_that_generation_put_there():
    system = "s" * 600
    state = fleet("a")
    turn1 = prefix_keys(model=MODEL, messages=chat(system, "first question", "first answer"))
    other = prefix_keys(model=MODEL, messages=chat("another system prompt", "unrelated"))
    state.record("a", "g1", turn1)
    state.record("a", "g9", other)

    state.evict("a", ["g1"])

    assert all(state.holders(k.key) == set() for k in turn1)
    assert all(state.holders(k.key) == {"a"} for k in other)


def test_a_generation_recorded_twice_is_gone_after_one_eviction():
    """A done may be recorded twice (a retried report): the node's one eviction report for that generation still
    drops what it put there."""
    state = fleet("a")
    turn = prefix_keys(model=MODEL, messages=chat("s" * 600, "q1", "a1"))
    state.record("a", "g1", turn)
    state.record("a", "g1", turn)

    state.evict("a", ["g1"])

    assert all(state.holders(k.key) == set() for k in turn)


def test_eviction_keeps_keys_a_later_generation_recorded_again():
    system = "s" * 600
    state = fleet("a")
    turn1 = prefix_keys(model=MODEL, messages=chat(system, "q1", "a1"))
    turn2 = prefix_keys(model=MODEL, messages=chat(system, "q1", "a1", "q2", "a2"))
    assert turn2[: len(turn1)] == turn1
    state.record("a", "g1", turn1)
    state.record("a", "g2", turn2)  # the next turn re-read, and so holds again, the whole of turn 1

    state.evict("a", ["g1"])  # the lane g1 used was taken, but g2 still holds its prefix
    assert all(state.holders(k.key) == {"a"} for k in turn2)
    assert state.choose(MODEL, turn2).matched_tokens == turn2[-1].tokens
    state.release("a")

    state.evict("a", ["g2"])
    assert all(state.holders(k.key) == set() for k in turn2)


def test_evicting_one_lane_keeps_a_shared_system_prompt_another_lane_still_holds():
    # Two conversations share a system prompt on node a, each in its own lane. The second one's lane is
    # taken by an unrelated generation; the first conversation's lane still holds the system prompt and its
    # own history, so its next turn must still match all of it.
    system = "shared system prompt. " * 40
    state = fleet("a", "b", load_tokens=0)
    conv1 = prefix_keys(model=MODEL, messages=chat(system, "q1", "a1"))
    conv2 = prefix_keys(model=MODEL, messages=chat(system, "other question", "other answer"))
    state.record("a", "g1", conv1)
    state.record("a", "g2", conv2)

    state.evict("a", ["g2"])

    assert all(state.holders(k.key) == {"a"} for k in conv1)
    assert state.holders(conv2[-1].key) == set()
    next_turn = prefix_keys(model=MODEL, messages=chat(system, "q1", "a1", "q2"))
    choice = state.choose(MODEL, next_turn)
    assert (choice.node_id, choice.matched_tokens) == ("a", conv1[-1].tokens)


# --- the LRU cap ----------------------------------------------------------------------------------------


def test_the_index_drops_the_least_recently_used_keys_past_max_keys():
    state = fleet("a", max_keys=4, load_tokens=0)
    old = prefix_keys(model=MODEL, prompt="o" * 512)  # 2 keys each
    mid = prefix_keys(model=MODEL, prompt="m" * 512)
    new = prefix_keys(model=MODEL, prompt="n" * 512)
    state.record("a", "g1", old)
    state.record("a", "g2", mid)
    assert state.index_size() == 4

    state.choose(MODEL, old)  # placing a prompt uses its keys: `old` is now more recent than `mid`
    state.release("a")
    state.record("a", "g3", new)

    assert state.index_size() == 4
    assert [state.holders(k.key) for k in mid] == [set(), set()]
    assert [state.holders(k.key) for k in old + new] == [{"a"}] * 4


def test_recording_refreshes_keys_too():
    state = fleet("a", max_keys=4)
    first = prefix_keys(model=MODEL, prompt="1" * 512)
    second = prefix_keys(model=MODEL, prompt="2" * 512)
    state.record("a", "g1", first)
    state.record("a", "g2", second)
    state.record("a", "g3", first)  # first is the newest again
    state.record("a", "g4", prefix_keys(model=MODEL, prompt="3" * 256))

    assert state.index_size() == 4
    assert state.holders(second[0].key) == set()
    assert state.holders(second[1].key) == {"a"}
    assert all(state.holders(k.key) == {"a"} for k in first)


# --- who may take work ------------------------------------------------------------------------------------


def test_a_drained_node_takes_no_work_even_when_it_holds_the_prompt():
    keys = prefix_keys(model=MODEL, prompt="d" * 1024)
    state = fleet("a", "b")
    state.record("a", "g1", keys)

    state.set_schedulable("a", False)
    choice = state.choose(MODEL, keys)
    assert choice.node_id == "b" and choice.candidates == 1 and choice.runner_up is None
    assert state.free_lanes(MODEL) == 3

    state.set_schedulable("b", False)
    assert state.choose(MODEL, keys) is None
    assert state.free_lanes(MODEL) == 0

    state.set_schedulable("a", True)
    assert state.choose(MODEL, keys).node_id == "a"


def test_only_nodes_serving_the_model_are_candidates():
    state = PlacementState()
    state.node_up(slot("a", models=("llama",)))
    state.node_up(slot("b", models=("qwen",)))
    assert state.choose("qwen", []).node_id == "b"
    assert state.choose("mistral", []) is None
    assert state.models() == ["llama", "qwen"]


def test_a_full_node_takes_nothing_until_release_frees_a_lane():
    state = fleet("a", lanes=2)
    assert state.choose(MODEL, []).node_id == "a"
    assert state.choose(MODEL, []).node_id == "a"
    assert state.choose(MODEL, []) is None
    assert state.free_lanes(MODEL) == 0

    state.release("a")
    assert state.free_lanes(MODEL) == 1
    assert state.choose(MODEL, []).node_id == "a"


def test_release_never_goes_below_zero_and_ignores_unknown_nodes():
    state = fleet("a", lanes=2)
    state.release("a")
    state.release("nobody")
    assert running(state) == {"a": 0}
    assert state.free_lanes(MODEL) == 2


def test_exclude_skips_nodes_a_failed_attempt_used():
    keys = prefix_keys(model=MODEL, prompt="e" * 1024)
    state = fleet("a", "b")
    state.record("a", "g1", keys)
    assert state.choose(MODEL, keys, exclude={"a"}).node_id == "b"


# --- placement evidence -----------------------------------------------------------------------------------


def test_evidence_names_the_choice_its_cost_and_the_runner_up():
    keys = prefix_keys(model=MODEL, prompt="v" * 1024)
    state = fleet("a", "b", "c", load_tokens=1000)
    state.record("b", "g1", keys[:3])

    evidence = state.choose(MODEL, keys).evidence()

    assert evidence == {
        "node": "node-b",
        "node_id": "b",
        "cost": 64,
        "matched_tokens": 192,
        "prompt_tokens_estimate": 256,
        "runner_up": {"node": "node-a", "cost": 256, "matched_tokens": 0},
        "candidates": 3,
        "ranking": [
            {"node": "node-b", "node_id": "b", "cost": 64, "reread_tokens": 64, "load_tokens": 0, "matched_tokens": 192,
             "running": 0, "load_per_generation": 1000},
            {"node": "node-a", "node_id": "a", "cost": 256, "reread_tokens": 256, "load_tokens": 0, "matched_tokens": 0,
             "running": 0, "load_per_generation": 1000},
            {"node": "node-c", "node_id": "c", "cost": 256, "reread_tokens": 256, "load_tokens": 0, "matched_tokens": 0,
             "running": 0, "load_per_generation": 1000},
        ],
    }


def test_evidence_splits_each_candidates_cost_into_tokens_to_read_again_and_load():
    keys = prefix_keys(model=MODEL, prompt="w" * 1024)
    state = fleet("a", "b", load_tokens=100)
    state.record("a", "g1", keys)
    state.choose(MODEL, keys)  # a: the whole prompt held, one running now

    ranking = state.choose(MODEL, keys).evidence()["ranking"]

    assert [(r["node"], r["reread_tokens"], r["load_tokens"], r["running"]) for r in ranking] == [
        ("node-a", 0, 100, 1), ("node-b", 256, 0, 0)]
    assert all(r["cost"] == r["reread_tokens"] + r["load_tokens"] for r in ranking)


# --- the placement lifecycle (what dispatch, replicas and bench/routing.py all go through) ---------------


def test_done_records_the_prompt_and_the_answer_so_the_next_turn_matches_all_of_it_and_frees_the_lane():
    system = "You are a careful assistant for the fleet. " * 20
    state = fleet("a", "b", load_tokens=0)
    lifecycle = PlacementLifecycle(state)
    turn1 = GenerateSpec(gen_id="g1", model=MODEL, messages=chat(system, "Hello?"))
    first = lifecycle.choose(turn1, placement_keys(turn1))
    assert running(state)[first.node_id] == 1

    lifecycle.done(first.node_id, turn1, placement_keys(turn1), answer=" Hi, I am the fleet.",
                   usage={"completion_tokens": 7}, tokenizer=TOKENIZER)

    assert running(state) == {"a": 0, "b": 0}
    # the client sends the answer back trimmed: the whole conversation so far is held where it ran
    turn2 = GenerateSpec(gen_id="g2", model=MODEL, messages=chat(system, "Hello?", "Hi, I am the fleet.", "More?"))
    keys2 = placement_keys(turn2)
    again = lifecycle.choose(turn2, keys2)
    assert (again.node_id, again.matched_tokens) == (first.node_id, keys2[-2].tokens)


async def test_the_awaitable_steps_place_record_and_free_as_the_plain_ones():
    """What the head's event loop calls (`aio` operations: redis.asyncio on Redis): the same steps, the same state."""
    system = "You are a careful assistant for the fleet. " * 20
    state = fleet("a", "b", load_tokens=0)
    lifecycle = PlacementLifecycle(state)
    turn1 = GenerateSpec(gen_id="g1", model=MODEL, messages=chat(system, "Hello?"))
    first = await lifecycle.achoose(turn1, placement_keys(turn1))
    await lifecycle.aaccepted(first.node_id, [])
    await lifecycle.adone(first.node_id, turn1, placement_keys(turn1), answer=" Hi, I am the fleet.",
                          usage={"completion_tokens": 7}, tokenizer=TOKENIZER)
    assert running(state) == {"a": 0, "b": 0}

    turn2 = GenerateSpec(gen_id="g2", model=MODEL, messages=chat(system, "Hello?", "Hi, I am the fleet.", "More?"))
    keys2 = placement_keys(turn2)
    again = await lifecycle.achoose(turn2, keys2)
    assert (again.node_id, again.matched_tokens) == (first.node_id, keys2[-2].tokens)
    await lifecycle.alost(again.node_id, "g2", cache_gone=True)
    assert running(state) == {"a": 0, "b": 0} and state.holders(keys2[-2].key) == set()


async def test_a_named_prefix_is_held_where_its_generation_ran_until_that_lane_is_evicted():
    """A prompt_cache_key's key (lifecycle.named_placement_key) is recorded with the prompt's keys where it ran, is
    scoped by its name and space, and goes when that generation's lane is evicted (what fleet.placing looks up)."""
    state = fleet("a", "b", load_tokens=0)
    lifecycle = PlacementLifecycle(state)
    spec = GenerateSpec(gen_id="g1", model=MODEL, messages=chat("Be brief.", "Hello?"))
    named = lifecycle_module.named_placement_key(spec, TOKENIZER, "key-1\x1fconv-7")
    assert named.tokens == 0 and named != lifecycle_module.named_placement_key(spec, TOKENIZER, "key-2\x1fconv-7")
    assert named != lifecycle_module.named_placement_key(GenerateSpec(gen_id="g", model="other"), TOKENIZER,
                                                         "key-1\x1fconv-7")
    first = await lifecycle.achoose(spec, placement_keys(spec))
    await lifecycle.adone(first.node_id, spec, [*placement_keys(spec), named], answer="Hi.", usage={},
                          tokenizer=TOKENIZER)
    assert await aio(state).holders(named.key) == {first.node_id}
    await lifecycle.aaccepted(first.node_id, ["g1"])
    assert await aio(state).holders(named.key) == set()


def test_a_lane_is_freed_once_however_many_ends_are_reported():
    state = fleet("a", lanes=4)
    lifecycle = PlacementLifecycle(state)
    specs = [GenerateSpec(gen_id=f"g{i}", model=MODEL, prompt="p") for i in range(3)]
    for spec in specs:
        lifecycle.choose(spec, [])
    assert running(state) == {"a": 3}

    lifecycle.done("a", specs[0], [], answer="x", usage={}, tokenizer=TOKENIZER)
    lifecycle.ended("a", "g0")  # the link reports the same end as the dispatcher
    lifecycle.ended("a", "g1")
    lifecycle.lost("a", "g1")
    lifecycle.ended("a", "never-placed")

    assert running(state) == {"a": 1}


def test_accepted_forgets_what_the_nodes_lane_choice_evicted():
    keys = prefix_keys(model=MODEL, prompt="q" * 1024)
    state = fleet("a", load_tokens=0)
    state.record("a", "g-old", keys)
    PlacementLifecycle(state).accepted("a", ["g-old"])
    assert state.holders(keys[-1].key) == set()


def test_a_lost_engine_forgets_its_cache_and_a_lost_link_keeps_it():
    keys = prefix_keys(model=MODEL, prompt="z" * 1024)
    state = fleet("a", "b", load_tokens=0)
    lifecycle = PlacementLifecycle(state)
    state.record("a", "g0", keys)
    lifecycle.lost("a", "g1")
    assert state.holders(keys[-1].key) == {"a"}
    lifecycle.lost("a", "g1", cache_gone=True)
    assert state.holders(keys[-1].key) == set()


# --- the learned load cost ---------------------------------------------------------------------------------


def measured_fleet(figures: dict[str, tuple[float, float]], *, answer_tokens: int = 100,
                   load_tokens: int | None = None) -> PlacementState:
    """Nodes that measured (prefill tokens/s, decode slowdown ms) and finished one answer of `answer_tokens`."""
    state = PlacementState(load_tokens=load_tokens)
    lifecycle = PlacementLifecycle(state)
    for node_id, (prefill_tps, slowdown_ms) in figures.items():
        state.node_up(slot(node_id))
        lifecycle.measured(node_id, {"prefill_tps": prefill_tps, "decode_slowdown_ms": slowdown_ms})
        spec = GenerateSpec(gen_id=f"warm-{node_id}", model=MODEL, prompt="w")
        lifecycle.done(node_id, spec, [], answer="", usage={"completion_tokens": answer_tokens}, tokenizer=TOKENIZER)
    return state


def test_the_load_cost_is_what_the_node_could_read_in_the_time_one_more_generation_costs():
    # a reads 500 tokens/s and each running generation adds 8 ms to its steps: over the half of a 100-token answer a
    # running generation has left, that is 0.4 s, 200 prompt tokens; b reads 10,000 tokens/s and is slowed 0.5 ms a
    # step: 0.025 s, 250 tokens
    state = measured_fleet({"a": (500.0, 8.0), "b": (10_000.0, 0.5)})
    state.choose(MODEL, [], exclude={"b"})
    state.choose(MODEL, [], exclude={"a"})

    ranking = state.choose(MODEL, []).evidence()["ranking"]

    assert sorted((r["node"], r["load_per_generation"], r["load_tokens"]) for r in ranking) == [
        ("node-a", 200, 200), ("node-b", 250, 250)]
    assert ranking[0]["node"] == "node-a"


def test_a_node_slowed_more_by_load_gives_up_a_held_prompt_sooner():
    keys = prefix_keys(model=MODEL, prompt="k" * 2048)  # 512 tokens
    for slowdown_ms, goes_to in ((2.0, "a"), (30.0, "b")):  # 50 or 750 tokens a running generation
        state = measured_fleet({"a": (500.0, slowdown_ms), "b": (500.0, slowdown_ms)})
        state.record("a", "g1", keys)
        state.choose(MODEL, [], exclude={"b"})
        assert state.choose(MODEL, keys).node_id == goes_to


def test_the_answer_length_is_learned_from_what_nodes_finish():
    state = measured_fleet({"a": (1000.0, 1.0)}, answer_tokens=100)
    assert [state.load_of(s) for s in state.nodes()] == [50]
    PlacementLifecycle(state).done("a", GenerateSpec(gen_id="g2", model=MODEL, prompt="x"), [], answer="",
                                   usage={"completion_tokens": 300}, tokenizer=TOKENIZER)
    assert [state.load_of(s) for s in state.nodes()] == [70]  # a moving mean: 0.8 x 100 + 0.2 x 300 tokens


def test_a_node_that_measured_nothing_costs_no_load_and_a_setting_overrides_what_was_learned():
    assert [s.learned_load_tokens for s in fleet("a").nodes()] == [0]
    state = measured_fleet({"a": (500.0, 8.0)}, load_tokens=50)
    state.choose(MODEL, [])
    assert state.choose(MODEL, []).evidence()["ranking"][0]["load_tokens"] == 50


# --- prefix keys -------------------------------------------------------------------------------------------


def test_token_ids_hash_as_four_little_endian_signed_bytes_each():
    from nodes.link.prefix import _ids

    # the bytes every prefix key is hashed from: a change here would split head and node keys across versions
    assert _ids([1, -2, 70_000]) == b"\x01\x00\x00\x00" + b"\xfe\xff\xff\xff" + b"\x70\x11\x01\x00"


def test_prefix_keys_are_stable_for_the_same_messages():
    messages = chat("be brief", "hello")
    assert prefix_keys(model=MODEL, messages=messages) == prefix_keys(model=MODEL, messages=[dict(m) for m in messages])
    assert prefix_keys(model=MODEL, prompt="p" * 700) == prefix_keys(model=MODEL, prompt="p" * 700)


def test_a_conversations_turns_share_their_prefix_keys():
    system = "You answer questions about llama.cpp fleets. " * 20
    turn1 = prefix_keys(model=MODEL, messages=chat(system, "What is a lane?"))
    turn2 = prefix_keys(model=MODEL, messages=chat(system, "What is a lane?", "A decode slot.", "And a node?"))

    assert turn2[: len(turn1)] == turn1
    assert len(turn2) == len(turn1) + 2  # one boundary per added message (both are short)
    assert turn2[-1].tokens > turn1[-1].tokens


def test_a_long_system_prompt_gets_block_keys_so_other_conversations_match_it():
    system = "s" * (3 * BLOCK_CHARS + 10)
    one = prefix_keys(model=MODEL, messages=chat(system, "question one"))
    two = prefix_keys(model=MODEL, messages=chat(system, "question two"))

    # three block keys inside the system message, then its boundary, then the user message's boundary
    assert len(one) == 5
    assert one[:4] == two[:4] and one[4] != two[4]
    assert [k.tokens * 4 for k in one[:3]] == [BLOCK_CHARS, 2 * BLOCK_CHARS, 3 * BLOCK_CHARS]


def test_raw_prompts_get_block_keys_with_token_offsets():
    keys = prefix_keys(model=MODEL, prompt="a" * (2 * BLOCK_CHARS + 100))
    assert [k.tokens * 4 for k in keys] == [BLOCK_CHARS, 2 * BLOCK_CHARS]  # a partial last block has no key
    changed = prefix_keys(model=MODEL, prompt="a" * BLOCK_CHARS + "b" * (BLOCK_CHARS + 100))
    assert changed[0] == keys[0] and changed[1] != keys[1]


def test_prefix_keys_differ_across_models():
    messages = chat("be brief", "hello")
    a = prefix_keys(model="llama", messages=messages)
    b = prefix_keys(model="qwen", messages=messages)
    assert len(a) == len(b)
    assert not {k.key for k in a} & {k.key for k in b}
    assert not {k.key for k in prefix_keys(model="llama", prompt="x" * 512)} & {
        k.key for k in prefix_keys(model="qwen", prompt="x" * 512)
    }


def test_prefix_keys_differ_across_tokenizers_even_for_the_same_ids():
    # The same ids mean other text in another vocabulary: a node with another tokenizer holds none of these prompts.
    class Renamed(FourChars):
        fingerprint = "another-vocabulary"

    spec = GenerateSpec(gen_id="g", model=MODEL, messages=chat("be brief", "hello"), prompt=None)
    ours, theirs = lifecycle_module.placement_keys(spec, TOKENIZER), lifecycle_module.placement_keys(spec, Renamed())
    assert [k.tokens for k in ours] == [k.tokens for k in theirs]
    assert not {k.key for k in ours} & {k.key for k in theirs}


def test_different_conversations_do_not_share_keys_after_their_first_difference():
    one = prefix_keys(model=MODEL, messages=chat("system one", "hi"))
    two = prefix_keys(model=MODEL, messages=chat("system two", "hi"))
    assert not {k.key for k in one} & {k.key for k in two}


def test_an_answer_sent_back_trimmed_still_matches_the_keys_recorded_as_streamed():
    turn1 = chat("be brief", "hello")
    recorded = prefix_keys(model=MODEL, messages=[*turn1, {"role": "assistant", "content": " Hi there.\n"}])
    resent = prefix_keys(model=MODEL, messages=[*turn1, {"role": "assistant", "content": "Hi there."}, {
        "role": "user", "content": "and then?"}])
    assert resent[: len(recorded)] == recorded


# --- keys from the model's own tokenizer (llama.cpp's, vocabulary only) ------------------------------------------


def smollm2_vocab():
    from nodes.agent.models import resolve_model
    from nodes.agent.vocab import Vocab, tokenizer_fingerprint

    path, _ = resolve_model("smollm2")
    return Vocab(path, tokenizer_fingerprint(path))


def test_keys_count_the_models_own_tokens_exactly():
    vocab = smollm2_vocab()
    prompt = "The fleet places each generation on the node that holds its prompt. " * 12
    ids = vocab.tokenize(prompt)

    keys = lifecycle_module.placement_keys(GenerateSpec(gen_id="g", model=MODEL, prompt=prompt), vocab)

    assert len(ids) > 128
    assert [k.tokens for k in keys] == list(range(64, len(ids) + 1, 64))  # a partial last block has no key
    messages = chat("You are terse. " * 30, "What is a lane?")
    chat_keys = lifecycle_module.placement_keys(GenerateSpec(gen_id="g", model=MODEL, messages=messages), vocab)
    system, user = (len(vocab.tokenize(prefix._message_text(m))) for m in messages)
    assert [k.tokens for k in chat_keys] == [*range(64, system + 1, 64), system, system + user]


def test_a_chats_next_turn_matches_the_keys_its_answer_left_on_the_node():
    # Given a conversation's first turn done on node a with the real tokenizer (the answer streamed with a space)
    vocab = smollm2_vocab()
    state = fleet("a", "b", load_tokens=0)
    lifecycle = PlacementLifecycle(state)
    turn1 = GenerateSpec(gen_id="g1", model=MODEL, messages=chat("You answer questions about fleets. " * 10, "Hi"))
    keys1 = lifecycle_module.placement_keys(turn1, vocab)
    first = lifecycle.choose(turn1, keys1)
    lifecycle.done(first.node_id, turn1, keys1, answer=" Hello! I place generations.", usage={}, tokenizer=vocab)

    # When the client sends the next turn (the answer back, trimmed, and a new question)
    turn2 = GenerateSpec(gen_id="g2", model=MODEL, messages=[*turn1.messages, {
        "role": "assistant", "content": "Hello! I place generations."}, {"role": "user", "content": "How?"}])
    keys2 = lifecycle_module.placement_keys(turn2, vocab)
    again = lifecycle.choose(turn2, keys2)

    # Then it goes back to that node, which holds every token but the new question's
    question = len(vocab.tokenize(prefix._message_text(turn2.messages[-1])))
    assert (again.node_id, again.matched_tokens, again.cost) == (first.node_id, keys2[-2].tokens, question)
    other = lifecycle_module.placement_keys(turn2, TOKENIZER)  # keys of another tokenizer never match
    assert not {k.key for k in other} & {k.key for k in keys2}
