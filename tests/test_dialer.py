"""The node agent's dialer on its own: when it redials, and when it tells the head its engine is down or back."""

import asyncio
import contextlib
import os

import pytest
from websockets.exceptions import ConnectionClosedError

from nodes.agent.dialer import AgentConfig, HeadLink, NodeAgent
from nodes.link.handshake import LOCAL_TOKEN_ID, format_token, make_secret
from nodes.link.messages import Bundle, Heartbeat, TokenBatch, unbundle
from tests.test_link_channel import _connect

pytestmark = pytest.mark.asyncio


class FakeEngine:
    alive = True

    def stats(self):
        return {"lanes": 2, "lanes_busy": 0}


def agent(tmp_path, engine=None) -> NodeAgent:
    config = AgentConfig(head="127.0.0.1:1", token=format_token(LOCAL_TOKEN_ID, make_secret()), home=tmp_path,
                         backoff_start=1.0, backoff_max=16.0)
    return NodeAgent(config, engine or FakeEngine())


async def delays_between(node: NodeAgent, sessions, monkeypatch) -> list[float]:
    """Run the dial loop over scripted sessions ("fail": refused before joining, "drop": joined, then the link
    dropped) and return the pause before each redial, without the jitter."""
    pauses: list[float] = []
    script = iter(sessions)

    async def session(link):
        kind = next(script)
        if kind == "drop":
            link.joined = True
        raise ConnectionClosedError(None, None)

    async def sleep(seconds):
        pauses.append(seconds)
        if len(pauses) == len(sessions):
            raise asyncio.CancelledError

    monkeypatch.setattr(node, "_session", session)
    monkeypatch.setattr("nodes.agent.dialer.asyncio.sleep", sleep)
    monkeypatch.setattr("nodes.agent.dialer.random.random", lambda: 0.5)  # no jitter: factor 1.0
    with pytest.raises(asyncio.CancelledError):
        await node.run()
    return pauses


async def test_the_backoff_doubles_while_dialing_fails_and_starts_over_after_a_session_that_ran(tmp_path, monkeypatch):
    pauses = await delays_between(agent(tmp_path), ["fail", "fail", "fail", "drop", "fail", "fail"], monkeypatch)
    assert pauses == [1.0, 2.0, 4.0, 1.0, 2.0, 4.0]


async def test_the_real_backoff_starts_at_2_s_and_is_capped_at_30_s(tmp_path, monkeypatch):
    config = AgentConfig(head="127.0.0.1:1", token=format_token(LOCAL_TOKEN_ID, make_secret()), home=tmp_path)
    pauses = await delays_between(NodeAgent(config, FakeEngine()), ["fail"] * 7 + ["drop"], monkeypatch)
    assert pauses == [2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0, 2.0]


async def test_the_head_hears_at_once_when_the_engine_goes_down_and_comes_back(tmp_path):
    engine = FakeEngine()
    node, link = agent(tmp_path, engine), HeadLink("127.0.0.1:1")
    link.heartbeat_s = 60.0  # far longer than the test: only a change of the engine's state sends one
    link.outbox = asyncio.Queue()
    task = asyncio.ensure_future(node._heartbeat(link))
    try:
        first = await asyncio.wait_for(link.outbox.get(), 1)
        assert isinstance(first, Heartbeat) and first.engine_ready is True
        engine.alive = False
        down = await asyncio.wait_for(link.outbox.get(), 1)
        assert down.engine_ready is False
        engine.alive = True
        assert (await asyncio.wait_for(link.outbox.get(), 1)).engine_ready is True
    finally:
        task.cancel()


class FrameSink:
    def __init__(self):
        self.frames: list[bytes] = []

    async def send(self, frame: bytes) -> None:
        self.frames.append(frame)


@pytest.mark.parametrize("bundle", [True, False])
async def test_what_the_outbox_holds_at_once_goes_as_one_bundle_to_a_head_that_takes_them(tmp_path, bundle):
    node, link = agent(tmp_path), HeadLink("127.0.0.1:1")
    link.outbox = asyncio.Queue()
    sent = [TokenBatch(gen_id=f"g{i}", seq=1, text=["x"], ids=[1]) for i in range(5)]
    for msg in sent:  # an engine step's events, put in by one callback
        link.outbox.put_nowait(msg)
    ws, (node_channel, head_channel) = FrameSink(), _connect()
    task = asyncio.ensure_future(node._send(ws, node_channel, link, bundle))
    try:
        for _ in range(50):
            await asyncio.sleep(0.01)
            if link.outbox.empty():
                break
        await asyncio.sleep(0.05)
    finally:
        task.cancel()
    opened = [head_channel.open(frame) for frame in ws.frames]
    if bundle:
        assert len(opened) == 1 and isinstance(opened[0], Bundle)
        assert [msg for msg, _ in unbundle(opened[0])] == sent
    else:
        assert opened == sent  # an older head: one message a frame


