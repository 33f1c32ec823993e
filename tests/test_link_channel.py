"""The node link end to end without sockets: hello, handshake, secure channel, messages, tokens."""

from __future__ import annotations

import os
import struct

import msgpack
import pytest

from nodes.link import messages
from nodes.link.channel import MAX_FRAME, ChannelBroken, FrameError, SecureChannel
from nodes.link.handshake import (
    BadToken,
    HandshakeError,
    HeadKeyChanged,
    Initiator,
    Responder,
    TokenRefused,
    format_token,
    make_secret,
    parse_token,
)
from nodes.link.messages import PROTOCOL_VERSION, LinkError, ProtocolError
from nodes.link.noise import CipherState, generate_static, public_key
from nodes.link.spec import GenerateSpec

SECRET = bytes(range(32))
NODE_KEY = generate_static()
HEAD_KEY = generate_static()


def _connect(public_id: str = "tok-1", secret: bytes = SECRET) -> tuple[SecureChannel, SecureChannel]:
    """(node channel, head channel) after a full handshake."""
    node = Initiator(public_id, secret, NODE_KEY)
    head = Responder(HEAD_KEY)
    hello = head.read_hello(node.first_frame())
    assert hello.token_id == public_id
    assert node.read_reply(head.respond(secret)) == public_key(HEAD_KEY)
    final, node_channel = node.finish()
    head_channel = head.finish(final)
    assert head.node_key == public_key(NODE_KEY)
    return node_channel, head_channel


def _every_message() -> list[messages.Message]:
    spec = GenerateSpec(gen_id="g1", prompt="Once", seed=7, stop=["\n"], logit_bias={15043: -100.0, 2: 1.5})
    return [
        messages.Register(
            identity="node-a",
            models=[{"name": "qwen", "context_window": 4096}],
            lanes=4,
            context_window=4096,
            capabilities={"embeddings": True, "grammar": True},
            engine="llama.cpp",
            engine_version="b1234",
            version="0.1.0",
            labels={"rack": "3"},
            replicas=[{"index": 0, "lanes": 4}],
            cache_cleared=False,
            tokenizers={"qwen": "cd" * 32},
        ),
        messages.Registered(node_id="n-1", model_names=["qwen"], heartbeat_s=2.5, warnings=["old engine"],
                            tokenizers_wanted=["cd" * 32], features=["bundle"]),
        messages.Heartbeat(
            lanes_busy=1,
            lanes=4,
            kv_used=100,
            kv_total=4096,
            tokens_per_s=42.5,
            replicas=[{"index": 0, "busy": 1}],
            cache_cleared=True,
        ),
        messages.Generate(gen_id="g1", spec=spec.to_dict()),
        messages.Cancel(gen_id="g1", reason="client went away"),
        messages.StateOp(op_id="op1", op="embed", args={"input": ["a", "b"]}),
        messages.StateResult(op_id="op1", ok=False, result={}, error="no such LoRA", code="lora_missing"),
        messages.Accepted(gen_id="g1", prompt_tokens=12, cached_tokens=8, lane=2, replica=1),
        messages.TokenBatch(
            gen_id="g1",
            seq=3,
            text=["Hel", "lo"],
            ids=[9906, 385],
            logprobs=[{"token": "Hel", "logprob": -0.1}, {"token": "lo", "logprob": -0.2}],
        ),
        messages.Done(
            gen_id="g1",
            seq=4,
            finish_reason="stop",
            usage={"prompt_tokens": 12, "completion_tokens": 2},
            timings={"prefill_ms": 3.5},
            lane=2,
            replica=1,
            evicted=["old-gen"],
        ),
        messages.Error(gen_id="g1", code="oom", message="KV cache full", retryable=True, seq=2),
        messages.Bye(reason="draining"),
        messages.Heads(heads=["ws://10.0.0.1:8001/ws/node/", "ws://10.0.0.2:8001/ws/node/"]),
        messages.Cut(gen_id="g1", record={"signed": "abc"}, finish_reason="cancelled", usage={"prompt_tokens": 9},
                     timings={}, code="", message=""),
        messages.Check(identity="node-a"),
        messages.Pull(identity="node-a", model="tiny-chat"),
        messages.Preparing(identity="node-a", model="tiny-chat", state="pulling", progress=0.25),
        messages.PullGrant(model="tiny-chat", sha256="ab" * 32, size=98362432, path="/models/blobs/" + "ab" * 32,
                           grant="signed", expires_s=900.0),
        messages.Deploy(models=[{"name": "tiny-chat", "sha256": "ab" * 32, "lanes": 4, "context": 0}]),
        messages.Models(models=[{"name": "qwen", "context_window": 4096, "lanes": 4},
                                {"name": "tiny-chat", "context_window": 2048, "lanes": 4}],
                        lanes=8, context_window=4096),
        messages.ModelState(model="tiny-chat", state="pulling", progress=0.43, detail=""),
        messages.TokenizerFile(fingerprint="cd" * 32, part=1, parts=3, data=b"\x78\x9c\x00partial"),
        messages.Refusal(code=4012, reason="tokenizer 6933a85f6426 differs from the registry's 4fba48d09c14"),
        messages.Bundle(parts=[messages.encode(messages.Cancel(gen_id="g1", reason="x"))]),
    ]


