"""A link fuzzer for the head's node endpoint (/ws/node/), in process (issue 10: item 9's link half, item 8's limits).

Hostile nodes send random bytes before and after the handshake, valid handshake frames and messages in the wrong
order, oversized frames, authenticated garbage, floods of token batches for generations they do not hold, and more
frames a second than the head takes. Each time the head must close that link with the protocol's close code and log
one line without a traceback, while a well-behaved node (another identity, its own key) keeps its link, keeps
heartbeating and keeps streaming a generation into its relay. The seed is fixed so that a failure replays; set
FLEET_FUZZ_SEED to explore others. The totals show in pytest's warnings summary.
"""

from __future__ import annotations

import logging
import os
import random
import uuid
import warnings
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

import msgpack
import pytest
from channels.testing import WebsocketCommunicator

from fleet.links import NodeLost, Relay, registry
from nodes.link import messages
from nodes.link.channel import SecureChannel
from nodes.link.codes import CloseCode
from nodes.link.handshake import (
    FIRST_MESSAGE_LEN,
    LOCAL_TOKEN_ID,
    MAGIC,
    MAX_HANDSHAKE_FRAME,
    Initiator,
    make_secret,
    parse_token,
)
from nodes.link.messages import (
    Accepted,
    Bundle,
    Bye,
    Cancel,
    Check,
    Done,
    Error,
    Generate,
    Heartbeat,
    ProtocolError,
    Register,
    Registered,
    StateOp,
    StateResult,
    TokenBatch,
    encode,
)
from nodes.link.noise import TAGLEN, CipherState, generate_static
from nodes.models import Node
from tests.test_node_consumer import (  # noqa: F401 - the autouse fixtures apply here too
    LOCAL_TOKEN,
    _disconnect_all,
    _fleet_log_reaches_caplog,
    _local_token,
    _open,
    closed_with,
    communicator,
    handshake,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.asyncio]

SEED = int(os.environ.get("FLEET_FUZZ_SEED", "10"))
STEADY_KEY, HOSTILE_KEY = generate_static(), generate_static()
STEADY = Register(identity="steady", models=[{"name": "smollm2", "context_window": 4096}], lanes=4,
                  context_window=4096, capabilities={"chat": True}, engine="mock", engine_version="1", version="t")
HOSTILE = replace(STEADY, identity="hostile")
TALLY: Counter = Counter()  # hostile links and the frames they sent, for the summary


@pytest.fixture(scope="module", autouse=True)
def _report_tally():
    yield
    warnings.warn(f"link fuzzer: {TALLY['links']} hostile node links sent {TALLY['frames']} frames (seed {SEED}); "
                  "each link was refused with one log line", UserWarning, stacklevel=1)


@dataclass
class Steady:
    """The well-behaved node: its own identity and key, and a generation streaming from it into a relay."""

    comm: WebsocketCommunicator
    channel: SecureChannel
    node_id: str
    gen_id: str
    relay: Relay
    seq: int = 0

    async def still_serving(self) -> None:
        """It heartbeats, its next token batch reaches the relay (and nothing else did), it is linked and ONLINE."""
        await self.comm.send_to(bytes_data=self.channel.seal(Heartbeat(lanes_busy=1, lanes=4)))
        self.seq += 1
        await self.comm.send_to(bytes_data=self.channel.seal(
            TokenBatch(gen_id=self.gen_id, seq=self.seq, text=[f" t{self.seq}"], ids=[self.seq])))
        batch = await self.relay.get(timeout=5)
        assert isinstance(batch, TokenBatch) and batch.seq == self.seq, batch
        assert not self.relay.frames and not self.relay.overflowed
        assert self.node_id in registry().links
        assert (await Node.objects.aget(pk=self.node_id)).state == Node.State.ONLINE

    async def finish(self) -> None:
        """The generation ends normally: Done reaches the relay and frees the node's lane."""
        await self.comm.send_to(bytes_data=self.channel.seal(Done(
            gen_id=self.gen_id, seq=self.seq + 1, finish_reason="stop", usage={"completion_tokens": self.seq},
            timings={})))
        done = await self.relay.get(timeout=5)
        assert isinstance(done, Done) and done.seq == self.seq + 1
        assert self.gen_id not in registry().links[self.node_id].generations.running
        # A straggler that raced the end is dropped, not refused: the unknown-generation rule spares it.
        await self.comm.send_to(bytes_data=self.channel.seal(
            TokenBatch(gen_id=self.gen_id, seq=self.seq + 2, text=["late"], ids=[0])))
        assert await self.comm.receive_nothing(timeout=0.2) and not self.relay.frames