class SubmittingEngine(FakeEngine):
    def __init__(self):
        self.submitted, self.cancelled = [], []

    async def submit(self, spec):
        self.submitted.append(spec.gen_id)

    async def cancel(self, gen_id):
        self.cancelled.append(gen_id)


async def test_a_generations_frames_go_back_on_the_link_it_came_on(tmp_path):
    from nodes.link.messages import Cancel, Done, Generate

    engine = SubmittingEngine()
    node = agent(tmp_path, engine)
    first, second = HeadLink("ws://a/ws/node/"), HeadLink("ws://b/ws/node/")
    for link in (first, second):
        link.outbox, link.joined = asyncio.Queue(), True
    await node._on_generate(Generate(gen_id="g1", spec={"model": "m", "prompt": "hi"}), first)
    await node._on_generate(Generate(gen_id="g2", spec={"model": "m", "prompt": "hi"}), second)
    node.on_engine_event(TokenBatch(gen_id="g1", seq=1, text=["x"], ids=[1]))
    node.on_engine_event(TokenBatch(gen_id="g2", seq=1, text=["y"], ids=[2]))
    node.on_engine_event(Done(gen_id="g1", seq=2, finish_reason="stop", usage={}, timings={}))
    assert [m.gen_id for m in _drain(first.outbox)] == ["g1", "g1"]
    assert [m.gen_id for m in _drain(second.outbox)] == ["g2"]
    node.on_engine_event(TokenBatch(gen_id="g1", seq=3, text=["z"], ids=[3]))  # a straggler after its end
    assert first.outbox.empty() and not first.running and second.running == {"g2"}
    # a head cancels only what it sent: another head's generation id is not its to stop
    await node._receive(_Frames([Cancel(gen_id="g2")]), _Plain(), first)
    assert engine.cancelled == []
    # heartbeats and what the node says of itself go on every link that is up
    node.links = {"ws://a/ws/node/": first, "ws://b/ws/node/": second}
    node.send(Heartbeat(lanes_busy=0, lanes=2))
    assert len(_drain(first.outbox)) == len(_drain(second.outbox)) == 1


async def test_the_node_dials_each_head_it_is_told_of_that_no_link_holds(tmp_path, monkeypatch):
    node = agent(tmp_path)
    dialed = []

    async def dial_loop(url, pause=0.0):
        dialed.append(url)
        await asyncio.Event().wait()  # dialing until cancelled

    monkeypatch.setattr(node, "_dial_loop", dial_loop)
    seed = node.links[None] = HeadLink("127.0.0.1:1")
    seed.head, seed.joined = "ws://a/ws/node/", True  # the seed reached head a
    try:
        node._learn(["ws://a/ws/node/", "ws://b/ws/node/", "ws://c/ws/node/"])
        await asyncio.sleep(0)
        assert dialed == ["ws://b/ws/node/", "ws://c/ws/node/"]
        node._learn(["ws://a/ws/node/", "ws://b/ws/node/", "ws://c/ws/node/", "ws://d/ws/node/"])  # d started
        await asyncio.sleep(0)
        assert dialed == ["ws://b/ws/node/", "ws://c/ws/node/", "ws://d/ws/node/"]  # one loop a head
    finally:
        for task in node._loops.values():
            task.cancel()


def _drain(queue: asyncio.Queue) -> list:
    out = []
    while not queue.empty():
        out.append(queue.get_nowait())
    return out


class _Plain:
    """A channel that passes messages through (the test hands _receive messages, not frames)."""

    def open(self, msg):
        return msg


class _Frames:
    def __init__(self, msgs):
        self.msgs = list(msgs)

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.msgs:
            raise StopAsyncIteration
        return self.msgs.pop(0)


class ClosingSink(FrameSink):
    def __init__(self):
        super().__init__()
        self.closed = None

    async def close(self, code, reason=""):
        self.closed = code

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(3600)  # a head with nothing to say