def test_the_sample_covers_every_message_type():
    assert {type(m) for m in _every_message()} == set(messages.REGISTRY.values())
    assert len(messages.REGISTRY) == len(messages.MessageType)


@pytest.mark.parametrize("msg", _every_message(), ids=lambda m: m.TYPE.value)
def test_every_message_round_trips_both_ways(msg):
    node, head = _connect()
    assert head.open(node.seal(msg)) == msg
    assert node.open(head.seal(msg)) == msg


def test_generate_spec_keeps_int_logit_bias_keys():
    node, head = _connect()
    spec = GenerateSpec(gen_id="g1", prompt="x", logit_bias={15043: -100.0})
    received = head.open(node.seal(messages.Generate(gen_id="g1", spec=spec.to_dict())))
    assert GenerateSpec.from_dict(received.spec) == spec
    assert list(received.spec["logit_bias"]) == [15043]


def test_frames_are_encrypted():
    node, _ = _connect()
    frame = node.seal(messages.Cancel(gen_id="very-recognisable-id"))
    assert b"very-recognisable-id" not in frame
    assert b"cancel" not in frame


def test_handshake_hash_matches_on_both_ends():
    node, head = _connect()
    assert len(node.handshake_hash) == 32
    assert node.handshake_hash == head.handshake_hash


def _through_reply(secret: bytes = SECRET, *, pinned: bytes | None = None) -> tuple[Initiator, Responder]:
    node = Initiator("tok-1", SECRET, NODE_KEY, pinned_head=pinned)
    head = Responder(HEAD_KEY)
    head.read_hello(node.first_frame())
    node.read_reply(head.respond(secret))
    return node, head


def test_wrong_psk_is_refused_by_the_responder_at_the_last_frame():
    node, head = _through_reply(bytes(32))
    final, _ = node.finish()
    with pytest.raises(TokenRefused, match="secret for token 'tok-1' is wrong") as refused:
        head.finish(final)
    assert isinstance(refused.value, HandshakeError)
    assert head.node_key is None  # an unproved key is never reported
    with pytest.raises(HandshakeError, match="exactly one respond"):
        head.finish(final)  # no second guess: the responder is spent


def test_the_hello_is_bound_into_the_handshake():
    node = Initiator("tok-1", SECRET, NODE_KEY)
    forged = node.first_frame().replace(b"tok-1", b"tok-2")
    head = Responder(HEAD_KEY)
    assert head.read_hello(forged).token_id == "tok-2"
    with pytest.raises(HandshakeError, match="hello altered"):
        head.respond(SECRET)  # even the right secret fails: the prologue differs


def test_a_pinned_head_key_is_checked_before_the_node_proves_anything():
    other = public_key(generate_static())
    node = Initiator("tok-1", SECRET, NODE_KEY, pinned_head=other)
    head = Responder(HEAD_KEY)
    head.read_hello(node.first_frame())
    with pytest.raises(HeadKeyChanged, match="pinned") as changed:
        node.read_reply(head.respond(SECRET))
    assert changed.value.presented == public_key(HEAD_KEY) and changed.value.pinned == other
    with pytest.raises(HandshakeError, match="out of order"):
        node.finish()
    node, _ = _through_reply(pinned=public_key(HEAD_KEY))  # the pinned key itself passes
    assert node.head_key == public_key(HEAD_KEY)


def test_a_malformed_last_frame_is_a_protocol_error_not_a_token_refusal():
    _, head = _through_reply()
    with pytest.raises(HandshakeError, match="has 10 bytes, not 64") as caught:
        head.finish(b"x" * 10)
    assert not isinstance(caught.value, TokenRefused)


