"""Tokenizers: the fingerprint both ends compute (nodes.agent.vocab), the head's tokenizers and the registry's check
(nodes.tokenizers, nodes.services.node_register), and a node's upload of its tokenizer over the link."""

from __future__ import annotations

import mmap
import shutil
import struct
import zlib
from pathlib import Path

import pytest

from nodes.agent.models import resolve_model
from nodes.agent.vocab import BUILTINS, BYTES, MOCK, Vocab, tokenizer_fingerprint, vocab_gguf

BUNDLED, _ = resolve_model("smollm2")


def different_tokenizer_copy(source: Path, target: Path, token: int = 1000) -> Path:
    """A copy of the GGUF at `source` whose vocabulary differs in one token (one letter of it flipped in place, so
    every offset stays and llama.cpp still loads the model)."""
    shutil.copyfile(source, target)
    name = b"tokenizer.ggml.tokens"
    with open(target, "r+b") as handle, mmap.mmap(handle.fileno(), 0) as data:
        at = data.find(struct.pack("<Q", len(name)) + name) + 8 + len(name) + 4 + 4 + 8  # key, type, item type, count
        for _ in range(token):
            at += 8 + struct.unpack_from("<Q", data, at)[0]
        length = struct.unpack_from("<Q", data, at)[0]
        last = at + 8 + length - 1
        data[last] = data[last] ^ 0x20 if chr(data[last]).isalpha() else ord("q")
    return target


# --- the fingerprint -------------------------------------------------------------------------------------------


def test_a_metadata_only_copy_has_the_models_fingerprint_and_tokenizes_the_same(tmp_path):
    vocab_file = tmp_path / "vocab.gguf"
    vocab_file.write_bytes(vocab_gguf(BUNDLED))

    assert vocab_file.stat().st_size < BUNDLED.stat().st_size / 20  # keys only, no tensor
    fingerprint = tokenizer_fingerprint(BUNDLED)
    assert len(fingerprint) == 64 and tokenizer_fingerprint(vocab_file) == fingerprint
    text = "<|im_start|>user\nHow many lanes does node-a have? Ünïcödé too.<|im_end|>"
    assert Vocab(vocab_file, fingerprint).tokenize(text) == Vocab(BUNDLED, fingerprint).tokenize(text)


def test_one_changed_token_changes_the_fingerprint(tmp_path):
    other = different_tokenizer_copy(BUNDLED, tmp_path / "smollm2.gguf")
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(BUNDLED)


# --- the registry's tokenizer, and a node whose tokenizer differs ------------------------------------------------


@pytest.fixture
def registry_model(db, settings, tmp_path):
    from nodes.registry import model_add

    settings.FLEET_HOME = tmp_path / "home"
    return model_add(path=BUNDLED, name="smollm2")


def register(**overrides):
    from nodes.services import node_register

    fields = dict(identity="gpu-1", public_key="11" * 32, address="", token=None, models=["smollm2"], lanes=2,
                  context_window=2048, capabilities={}, engine="llama.cpp", version="t", labels={}, replicas=[])
    return node_register(**{**fields, **overrides})


def test_the_head_computes_the_registry_models_fingerprint_as_the_node_does(registry_model):
    from nodes.models import Model
    from nodes.tokenizers import model_tokenizer, tokenizer_path

    assert registry_model.tokenizer == tokenizer_fingerprint(BUNDLED)  # computed when the model is added
    # A row from before the field is filled in the first time it is needed, with the tokenizer's file
    Model.objects.filter(pk=registry_model.pk).update(tokenizer="")
    registry_model.refresh_from_db()
    assert model_tokenizer(registry_model) == tokenizer_fingerprint(BUNDLED)
    registry_model.refresh_from_db()
    assert registry_model.tokenizer == tokenizer_fingerprint(BUNDLED)
    assert tokenizer_fingerprint(tokenizer_path(registry_model.tokenizer)) == registry_model.tokenizer


def test_a_node_with_the_registrys_tokenizer_joins_and_one_with_another_is_refused_with_both(registry_model,
                                                                                            tmp_path):
    from nodes.link.codes import CloseCode
    from nodes.services import JoinRefused

    ours, theirs = tokenizer_fingerprint(BUNDLED), tokenizer_fingerprint(
        different_tokenizer_copy(BUNDLED, tmp_path / "smollm2.gguf"))
    assert register(tokenizers={"smollm2": ours}).tokenizers == {"smollm2": ours}

    with pytest.raises(JoinRefused) as refused:
        register(identity="gpu-2", public_key="22" * 32, tokenizers={"smollm2": theirs})

    assert refused.value.code == CloseCode.TOKENIZER_MISMATCH
    assert refused.value.reason == (f"tokenizer {theirs[:12]} differs from the registry's {ours[:12]} "
                                    "for model 'smollm2'")



@pytest.mark.parametrize("builtin", [MOCK, BYTES])
def test_a_node_reporting_a_builtin_tokenizer_under_a_registry_models_name_is_refused(registry_model, builtin):
    """A builtin is no way around the check: placement would key the registry model's prompts with it."""
    from nodes.link.codes import CloseCode
    from nodes.services import JoinRefused

    with pytest.raises(JoinRefused) as refused:
        register(identity="gpu-3", public_key="33" * 32, tokenizers={"smollm2": builtin})
    assert refused.value.code == CloseCode.TOKENIZER_MISMATCH and f"tokenizer {builtin}" in refused.value.reason
    assert register(identity="gpu-4", public_key="44" * 32, models=["other-model"],
                    tokenizers={"other-model": builtin}).model_names == ["other-model"]  # not a registry name


# --- the head's tokenizers -----------------------------------------------------------------------------------


def test_the_head_keeps_a_sent_tokenizer_only_when_it_is_the_one_named(settings, tmp_path):
    from nodes.tokenizers import TokenizerRefused, tokenizer_get, tokenizer_known, tokenizer_receive

    settings.FLEET_HOME = tmp_path
    fingerprint = tokenizer_fingerprint(BUNDLED)
    other = vocab_gguf(different_tokenizer_copy(BUNDLED, tmp_path / "other.gguf"))
    assert not tokenizer_known(fingerprint)

    with pytest.raises(TokenizerRefused, match="has fingerprint"):
        tokenizer_receive(fingerprint, zlib.compress(other))
    with pytest.raises(TokenizerRefused, match="not zlib data"):
        tokenizer_receive(fingerprint, b"not compressed")
    assert not tokenizer_known(fingerprint)

    tokenizer_receive(fingerprint, zlib.compress(vocab_gguf(BUNDLED)))
    assert tokenizer_known(fingerprint)
    assert tokenizer_get(fingerprint).tokenize("Hello fleet") == Vocab(BUNDLED, fingerprint).tokenize("Hello fleet")


def test_the_model_is_keyed_with_the_tokenizer_its_nodes_reported():
    from nodes.tokenizers import fingerprint_served

    reported = [{"smollm2": "a" * 64}, {"smollm2": "a" * 64, "qwen": "c" * 64}, {"smollm2": "b" * 64}]
    assert fingerprint_served("smollm2", reported) == "a" * 64  # the most common
    assert fingerprint_served("smollm2:pirate", reported) == "a" * 64  # an adapter: its base's
    assert fingerprint_served("llama", reported) == ""
    assert set(BUILTINS) == {"mock", "bytes"}