async def test_a_node_stopped_on_purpose_says_goodbye_and_closes_normally(tmp_path):
    from nodes.link.messages import Bye

    node = agent(tmp_path)
    link = HeadLink("ws://a/ws/node/")
    link.heartbeat_s = 60.0
    ws, (node_channel, head_channel) = ClosingSink(), _connect()
    task = asyncio.ensure_future(node._serve(ws, node_channel, link))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    opened = [head_channel.open(frame) for frame in ws.frames]
    assert isinstance(opened[-1], Bye) and ws.closed == 1000


async def test_a_node_on_its_way_in_reports_its_latest_state_until_it_joins_and_a_quick_load_none(monkeypatch,
                                                                                                  tmp_path):
    from nodes.agent import preparing
    from nodes.link.messages import Preparing

    monkeypatch.setattr(preparing, "FIRST_S", 0.05)
    monkeypatch.setattr(preparing, "EVERY_S", 0.05)
    node, asked = agent(tmp_path), []

    async def ask(question):
        asked.append(question)

    monkeypatch.setattr(node, "_ask", ask)
    quick = preparing.PreparingReports(node)
    quick.start()
    quick.set("smollm2", "loading")
    await asyncio.sleep(0.01)
    await quick.stop()  # loaded before FIRST_S: nothing said
    assert asked == []
    reports = preparing.PreparingReports(node)
    reports.start()
    reports.set("big", "pulling", 0.4)
    await asyncio.sleep(0.08)
    reports.set("big", "loading", 0.5)
    await asyncio.sleep(0.1)
    await reports.stop()
    count = len(asked)
    await asyncio.sleep(0.1)
    assert len(asked) == count  # stopped: it registers now
    assert asked[0] == Preparing(identity=node.config.identity, model="big", state="pulling", progress=0.4)
    assert asked[-1] == Preparing(identity=node.config.identity, model="big", state="loading", progress=0.5)


async def test_the_reports_end_even_when_a_report_loses_the_cancel(monkeypatch, tmp_path):
    """A report whose await finished as the cancel came (Python 3.11's `asyncio.wait_for` then returns its result
    and the cancel is lost): stop() returns at once all the same, and the task ends at its next turn, so the node
    goes on to register instead of waiting behind its reports for ever."""
    from nodes.agent import preparing

    monkeypatch.setattr(preparing, "FIRST_S", 0.0)
    monkeypatch.setattr(preparing, "EVERY_S", 0.05)
    node, asked = agent(tmp_path), []

    async def deaf_to_the_cancel(question):
        asked.append(question)
        with contextlib.suppress(asyncio.CancelledError):  # a lost cancel, from outside: the report returns
            await asyncio.sleep(0.2)

    monkeypatch.setattr(node, "_ask", deaf_to_the_cancel)
    reports = preparing.PreparingReports(node)
    reports.start()
    reports.set("big", "loading", 0.9)
    await asyncio.sleep(0.02)
    assert len(asked) == 1
    await asyncio.wait_for(reports.stop(), 2)
    await asyncio.sleep(0.2)
    assert reports.task.done() and len(asked) == 1  # no report after stop()


class EndingSink(FrameSink):
    """A link whose head closes it after `after` s (its process was killed)."""

    def __init__(self, after: float = 0.0):
        super().__init__()
        self.after = after

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(self.after)
        raise StopAsyncIteration