def test_initiator_refuses_a_garbage_reply():
    node = Initiator("tok-1", SECRET, NODE_KEY)
    node.first_frame()
    with pytest.raises(HandshakeError, match="reply failed"):
        node.read_reply(os.urandom(96))


def test_initiator_arguments_and_order_are_checked():
    with pytest.raises(HandshakeError, match="32 bytes"):
        Initiator("tok-1", b"short", NODE_KEY)
    with pytest.raises(HandshakeError, match="malformed token id"):
        Initiator("tok 1", SECRET, NODE_KEY)
    node = Initiator("tok-1", SECRET, NODE_KEY)
    with pytest.raises(HandshakeError, match="out of order"):
        node.read_reply(b"x" * 96)


def _broken_after(channel: SecureChannel, frame: bytes, match: str) -> None:
    with pytest.raises(FrameError, match=match):
        channel.open(frame)
    assert channel.broken
    with pytest.raises(ChannelBroken, match="broken"):
        channel.open(frame)
    with pytest.raises(ChannelBroken):
        channel.seal(messages.Bye())


def test_tampered_frame_breaks_the_channel():
    node, head = _connect()
    frame = bytearray(node.seal(messages.Heartbeat(lanes_busy=0, lanes=4)))
    frame[5] ^= 0x01
    _broken_after(head, bytes(frame), "failed authentication")


def test_replayed_frame_breaks_the_channel():
    node, head = _connect()
    frame = node.seal(messages.Heartbeat(lanes_busy=0, lanes=4))
    assert isinstance(head.open(frame), messages.Heartbeat)
    _broken_after(head, frame, "failed authentication")


def test_reordered_frames_break_the_channel():
    node, head = _connect()
    node.seal(messages.TokenBatch(gen_id="g", seq=0, text=["a"], ids=[1]))
    second = node.seal(messages.TokenBatch(gen_id="g", seq=1, text=["b"], ids=[2]))
    _broken_after(head, second, "failed authentication")


def test_reflected_frame_breaks_the_channel():
    node, _ = _connect()
    own = node.seal(
        messages.Register(
            identity="n",
            models=[],
            lanes=1,
            context_window=1,
            capabilities={},
            engine="e",
            engine_version="1",
            version="1",
        )
    )
    _broken_after(node, own, "failed authentication")


class _CountingCipher(CipherState):
    def __init__(self, key: bytes) -> None:
        super().__init__(key)
        self.decrypts = 0

    def decrypt_with_ad(self, ad: bytes, ciphertext: bytes) -> bytes:
        self.decrypts += 1
        return super().decrypt_with_ad(ad, ciphertext)


def test_oversize_frame_is_refused_before_decrypting():
    receive = _CountingCipher(bytes(32))
    channel = SecureChannel(CipherState(bytes(range(32))), receive, max_frame=64)
    _broken_after(channel, os.urandom(65), "too large")
    assert receive.decrypts == 0


def test_default_cap_is_4_mib():
    node, head = _connect()
    assert head.max_frame == MAX_FRAME == 4 * 1024 * 1024
    with pytest.raises(FrameError, match=f"frame of {MAX_FRAME + 1} bytes is too large"):
        head.open(b"\x00" * (MAX_FRAME + 1))


def test_cap_is_per_channel_and_applies_when_sealing():
    node, head = _connect()
    big = messages.Generate(gen_id="g", spec={"prompt": "x" * 2000})
    head.max_frame = 1024
    with pytest.raises(FrameError, match="too large"):
        head.open(node.seal(big))
    node.max_frame = 1024
    _, fresh = _connect()
    with pytest.raises(FrameError, match="generate message of .* bytes is too large"):
        node.seal(big)
    assert fresh.max_frame == MAX_FRAME


def test_a_message_that_cannot_be_sealed_fails_alone_and_the_channel_goes_on():
    node, head = _connect()
    node.max_frame = 1024
    with pytest.raises(FrameError, match="too large"):
        node.seal(messages.Generate(gen_id="big", spec={"prompt": "x" * 2000}))
    with pytest.raises(LinkError):
        node.seal(messages.Generate(gen_id="huge-int", spec={"logit_bias": {10**30: 1.0}}))
    assert not node.broken
    assert head.open(node.seal(messages.Cancel(gen_id="next"))) == messages.Cancel(gen_id="next")


def test_authenticated_garbage_is_a_protocol_error_and_breaks_the_channel():
    channel = SecureChannel(CipherState(bytes(32)), CipherState(SECRET))
    frame = CipherState(SECRET).encrypt_with_ad(b"", b"\xc1")  # 0xc1 is never valid msgpack
    with pytest.raises(ProtocolError, match="not a msgpack message"):
        channel.open(frame)
    with pytest.raises(ChannelBroken):
        channel.seal(messages.Bye())