@pytest.fixture
async def steady() -> Steady:
    comm = communicator()
    assert (await comm.connect())[0]
    channel = await handshake(comm, LOCAL_TOKEN, STEADY_KEY)
    await comm.send_to(bytes_data=channel.seal(STEADY))
    registered = channel.open(await comm.receive_from(timeout=5))
    gen_id = f"steady-{uuid.uuid4().hex}"
    relay = registry().relays[gen_id] = Relay(gen_id)
    await registry().links[registered.node_id].send_generate(gen_id, {"prompt": "a long answer"})
    assert isinstance(channel.open(await comm.receive_from(timeout=5)), Generate)
    await comm.send_to(bytes_data=channel.seal(Accepted(gen_id=gen_id, prompt_tokens=3)))
    assert isinstance(await relay.get(timeout=5), Accepted)
    return Steady(comm, channel, registered.node_id, gen_id, relay)


class Hostile:
    """One hostile node's link; counts what it sends."""

    def __init__(self) -> None:
        self.comm = communicator()
        self.from_head: list[bytes] = []  # the head's frames, to reflect back
        TALLY["links"] += 1

    async def send(self, *frames: bytes | str) -> None:
        for frame in frames:
            TALLY["frames"] += 1
            kind = "text" if isinstance(frame, str) else "bytes"  # send_to() cannot send an empty frame
            await self.comm.send_input({"type": "websocket.receive", kind: frame})

    async def receive(self) -> bytes:
        frame = await self.comm.receive_from(timeout=5)
        self.from_head.append(frame)
        return frame

    async def handshake(self) -> SecureChannel:
        initiator = Initiator(*parse_token(LOCAL_TOKEN), HOSTILE_KEY)
        await self.send(initiator.first_frame())
        initiator.read_reply(await self.receive())
        final, channel = initiator.finish()
        await self.send(final)
        return channel

    async def join(self) -> SecureChannel:
        channel = await self.handshake()
        await self.send(channel.seal(HOSTILE))
        assert isinstance(channel.open(await self.receive()), Registered)
        return channel

    async def closed(self) -> int:
        code = await closed_with(self.comm)
        await self.comm.disconnect(timeout=10)  # as the server ends the socket after its close frame
        _open.remove(self.comm)
        return code


Attack = Callable[[Hostile], Awaitable[None]]


async def refused(attack: Attack, code: int, caplog, steady: Steady, case: str) -> None:
    """`attack` on a fresh link gets it closed with `code` and one log line, and the steady node does not notice."""
    caplog.clear()
    node = Hostile()
    assert (await node.comm.connect())[0]
    await attack(node)
    got = await node.closed()
    assert got == code, f"{case}: closed with {got}, not {code}"
    lines = [r for r in caplog.records if "refused node" in r.getMessage()]
    assert len(lines) == 1, (case, [r.getMessage() for r in lines])
    assert lines[0].exc_info is None and "Traceback" not in caplog.text, case
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], case
    await steady.still_serving()


async def hold_a_generation(node: Hostile, channel: SecureChannel) -> tuple[str, Relay]:
    """The head places a generation on the hostile node: from now on its frames for it are relayed."""
    gen_id = f"hostile-{uuid.uuid4().hex}"
    relay = registry().relays[gen_id] = Relay(gen_id)
    link = next(link for link in registry().links.values() if link.identity == "hostile")
    await link.send_generate(gen_id, {"prompt": "hi"})
    assert isinstance(channel.open(await node.receive()), Generate)
    return gen_id, relay


def seal_raw(channel: SecureChannel, body: bytes) -> bytes:
    # Authenticated garbage: the node's own send key seals a body that SecureChannel.seal would never encode.
    return channel._send.encrypt_with_ad(b"", body)