async def test_a_generation_whose_link_closed_is_reported_cut_to_a_head_that_takes_cuts(tmp_path):
    """The lane of a generation whose link closed is cancelled, and its end goes, with the record its head put in
    the spec, to another link whose head writes such records; with none up, to the next that joins."""
    from nodes.link.messages import Cut, Done, Error, Generate

    engine = SubmittingEngine()
    node = agent(tmp_path, engine)
    lost, other, older = HeadLink("ws://a/ws/node/"), HeadLink("ws://b/ws/node/"), HeadLink("ws://c/ws/node/")
    for link in (other, older):
        link.outbox, link.joined = asyncio.Queue(), True
    other.takes_cuts = True  # `older` is a head that predates cuts
    node.links = {"a": lost, "b": other, "c": older}
    lost.heartbeat_s = 60.0
    lost.outbox = asyncio.Queue()
    await node._on_generate(Generate(gen_id="g1", spec={"model": "m", "prompt": "hi", "record": {"signed": "r"}}),
                            lost)
    await node._on_generate(Generate(gen_id="g2", spec={"model": "m", "prompt": "hi"}), lost)  # no record asked
    ws, (node_channel, _) = EndingSink(), _connect()
    await node._serve(ws, node_channel, lost)
    assert sorted(engine.cancelled) == ["g1", "g2"]
    node.on_engine_event(Done(gen_id="g1", seq=9, finish_reason="cancelled", timings={},
                              usage={"prompt_tokens": 30, "completion_tokens": 7}))
    node.on_engine_event(Done(gen_id="g2", seq=9, finish_reason="cancelled", usage={}, timings={}))
    [cut] = _drain(other.outbox)
    assert isinstance(cut, Cut) and (cut.gen_id, cut.record, cut.finish_reason) == ("g1", {"signed": "r"},
                                                                                   "cancelled")
    assert cut.usage["completion_tokens"] == 7
    assert older.outbox.empty()
    # no link that takes cuts is up: held, and sent first on the next one that joins
    other.joined = False
    await node._on_generate(Generate(gen_id="g3", spec={"model": "m", "prompt": "hi", "record": {"signed": "s"}}),
                            lost)
    lost.outbox = None  # its link is down when the end comes
    node.on_engine_event(Error(gen_id="g3", code="engine_failed", message="it crashed"))
    assert other.outbox.empty() and [c.gen_id for c in node.cuts] == ["g3"]
    again = HeadLink("ws://b/ws/node/")
    again.takes_cuts, again.heartbeat_s = True, 60.0
    ws, (node_channel, head_channel) = EndingSink(after=0.2), _connect()
    await node._serve(ws, node_channel, again)
    assert not node.cuts
    sent = [head_channel.open(frame) for frame in ws.frames]
    assert [(type(m).__name__, m.gen_id, m.code) for m in sent if isinstance(m, Cut)] == [("Cut", "g3",
                                                                                          "engine_failed")]


async def test_the_nodes_own_model_is_registered_with_its_files_fingerprint(tmp_path):
    """What lets the head serve a node's copy of a model under the fleet's name for it: the same file, not the
    same name nor the order nodes joined in. The fingerprint reads the file's ends and its size."""
    from nodes.agent.dialer import _served_models
    from nodes.agent.gguf_info import FINGERPRINT_SPAN, file_fingerprint

    model, copy, other = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    body = os.urandom(3 * FINGERPRINT_SPAN)
    model.write_bytes(body)
    copy.write_bytes(body)
    other.write_bytes(body[:-1] + bytes([body[-1] ^ 1]))  # one byte of its tail differs
    info = {"model_name": "smollm2", "context_window": 2048, "model_path": str(model), "speech_model": "whisper"}
    [own, speech] = _served_models(info)
    assert own == {"name": "smollm2", "context_window": 2048, "file": file_fingerprint(copy)}
    assert "file" not in speech
    assert file_fingerprint(other) != own["file"] and len(own["file"]) == 64


async def test_a_discovering_node_looks_again_when_every_announced_head_refuses_unproven(tmp_path, monkeypatch):
    """A rogue mDNS announcer that refuses a good token made a discovering node exit for good: it now says what it
    saw and looks again with the backoff. A node given its head's address still stops on that head's refusal."""
    from nodes.agent.dialer import Refused

    config = AgentConfig(head="", token=format_token(LOCAL_TOKEN_ID, make_secret()), home=tmp_path,
                         backoff_start=1.0, backoff_max=16.0)
    node = NodeAgent(config, FakeEngine(), resolve_head=lambda: ["rogue.local:8000"])  # what mDNS found
    tries = []

    async def session(link):
        tries.append(link.dial)
        raise Refused("the head refused this node's token", proven=False)

    monkeypatch.setattr(node, "_session", session)
    pauses = []

    async def sleep(seconds):
        pauses.append(seconds)
        if len(pauses) == 3:
            raise asyncio.CancelledError

    monkeypatch.setattr("nodes.agent.dialer.asyncio.sleep", sleep)
    with pytest.raises(asyncio.CancelledError):
        await node.run()
    assert tries == ["rogue.local:8000"] * 3 and len(pauses) == 3
    async def ask_one(head, question):
        raise Refused("the head refused this node's token", proven=False)

    monkeypatch.setattr(node, "_ask_one", ask_one)
    assert await node._ask(None) is None  # check_join and pulls alike: no head that answers, for now
    given = agent(tmp_path)  # its head's address given: the refusal stops it
    monkeypatch.setattr(given, "_session", session)
    with pytest.raises(Refused):
        await given.run()