def _hello(body: bytes) -> bytes:
    return b"FLEET2" + struct.pack(">H", len(body)) + body


@pytest.mark.parametrize(
    ("frame", "match"),
    [
        (b"\x17\x03\x03" + os.urandom(61), "bad magic"),
        (b"FLEET1" + b"\x00" * 60, "bad magic"),
        (b"FLEET2\x00", "truncated hello: the frame ends before the hello length"),
        (b"FLEET2" + struct.pack(">H", 40) + b"\x82\xa5proto", "truncated hello: it claims 40 bytes but only 7"),
        (_hello(b"\xc1") + os.urandom(48), "hello is not valid msgpack"),
        (_hello(msgpack.packb([1, 2])) + os.urandom(48), "must be a msgpack map"),
        (_hello(msgpack.packb({"proto": "fleet/1", "token_id": "t"})) + os.urandom(48), "unsupported link proto"),
        (_hello(msgpack.packb({"proto": "fleet/2", "token_id": 7})) + os.urandom(48), "malformed one"),
        (_hello(msgpack.packb({"proto": "fleet/2", "token_id": None})) + os.urandom(48), "no token id"),
        (_hello(msgpack.packb({"proto": "fleet/2", "token_id": "t" * 65})) + os.urandom(48), "malformed one"),
        (_hello(msgpack.packb({"proto": "fleet/2", "token_id": "a.b"})) + os.urandom(48), "malformed one"),
        (_hello(msgpack.packb({"proto": "fleet/2", "token_id": "t"})) + os.urandom(20), "has 20 bytes, not 48"),
        (_hello(msgpack.packb({"proto": "fleet/2", "token_id": "t"})) + os.urandom(64), "has 64 bytes, not 48"),
        (_hello(msgpack.packb({"proto": "fleet/2", "token_id": "t"})), "has 0 bytes, not 48"),
        (b"FLEET2" + os.urandom(2000), "too large"),
        ("FLEET2 hello", "must be a binary websocket frame"),
    ],
    ids=[
        "random",
        "old-protocol-magic",
        "no-length",
        "truncated",
        "not-msgpack",
        "not-map",
        "proto",
        "token-id-type",
        "token-id-missing",
        "token-id-too-long",
        "token-id-bad-chars",
        "short-noise",
        "long-noise",
        "no-noise",
        "oversize",
        "text-frame",
    ],
)
def test_garbage_before_the_handshake_is_a_handshake_error(frame, match):
    with pytest.raises(HandshakeError, match=match) as caught:
        Responder(HEAD_KEY).read_hello(frame)
    assert isinstance(caught.value, LinkError)


def test_decode_refuses_garbage():
    with pytest.raises(ProtocolError, match="not a msgpack message"):
        messages.decode(b"\xc1\xc1")
    with pytest.raises(ProtocolError, match="not a msgpack message"):
        messages.decode(msgpack.packb({"t": "bye", "v": 1}) + b"\x00")  # trailing bytes
    with pytest.raises(ProtocolError, match="must be a msgpack map, got list"):
        messages.decode(msgpack.packb(["bye"]))


def test_decode_refuses_unknown_type_missing_field_wrong_version_and_wrong_type():
    with pytest.raises(ProtocolError, match="unknown message type 'launch'"):
        messages.decode(msgpack.packb({"t": "launch", "v": PROTOCOL_VERSION}))
    with pytest.raises(ProtocolError, match="unknown message type None"):
        messages.decode(msgpack.packb({"v": PROTOCOL_VERSION}))
    with pytest.raises(ProtocolError, match="cancel: missing required field 'gen_id'"):
        messages.decode(msgpack.packb({"t": "cancel", "v": PROTOCOL_VERSION}))
    with pytest.raises(ProtocolError, match="protocol version 2 is not supported"):
        messages.decode(msgpack.packb({"t": "bye", "v": 2}))
    with pytest.raises(ProtocolError, match="protocol version None"):
        messages.decode(msgpack.packb({"t": "bye"}))
    with pytest.raises(ProtocolError, match="'lanes' has the wrong type str"):
        messages.decode(msgpack.packb({"t": "heartbeat", "v": 1, "lanes_busy": 0, "lanes": "4"}))
    with pytest.raises(ProtocolError, match="'ok' has the wrong type int"):
        messages.decode(msgpack.packb({"t": "state_result", "v": 1, "op_id": "o", "ok": 1}))