def random_value(rng: random.Random, depth: int = 0):
    """Any msgpack value: scalars of every type and edge, nested lists and maps (some keyed by non-strings)."""
    choice = rng.randrange(12 if depth < 3 else 9)
    scalars = [None, rng.choice([True, False]), rng.choice([0, -1, 2**64 - 1, -(2**63), rng.randint(-9, 9**9)]),
               rng.choice([0.5, float("nan"), float("inf"), -1e308]),
               "".join(rng.choices("aé\x00z☃ ", k=rng.randrange(9))),
               rng.randbytes(rng.randrange(9)), msgpack.ExtType(rng.randrange(128), rng.randbytes(3)),
               "x" * rng.randrange(300), rng.randrange(2**31)]
    if choice < len(scalars):
        return scalars[choice]
    if choice == 9:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = [rng.choice(["t", "v", "gen_id", "name", 1, b"k", None]) for _ in range(rng.randrange(4))]
    return {k: random_value(rng, depth + 1) for k in keys}


# --- (a) random bytes before and after the handshake ---------------------------------------------------------------


def garbage_before_the_handshake(rng: random.Random) -> list[bytes | str]:
    """One to three frames in place of frame 1: noise, a bad magic, a broken hello, a forged Noise message."""
    first = Initiator(LOCAL_TOKEN_ID, make_secret(), generate_static()).first_frame()
    prefix = first[:-FIRST_MESSAGE_LEN]
    shape = rng.randrange(6)
    if shape == 0:
        frame: bytes | str = rng.randbytes(rng.randrange(MAX_HANDSHAKE_FRAME + 400))
    elif shape == 1:
        frame = MAGIC + rng.randbytes(rng.randrange(200))
    elif shape == 2:
        frame = prefix + rng.randbytes(rng.choice([0, 1, FIRST_MESSAGE_LEN - 1, FIRST_MESSAGE_LEN, 300]))
    elif shape == 3:
        flipped = bytearray(first)  # in the magic or the Noise message, not the hello's token id
        at = rng.choice([rng.randrange(len(MAGIC)), len(first) - 1 - rng.randrange(FIRST_MESSAGE_LEN)])
        flipped[at] ^= 1 << rng.randrange(8)
        frame = bytes(flipped)
    elif shape == 4:
        hello = msgpack.packb(random_value(rng), use_bin_type=True)
        frame = MAGIC + len(hello).to_bytes(2, "big") + hello + first[-FIRST_MESSAGE_LEN:]
    else:
        frame = "".join(rng.choices("{}\"node\x00é", k=rng.randrange(50)))
    return [frame] + [rng.randbytes(rng.randrange(80)) for _ in range(rng.randrange(3))]


async def test_random_bytes_before_the_handshake(steady, caplog):
    rng = random.Random(SEED)
    for case in range(80):
        frames = garbage_before_the_handshake(rng)

        async def attack(node: Hostile, frames=frames) -> None:
            await node.send(*frames)

        await refused(attack, CloseCode.PROTOCOL, caplog, steady, f"before #{case}: {frames[0][:40]!r}")
    await steady.finish()


def garbage_after_the_handshake(rng: random.Random, node: Hostile, channel: SecureChannel) -> list[bytes | str]:
    """Frames that no cipher state of this link opens: noise, tampered, truncated, replayed, reordered, reflected."""
    shape = rng.randrange(7)
    beat = channel.seal(Heartbeat(lanes_busy=0, lanes=4))
    if shape == 0:
        frames: list[bytes | str] = [rng.randbytes(rng.randrange(3000))]
    elif shape == 1:
        tampered = bytearray(beat)
        tampered[rng.randrange(len(tampered))] ^= 1 << rng.randrange(8)
        frames = [bytes(tampered)]
    elif shape == 2:
        frames = [beat[: rng.randrange(len(beat))]]
    elif shape == 3:
        frames = [beat, beat]  # a replay
    elif shape == 4:
        frames = [channel.seal(StateResult(op_id="later", ok=True)), beat]  # sealed second, sent first
    elif shape == 5:
        frames = [node.from_head[-1]]  # the head's own last frame, reflected
    else:
        frames = [Initiator(LOCAL_TOKEN_ID, make_secret(), HOSTILE_KEY).first_frame()]  # a second handshake
    return frames + [rng.randbytes(rng.randrange(80)) for _ in range(rng.randrange(3))]


