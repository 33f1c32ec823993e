"""nodes.link.noise against the published cacophony vectors, then its failure modes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from nodes.link.noise import MAX_NONCE, PATTERNS, CipherState, HandshakeState, NoiseError, generate_static

VECTORS_DIR = Path(__file__).parent / "data" / "noise"
VECTORS = [
    vector
    for name in ("nn_psk_25519_chachapoly_sha256.json", "xx_psk3_25519_chachapoly_sha256.json")
    for vector in json.loads((VECTORS_DIR / name).read_text())["vectors"]
]
PSK = bytes(range(32))


def _pattern(vector: dict) -> str:
    return vector["protocol_name"].split("_")[1]


def _side(vector: dict, initiator: bool) -> HandshakeState:
    prefix = "init" if initiator else "resp"
    psks = vector.get(f"{prefix}_psks", [])
    return HandshakeState(
        _pattern(vector),
        initiator=initiator,
        prologue=bytes.fromhex(vector[f"{prefix}_prologue"]),
        psk=bytes.fromhex(psks[0]) if psks else None,
        ephemeral=bytes.fromhex(vector[f"{prefix}_ephemeral"]),
        static=bytes.fromhex(vector[f"{prefix}_static"]) if f"{prefix}_static" in vector else None,
    )


def test_the_vector_files_hold_the_five_suites():
    assert sorted(v["protocol_name"] for v in VECTORS) == [
        "Noise_NN_25519_ChaChaPoly_SHA256",
        "Noise_NNpsk0_25519_ChaChaPoly_SHA256",
        "Noise_NNpsk2_25519_ChaChaPoly_SHA256",
        "Noise_XX_25519_ChaChaPoly_SHA256",
        "Noise_XXpsk3_25519_ChaChaPoly_SHA256",
    ]


@pytest.mark.parametrize("initiator", [True, False], ids=["initiator", "responder"])
@pytest.mark.parametrize("vector", VECTORS, ids=[v["protocol_name"] for v in VECTORS])
def test_one_side_reproduces_every_vector_message(vector, initiator):
    """Our side writes its messages byte for byte and reads the other side's from the vector alone."""
    state = _side(vector, initiator)
    assert state.protocol_name == vector["protocol_name"]
    handshake_messages = len(PATTERNS[_pattern(vector)])
    send = receive = None
    for index, message in enumerate(vector["messages"]):
        payload, ciphertext = bytes.fromhex(message["payload"]), bytes.fromhex(message["ciphertext"])
        ours = (index % 2 == 0) == initiator  # messages alternate, initiator first
        if index < handshake_messages:
            if ours:
                assert state.write_message(payload) == ciphertext, f"handshake message {index}"
            else:
                assert state.read_message(ciphertext) == payload, f"handshake message {index}"
            continue
        if send is None:
            assert state.finished
            assert state.handshake_hash.hex() == vector["handshake_hash"]
            send, receive = state.split()
            if "init_static" in vector:  # each side learned the other's static key
                other = "resp" if initiator else "init"
                assert state.remote_static == _public(bytes.fromhex(vector[f"{other}_static"]))
        if ours:
            assert send.encrypt_with_ad(b"", payload) == ciphertext, f"transport message {index}"
        else:
            assert receive.decrypt_with_ad(b"", ciphertext) == payload, f"transport message {index}"
    assert send is not None, "the vector has transport messages"


def _public(static: bytes) -> bytes:
    from nodes.link.noise import public_key

    return public_key(static)


def _pair(pattern: str, init_psk: bytes | None = None, resp_psk: bytes | None = None):
    return (
        HandshakeState(pattern, initiator=True, prologue=b"p", psk=init_psk),
        HandshakeState(pattern, initiator=False, prologue=b"p", psk=resp_psk),
    )


def test_nonce_is_four_zero_bytes_then_the_little_endian_counter():
    key = bytes(range(32))
    state = CipherState(key)
    state.n = 5
    expected = ChaCha20Poly1305(key).encrypt(b"\x00" * 4 + (5).to_bytes(8, "little"), b"hi", b"ad")
    assert state.encrypt_with_ad(b"ad", b"hi") == expected
    assert state.n == 6


def test_the_last_nonce_is_reserved():
    state = CipherState(bytes(32))
    state.n = MAX_NONCE - 1
    state.encrypt_with_ad(b"", b"last one")
    with pytest.raises(NoiseError, match="nonce exhausted"):
        state.encrypt_with_ad(b"", b"one too many")


def test_a_failed_decrypt_raises_noise_error_and_keeps_the_nonce():
    sender, receiver = CipherState(bytes(32)), CipherState(bytes(32))
    ciphertext = sender.encrypt_with_ad(b"", b"hello")
    forged = ciphertext[:-1] + bytes([ciphertext[-1] ^ 1])
    with pytest.raises(NoiseError, match="authentication"):
        receiver.decrypt_with_ad(b"", forged)
    assert receiver.n == 0
    assert receiver.decrypt_with_ad(b"", ciphertext) == b"hello"