def test_decode_ignores_unknown_fields_and_applies_defaults():
    body = {"t": "heartbeat", "v": PROTOCOL_VERSION, "lanes_busy": 1, "lanes": 2, "from_the_future": [1]}
    msg = messages.decode(msgpack.packb(body))
    assert msg == messages.Heartbeat(lanes_busy=1, lanes=2)
    assert msg.replicas == [] and msg.tokens_per_s == 0.0 and msg.cache_cleared is False


def test_encode_writes_tag_and_version():
    body = msgpack.unpackb(messages.encode(messages.Cancel(gen_id="g")))
    assert body == {"t": "cancel", "v": PROTOCOL_VERSION, "gen_id": "g", "reason": "cancelled"}


def test_token_round_trip():
    secret = make_secret()
    assert len(secret) == 32 and secret != make_secret()
    token = format_token("tok_A-1", secret)
    assert len(token.split(".")[1]) == 43
    assert parse_token(token) == ("tok_A-1", secret)
    assert parse_token(token + "\n") == ("tok_A-1", secret)


@pytest.mark.parametrize(
    ("token", "match"),
    [
        ("no-dot-here", "has no '.'"),
        (".AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA", "token id before the '.'"),
        ("tok/1.AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA", "token id before the '.'"),
        ("tok.AAAA", "43 characters .* got 4 characters"),
        ("tok.AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=", "got 44 characters"),
        ("tok.AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA+", "43 characters"),
        ("tok.AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAB", "not canonical"),
        ("tok.a.AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA", "43 characters"),
    ],
)
def test_bad_tokens_are_refused_with_a_reason(token, match):
    with pytest.raises(BadToken, match=match) as caught:
        parse_token(token)
    assert isinstance(caught.value, LinkError)


def test_format_token_checks_its_inputs():
    with pytest.raises(BadToken, match="32 bytes"):
        format_token("tok", b"short")
    with pytest.raises(BadToken, match="token id"):
        format_token("has space", bytes(32))


def _batches(n: int) -> list[messages.Message]:
    return [messages.TokenBatch(gen_id=f"g{i}", seq=1, text=["a", "b"], ids=[1, 2]) for i in range(n)]


def _opened(head: SecureChannel, frames: list[bytes]) -> list[list[messages.Message]]:
    """Each frame's messages, a bundle's unpacked."""
    out = []
    for frame in frames:
        msg, body = head.open_with_body(frame)
        if isinstance(msg, messages.Bundle):
            parts = messages.unbundle(msg)
            assert all(messages.decode(part_body) == part for part, part_body in parts)  # each keeps its own body
            out.append([part for part, _ in parts])
        else:
            assert messages.decode(body) == msg
            out.append([msg])
    return out


def test_seal_all_puts_messages_ready_at_once_in_one_frame_in_order():
    node, head = _connect()
    batches = _batches(64)
    frames = node.seal_all(batches)
    assert len(frames) == 1
    assert _opened(head, frames) == [batches]


def test_seal_all_starts_a_new_frame_at_the_byte_cap_and_sends_a_lone_or_larger_message_as_itself():
    node, head = _connect()
    batches = _batches(10)
    one = len(messages.encode(batches[0]))
    frames = node.seal_all(batches, bundle_bytes=one * 4)
    assert [len(group) for group in _opened(head, frames)] == [4, 4, 2]
    big = messages.TokenizerFile(fingerprint="cd" * 32, part=0, parts=1, data=b"x" * (one * 8))
    frames = node.seal_all([batches[0], big, batches[1]], bundle_bytes=one * 4)
    assert _opened(head, frames) == [[batches[0]], [big], [batches[1]]]
    lone = node.seal_all([batches[2]])
    assert not isinstance(head.open(lone[0]), messages.Bundle)


def test_unbundle_refuses_a_bundle_inside_a_bundle_and_parts_that_are_not_messages():
    inner = messages.encode(messages.Bundle(parts=[messages.encode(messages.Bye(reason="x"))]))
    with pytest.raises(ProtocolError, match="bundle inside a bundle"):
        messages.unbundle(messages.Bundle(parts=[inner]))
    with pytest.raises(ProtocolError, match="must be bytes"):
        messages.unbundle(messages.Bundle(parts=["text"]))
    with pytest.raises(ProtocolError, match="not a msgpack message|must be a msgpack map"):
        messages.unbundle(messages.Bundle(parts=[b"\xc1"]))