async def test_random_bytes_after_the_handshake(steady, caplog):
    rng = random.Random(SEED + 1)
    for case in range(80):
        registered = rng.random() < 0.5

        async def attack(node: Hostile, registered=registered, seed=rng.random()) -> None:
            channel = await (node.join() if registered else node.handshake())
            await node.send(*garbage_after_the_handshake(random.Random(seed), node, channel))

        await refused(attack, CloseCode.PROTOCOL, caplog, steady, f"after #{case} (registered: {registered})")
    await steady.finish()


# --- (b) valid handshake frames and messages in the wrong order ------------------------------------------------


async def _frame_3_first(node: Hostile) -> None:
    initiator = Initiator(*parse_token(LOCAL_TOKEN), HOSTILE_KEY)
    first = initiator.first_frame()
    other = communicator()  # a real frame 3 needs a real frame 2: take it from a handshake on another link
    assert (await other.connect())[0]
    await other.send_to(bytes_data=first)
    initiator.read_reply(await other.receive_from(timeout=5))
    await other.disconnect()
    await node.send(initiator.finish()[0])


async def _frame_1_twice(node: Hostile) -> None:
    first = Initiator(*parse_token(LOCAL_TOKEN), HOSTILE_KEY).first_frame()
    await node.send(first)
    await node.receive()
    await node.send(first)


async def _frame_2_reflected(node: Hostile) -> None:
    await node.send(Initiator(*parse_token(LOCAL_TOKEN), HOSTILE_KEY).first_frame())
    await node.send(await node.receive())


async def _sealed_message_before_the_handshake_ends(node: Hostile) -> None:
    initiator = Initiator(*parse_token(LOCAL_TOKEN), HOSTILE_KEY)
    await node.send(initiator.first_frame())
    initiator.read_reply(await node.receive())
    _, channel = initiator.finish()  # frame 3 is never sent
    await node.send(channel.seal(HOSTILE))


async def _frame_3_twice(node: Hostile) -> None:
    initiator = Initiator(*parse_token(LOCAL_TOKEN), HOSTILE_KEY)
    await node.send(initiator.first_frame())
    initiator.read_reply(await node.receive())
    final, _ = initiator.finish()
    await node.send(final, final)


def _after_handshake(*msgs, register: bool = False) -> Attack:
    async def attack(node: Hostile) -> None:
        channel = await (node.join() if register else node.handshake())
        await node.send(*(channel.seal(msg) for msg in msgs))

    return attack


async def _text_after_handshake(node: Hostile) -> None:
    await node.join()
    await node.send('{"t": "heartbeat"}')


HEAD_ONLY = [Generate(gen_id="g", spec={}), Registered(node_id="n", model_names=[], heartbeat_s=5.0),
             Cancel(gen_id="g"), StateOp(op_id="o", op="embed")]
GENERATION_FRAMES = [Accepted(gen_id="g", prompt_tokens=1), TokenBatch(gen_id="g", seq=1, text=["a"], ids=[1]),
                     Done(gen_id="g", seq=2, finish_reason="stop", usage={}, timings={}),
                     Error(gen_id="g", code="oom", message="out of memory")]
OUT_OF_ORDER: dict[str, Attack] = {
    "frame 3 first": _frame_3_first,
    "frame 1 twice": _frame_1_twice,
    "frame 2 reflected as frame 3": _frame_2_reflected,
    "a sealed message before the handshake ends": _sealed_message_before_the_handshake_ends,
    "frame 3 twice": _frame_3_twice,
    "register twice": _after_handshake(HOSTILE, register=True),
    "heartbeat before register": _after_handshake(Heartbeat(lanes_busy=0, lanes=4)),
    "check after register": _after_handshake(Check(identity="hostile"), register=True),
    "a text frame after the handshake": _text_after_handshake,
    **{f"{type(msg).__name__} from the node": _after_handshake(msg) for msg in HEAD_ONLY},
    **{f"{type(msg).__name__} from a registered node": _after_handshake(msg, register=True) for msg in HEAD_ONLY},
    **{f"{type(msg).__name__} before register": _after_handshake(msg) for msg in GENERATION_FRAMES},
}


async def test_frames_in_the_wrong_order(steady, caplog):
    for case, attack in OUT_OF_ORDER.items():  # one test, not one each: every test pays a database flush
        await refused(attack, CloseCode.PROTOCOL, caplog, steady, case)
    await steady.finish()