def test_a_wrong_psk_fails_nnpsk0_at_the_responder():
    initiator, responder = _pair("NNpsk0", PSK, bytes(32))
    with pytest.raises(NoiseError, match="authentication"):
        responder.read_message(initiator.write_message(b""))
    with pytest.raises(NoiseError, match="failed"):
        responder.write_message(b"")


def test_a_wrong_psk_fails_nnpsk2_at_the_initiator():
    initiator, responder = _pair("NNpsk2", PSK, bytes(32))
    responder.read_message(initiator.write_message(b""))
    with pytest.raises(NoiseError, match="authentication"):
        initiator.read_message(responder.write_message(b""))


def test_a_different_prologue_fails_the_handshake():
    initiator = HandshakeState("NNpsk0", initiator=True, prologue=b"one", psk=PSK)
    responder = HandshakeState("NNpsk0", initiator=False, prologue=b"two", psk=PSK)
    with pytest.raises(NoiseError):
        responder.read_message(initiator.write_message(b""))


def test_a_tampered_reply_fails_the_handshake():
    initiator, responder = _pair("NN")
    responder.read_message(initiator.write_message(b""))
    reply = bytearray(responder.write_message(b"secret"))
    reply[-1] ^= 0x80
    with pytest.raises(NoiseError, match="authentication"):
        initiator.read_message(bytes(reply))
    with pytest.raises(NoiseError, match="not finished"):
        initiator.split()


def test_a_low_order_ephemeral_key_is_refused():
    responder = HandshakeState("NN", initiator=False)
    responder.read_message(bytes(32))  # the all-zero point: every DH with it is zero
    with pytest.raises(NoiseError, match="invalid X25519 public key"):
        responder.write_message(b"")


def test_short_messages_and_misuse_raise_noise_error():
    with pytest.raises(NoiseError, match="too short"):
        HandshakeState("NN", initiator=False).read_message(b"\x01" * 31)
    with pytest.raises(NoiseError, match="too short"):
        HandshakeState("NNpsk0", initiator=False, psk=PSK).read_message(b"\x01" * 40)
    with pytest.raises(NoiseError, match="out of turn"):
        HandshakeState("NN", initiator=True).read_message(b"\x01" * 32)
    with pytest.raises(NoiseError, match="32-byte psk"):
        HandshakeState("NNpsk0", initiator=True, psk=b"short")
    with pytest.raises(NoiseError, match="takes no psk"):
        HandshakeState("NN", initiator=True, psk=PSK)
    with pytest.raises(NoiseError, match="unsupported"):
        HandshakeState("KK", initiator=True)
    with pytest.raises(NoiseError, match="static private key"):
        HandshakeState("XX", initiator=True)


def _xx_pair(init_psk: bytes, resp_psk: bytes):
    return (
        HandshakeState("XXpsk3", initiator=True, prologue=b"p", psk=init_psk, static=generate_static()),
        HandshakeState("XXpsk3", initiator=False, prologue=b"p", psk=resp_psk, static=generate_static()),
    )


def test_a_wrong_psk_fails_xxpsk3_at_the_responders_last_read():
    initiator, responder = _xx_pair(PSK, bytes(32))
    responder.read_message(initiator.write_message(b""))
    initiator.read_message(responder.write_message(b""))
    with pytest.raises(NoiseError, match="authentication"):
        responder.read_message(initiator.write_message(b""))


def test_xxpsk3_tells_each_side_the_others_static_key():
    init_static, resp_static = generate_static(), generate_static()
    initiator = HandshakeState("XXpsk3", initiator=True, psk=PSK, static=init_static)
    responder = HandshakeState("XXpsk3", initiator=False, psk=PSK, static=resp_static)
    responder.read_message(initiator.write_message(b""))
    assert responder.remote_static is None
    initiator.read_message(responder.write_message(b""))
    assert initiator.remote_static == _public(resp_static)
    responder.read_message(initiator.write_message(b""))
    assert responder.remote_static == _public(init_static)
    assert initiator.handshake_hash == responder.handshake_hash


def test_split_keys_differ_per_direction_and_match_across_sides():
    initiator, responder = _pair("NNpsk0", PSK, PSK)
    responder.read_message(initiator.write_message(b""))
    initiator.read_message(responder.write_message(b""))
    assert initiator.handshake_hash == responder.handshake_hash
    i_send, i_recv = initiator.split()
    r_send, r_recv = responder.split()
    assert r_recv.decrypt_with_ad(b"", i_send.encrypt_with_ad(b"", b"to head")) == b"to head"
    assert i_recv.decrypt_with_ad(b"", r_send.encrypt_with_ad(b"", b"to node")) == b"to node"
    reflected = i_send.encrypt_with_ad(b"", b"echo")
    with pytest.raises(NoiseError):
        i_recv.decrypt_with_ad(b"", reflected)