# --- (c) oversized frames and malformed messages ------------------------------------------------------------------


TEMPLATES = [HOSTILE, Heartbeat(lanes_busy=0, lanes=4), StateResult(op_id="o", ok=True), Check(identity="hostile"),
             Bye(), *HEAD_ONLY, *GENERATION_FRAMES]


def malformed_body(rng: random.Random) -> bytes:
    """A body that messages.decode refuses: not msgpack, not a map, no or unknown tag, another version, a missing
    required field, or a field of the wrong type."""
    shape = rng.randrange(6)
    body = msgpack.unpackb(messages.encode(rng.choice(TEMPLATES)), raw=False)
    if shape == 0:
        return rng.randbytes(rng.randrange(1, 200))
    if shape == 1:
        return msgpack.packb(rng.choice([None, 1, "heartbeat", [body], b"\x81"]), use_bin_type=True)
    if shape == 2:
        body["t"] = rng.choice(["", "heartbeats", "GENERATE", 7, None, b"heartbeat", ["heartbeat"]])
    elif shape == 3:
        body["v"] = rng.choice([0, 2, "1", None, 1.0 + 2**-52, True])
    elif shape == 4:
        required = [k for k in body if k not in ("t", "v")]
        if required:
            del body[rng.choice(required)]
    else:
        field = rng.choice([k for k in body if k not in ("t", "v")] or ["t"])
        body[field] = random_value(rng)
    packed = msgpack.packb(body, use_bin_type=True)
    try:
        messages.decode(packed)
    except ProtocolError:
        return packed
    return malformed_body(rng)  # the mutation left a valid message (an optional field, a value of the right type)


def deep(depth: int):
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def unusable_message(rng: random.Random) -> tuple[object, bool]:
    """(message, whether the node registers first): the right outer field types, contents the head cannot store."""
    register = rng.choice([
        replace(HOSTILE, models=[rng.choice([1, "smollm2", None, [], b"m"])]),
        replace(HOSTILE, models=[{"context_window": 4096}]),
        replace(HOSTILE, models=[{"name": rng.choice([5, None, ["a"], {"a": 1}, b"m", "", "a\x00b"])}]),
        replace(HOSTILE, identity=rng.choice(["", "x" * rng.randrange(201, 400), "gpu\x007"])),
        replace(HOSTILE, lanes=rng.choice([-1, 2**31, 2**64 - 1])),
        replace(HOSTILE, context_window=rng.choice([-4096, 2**40])),
        replace(HOSTILE, engine="e" * 200, engine_version="1"),
        replace(HOSTILE, version="v" * 200),
        replace(HOSTILE, capabilities={"chat": rng.choice([b"\x00", float("nan"), "a\x00b", msgpack.ExtType(1, b""),
                                                           deep(1000)])}),
        replace(HOSTILE, labels={"rack": rng.choice([b"r1", float("inf"), msgpack.ExtType(2, b"x")])}),
        replace(HOSTILE, replicas=[rng.choice([1, b"r", "r", None])]),
    ])
    heartbeat = Heartbeat(lanes_busy=0, lanes=4, replicas=[rng.choice([1, "r", {"pid": b"\x01"}, {"d": deep(1000)}])])
    check = Check(identity=rng.choice(["", "x" * 300, "gpu\x007"]))
    return rng.choice([(register, False), (heartbeat, True), (check, False)])


async def test_malformed_messages(steady, caplog):
    rng = random.Random(SEED + 2)
    for case in range(100):
        body, registered = malformed_body(rng), rng.random() < 0.5

        async def attack(node: Hostile, body=body, registered=registered) -> None:
            channel = await (node.join() if registered else node.handshake())
            await node.send(seal_raw(channel, body))

        await refused(attack, CloseCode.PROTOCOL, caplog, steady, f"malformed #{case}: {body[:60]!r}")
    await steady.finish()


async def test_messages_with_contents_the_head_cannot_store(steady, caplog):
    rng = random.Random(SEED + 3)
    for case in range(40):
        msg, register = unusable_message(rng)
        await refused(_after_handshake(msg, register=register), CloseCode.PROTOCOL, caplog, steady,
                      f"unusable #{case}: {type(msg).__name__}")
    stored = {identity async for identity in Node.objects.values_list("identity", flat=True)}
    assert stored <= {"steady", "hostile"}  # the hostile one registered well before it heartbeat garbage
    await steady.finish()


def sized(channel: SecureChannel, size: int) -> bytes:
    """A sealed StateResult for no pending op (the head drops it) whose frame is exactly `size` bytes."""
    pad = size
    while (frame_len := len(messages.encode(StateResult(op_id="o", ok=True, error="x" * pad))) + TAGLEN) != size:
        pad -= frame_len - size
    return channel.seal(StateResult(op_id="o", ok=True, error="x" * pad))


async def test_oversized_frames(steady, caplog, settings):
    settings.FLEET_LINK_MAX_FRAME_BYTES = cap = 2048
    rng = random.Random(SEED + 4)
    for case in range(30):
        size, registered, before = rng.randrange(cap + 1, 6 * cap), rng.random() < 0.5, rng.random() < 0.2

        async def attack(node: Hostile, size=size, registered=registered, before=before) -> None:
            if before:  # handshake frames have their own, smaller cap
                await node.send(rng.randbytes(rng.randrange(MAX_HANDSHAKE_FRAME + 1, size)))
                return
            channel = await (node.join() if registered else node.handshake())
            frame = rng.choice([sized(channel, size), rng.randbytes(size),
                                channel.seal(Heartbeat(lanes_busy=0, lanes=4, replicas=[{"pad": "x" * size}]))])
            await node.send(frame)

        await refused(attack, CloseCode.PROTOCOL, caplog, steady, f"oversized #{case}: {size} bytes")
    await steady.finish()


async def test_a_frame_at_the_cap_is_taken_and_one_byte_over_is_refused(steady, caplog, settings):
    settings.FLEET_LINK_MAX_FRAME_BYTES = cap = 2048

    async def attack(node: Hostile) -> None:
        channel = await node.join()
        await node.send(sized(channel, cap))
        assert await node.comm.receive_nothing(timeout=0.2)
        await node.send(sized(channel, cap + 1))

    await refused(attack, CloseCode.PROTOCOL, caplog, steady, "one byte over the cap")
    assert f"of {cap + 1} bytes is too large (cap {cap})" in caplog.text
    await steady.finish()


async def test_an_oversized_frame_is_refused_before_it_is_decrypted_and_nothing_is_relayed(
    steady, caplog, settings, monkeypatch
):
    settings.FLEET_LINK_MAX_FRAME_BYTES = cap = 2048
    opened: list[int] = []
    decrypt = CipherState.decrypt_with_ad
    monkeypatch.setattr(CipherState, "decrypt_with_ad",
                        lambda self, ad, ciphertext: opened.append(len(ciphertext)) or decrypt(self, ad, ciphertext))
    held: list[Relay] = []

    async def attack(node: Hostile) -> None:
        channel = await node.join()
        gen_id, relay = await hold_a_generation(node, channel)  # its batches for it would be relayed
        held.append(relay)
        await node.send(channel.seal(TokenBatch(gen_id=gen_id, seq=1, text=["x" * cap], ids=[1])))

    await refused(attack, CloseCode.PROTOCOL, caplog, steady, "an oversized token batch")
    assert opened and max(opened) <= cap  # the head never decrypted the big frame
    assert isinstance(await held[0].get(timeout=5), NodeLost) and not held[0].frames  # the client hears the loss
    await steady.finish()


# --- (d) floods ---------------------------------------------------------------------------------------------------


def foreign_generation_frames(rng: random.Random, steady_gen: str) -> list:
    """Generation frames for generations the node does not hold, the steady node's running one among them."""
    frames = []
    for seq in range(1, rng.randrange(2, 150)):
        gen_id = rng.choice([steady_gen, uuid.uuid4().hex, "", "g" * 500])
        frames.append(rng.choice([
            TokenBatch(gen_id=gen_id, seq=seq, text=["pwned"], ids=[seq]),
            Accepted(gen_id=gen_id, prompt_tokens=1),
            Done(gen_id=gen_id, seq=seq, finish_reason="stop", usage={}, timings={}),
            Error(gen_id=gen_id, code="oom", message="out of memory", retryable=True),
        ]))
    return frames


async def test_floods_of_frames_for_generations_the_node_does_not_hold(steady, caplog):
    rng = random.Random(SEED + 5)
    for case in range(40):
        frames = foreign_generation_frames(rng, steady.gen_id)
        held: list[Relay] = []

        async def attack(node: Hostile, frames=frames, held=held) -> None:
            channel = await node.join()
            gen_id, relay = await hold_a_generation(node, channel)
            held.append(relay)
            own = TokenBatch(gen_id=gen_id, seq=1, text=["after the refusal"], ids=[1])
            await node.send(*(channel.seal(frame) for frame in [*frames, own]))

        await refused(attack, CloseCode.PROTOCOL, caplog, steady, f"foreign flood #{case}: {len(frames)} frames")
        # A refused link is dead: its own generation's batch, queued behind the refusal, is not relayed.
        assert isinstance(await held[0].get(timeout=5), NodeLost) and not held[0].frames
    await steady.finish()


async def test_a_frame_rate_flood_closes_4009_and_a_burst_within_twice_the_rate_does_not(steady, caplog, settings):
    settings.FLEET_LINK_MAX_FRAMES_PER_S = rate = 50  # after the steady node joined: it keeps the default budget
    settings.FLEET_LINK_MAX_FRAMES_PER_LANE_S = 10  # 4 lanes buy less than the rate
    rng = random.Random(SEED + 6)
    for case in range(10):
        flood = rng.randrange(4 * rate, 8 * rate)

        async def attack(node: Hostile, flood=flood) -> None:
            channel = await node.join()  # 3 frames of the budget
            burst = [channel.seal(StateResult(op_id=f"none-{i}", ok=True)) for i in range(2 * rate - 10)]
            await node.send(*burst)
            assert await node.comm.receive_nothing(timeout=0.2)  # within the burst allowance
            await node.send(*(channel.seal(Heartbeat(lanes_busy=0, lanes=4)) for _ in range(flood)))

        await refused(attack, CloseCode.FLOOD, caplog, steady, f"rate flood #{case}: {flood} frames")
        assert f"more than {rate} frames a second" in caplog.text
    await steady.finish()


async def test_a_bundle_counts_each_of_its_messages_against_the_frame_rate(steady, caplog, settings):
    settings.FLEET_LINK_MAX_FRAMES_PER_S = rate = 50
    settings.FLEET_LINK_MAX_FRAMES_PER_LANE_S = 10
    beat = encode(Heartbeat(lanes_busy=0, lanes=4))

    async def attack(node: Hostile) -> None:
        channel = await node.join()  # 3 frames of the budget (a burst of 100)
        await node.send(channel.seal(Bundle(parts=[beat] * (2 * rate - 10))))
        assert await node.comm.receive_nothing(timeout=0.2)  # within the burst allowance
        await node.send(channel.seal(Bundle(parts=[beat] * (4 * rate))))  # one frame, four times the rate

    await refused(attack, CloseCode.FLOOD, caplog, steady, "one bundle over the frame rate")
    assert "a bundle's messages count one each" in caplog.text
    await steady.finish()


async def test_a_node_with_many_lanes_gets_a_frame_rate_for_them(steady, caplog, settings):
    """200 lanes at 40 tokens a second are 8,000 messages a second: the fixed 2,000 cut such a node (4009)."""
    settings.FLEET_LINK_MAX_FRAMES_PER_S, settings.FLEET_LINK_MAX_FRAMES_PER_LANE_S = 50, 10
    beat = encode(Heartbeat(lanes_busy=0, lanes=40))
    busy = Hostile()
    assert (await busy.comm.connect())[0]
    channel = await busy.handshake()
    await busy.send(channel.seal(replace(HOSTILE, lanes=40)))  # buys 400 a second, bursts of 800
    assert isinstance(channel.open(await busy.receive()), Registered)
    await busy.send(channel.seal(Bundle(parts=[beat] * 700)))  # 14 times the base rate
    assert await busy.comm.receive_nothing(timeout=0.3)
    await busy.send(channel.seal(Bundle(parts=[beat] * 1000)))  # past what its lanes buy
    assert await closed_with(busy.comm) == CloseCode.FLOOD
    assert "more than 400 frames a second" in caplog.text
    await steady.finish()
