"""Tokenizer against llama.cpp itself, on the two shipped models.

Vocabularies load in well under a second and are shared per module; the one full-model
load (SmolLM2, 98 MB, for the reference ids) is also done once.
"""

from __future__ import annotations

from pathlib import Path

import llama_cpp
import pytest

from skippy.mesh.models import pull
from skippy.mesh.tokenizer import TextStream, Tokenizer, TokenizerError

SAMPLES = [
    "Hello, world!",
    "  leading spaces\tand tabs\n\nnew lines  ",
    "The quick brown fox jumps over the lazy dog 1234567890.",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return x ** 2  # squares\n",
    "",
]

# Byte-level BPE spreads these over several tokens, so the stream must hold bytes back.
MULTIBYTE = [
    "Crème brûlée, naïve façade, Ångström, Straße",
    "日本語のテキストと中文文本，还有한국어",
    "Emoji: 👋🏽 👩‍👩‍👧‍👦 🇫🇷 🤖✨ and e\u0301 (combining acute)",
    "Mixed: ça va? 😀 — “quotes” … €100 ≈ ¥15000 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    return pull("smollm2")


@pytest.fixture(scope="module")
def smollm2_tok(smollm2_path: Path) -> Tokenizer:
    return Tokenizer(smollm2_path)


@pytest.fixture(scope="module")
def gemma_tok() -> Tokenizer:
    return Tokenizer(pull("gemma3-270m"))


@pytest.fixture(scope="module", params=["smollm2", "gemma"])
def tok(request, smollm2_tok: Tokenizer, gemma_tok: Tokenizer) -> Tokenizer:
    return {"smollm2": smollm2_tok, "gemma": gemma_tok}[request.param]


@pytest.fixture(scope="module")
def smollm2_full(smollm2_path: Path) -> llama_cpp.Llama:
    llm = llama_cpp.Llama(model_path=str(smollm2_path), n_ctx=64, n_batch=64,
                          n_gpu_layers=0, verbose=False)
    yield llm
    llm.close()


def stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    s = tok.stream_decoder()
    return [s.push(i) for i in ids] + [s.flush()]


# -- encode ----------------------------------------------------------------------------------
@pytest.mark.parametrize("text", SAMPLES + MULTIBYTE)
def test_ids_equal_the_full_models_tokenizer(smollm2_tok, smollm2_full, text):
    want = smollm2_full.tokenize(text.encode(), add_bos=True, special=True)
    assert smollm2_tok.encode(text) == want


def test_gemma_adds_exactly_one_bos(gemma_tok):
    assert gemma_tok.add_bos and gemma_tok.bos_id == 2
    ids = gemma_tok.encode("Hello")
    assert ids[0] == 2 and ids.count(2) == 1
    assert gemma_tok.encode("Hello", add_special=False) == ids[1:]
    assert gemma_tok.encode("") == [2]


def test_smollm2_adds_no_bos(smollm2_tok):
    assert not smollm2_tok.add_bos and smollm2_tok.bos_id == 1
    ids = smollm2_tok.encode("Hello")
    assert smollm2_tok.bos_id not in ids
    assert ids == smollm2_tok.encode("Hello", add_special=False)
    assert smollm2_tok.encode("") == []


def test_special_token_text_becomes_one_control_id(smollm2_tok, gemma_tok):
    assert smollm2_tok.encode("<|im_start|>user") == [1, 4093]
    start = gemma_tok.encode("<start_of_turn>", add_special=False)
    assert len(start) == 1 and gemma_tok.token_text(start[0]) == "<start_of_turn>"


def test_a_long_text_tokenizes_in_one_call_with_the_same_ids(tok, monkeypatch):
    text = "  leading spaces\tand tabs\n\nnew lines  " * 200 + "<|im_end|>"
    want = tok._llm.tokenize(text.encode(), add_bos=True, special=True)
    calls = []
    real = llama_cpp.llama_tokenize
    monkeypatch.setattr(llama_cpp, "llama_tokenize", lambda *a: calls.append(1) or real(*a))
    assert tok.encode(text) == want
    assert len(calls) == 1


@pytest.mark.parametrize("name, text, spells", [
    ("smollm2_tok", "plain text, <b>bold</b> and a < b > c", False),
    ("smollm2_tok", "<|im_end|>", True), ("smollm2_tok", "say <|im_start|>user", True),
    ("smollm2_tok", "<|im_start", False), ("smollm2_tok", "<start_of_turn>", False),
    ("gemma_tok", "<start_of_turn>", True), ("gemma_tok", "<|im_end|>", False)])
def test_spelling_a_control_token_is_what_parsing_control_tokens_changes(request, name, text,
                                                                        spells):
    tok = request.getfixturevalue(name)
    assert tok.spells_control(text) == spells
    assert spells == (tok.encode(text, add_special=False)
                      != tok.encode(text, add_special=False, control=False))


@pytest.mark.parametrize("text", ["<|im_end|>", "x <|im_", "|>x", "im_sta", "> quoted"])
def test_text_that_may_complete_a_control_token_beside_other_text(smollm2_tok, text):
    assert smollm2_tok.may_touch_control(text)


@pytest.mark.parametrize("text", ["Hello there", "\n\nhi", "a < b", "tools: {\"x\": 1}"])
def test_text_that_cannot_touch_a_control_token(smollm2_tok, text):
    assert not smollm2_tok.may_touch_control(text)


# -- decode and stream -------------------------------------------------------------------------
@pytest.mark.parametrize("text", MULTIBYTE + SAMPLES[:3])
def test_stream_reproduces_multibyte_text_exactly(tok, text):
    ids = tok.encode(text)
    pieces = stream(tok, ids)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert tok.decode(ids) == text


def test_stream_holds_back_a_split_character(smollm2_tok):
    ids = smollm2_tok.encode("👋")
    assert len(ids) > 1  # byte-level BPE: the emoji's 4 bytes are several tokens
    s = smollm2_tok.stream_decoder()
    assert [s.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert s.pending
    assert s.push(ids[-1]) == "👋"
    assert not s.pending


def test_flush_turns_a_dangling_partial_character_into_replacement(smollm2_tok):
    ids = smollm2_tok.encode("👋")
    s = TextStream(smollm2_tok)
    assert s.push(ids[0]) == ""
    assert s.flush() == "\ufffd"
    assert s.push(smollm2_tok.encode("a")[0]) == "a"  # the stream reset after flush


def test_control_tokens_are_silent_unless_special(smollm2_tok, gemma_tok):
    ids = smollm2_tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert smollm2_tok.decode(ids) == "user\nHi"
    assert smollm2_tok.decode(ids, special=True) == "<|im_start|>user\nHi<|im_end|>"
    assert "".join(stream(smollm2_tok, ids)) == "user\nHi"
    assert gemma_tok.decode(gemma_tok.encode("Hi"), special=True) == "<bos>Hi"


def test_pieces_longer_than_32_bytes_survive(smollm2_tok):
    # llama-cpp-python's Llama.detokenize uses a 32-byte buffer and drops such pieces.
    text = "\n" + " " * 80
    ids = smollm2_tok.encode(text)
    assert len(ids) == 1 and len(smollm2_tok.piece(ids[0])) == 81
    assert smollm2_tok.decode(ids) == text
    assert "".join(stream(smollm2_tok, ids)) == text


# -- special ids -------------------------------------------------------------------------------
def test_eog_ids_are_llama_cpps_set(smollm2_tok, gemma_tok):
    assert smollm2_tok.eos_id in smollm2_tok.eog_ids
    eog_texts = {smollm2_tok.token_text(i) for i in smollm2_tok.eog_ids}
    assert eog_texts >= {"<|im_end|>", "<|endoftext|>"}
    assert gemma_tok.eos_id == 1 and gemma_tok.eos_id in gemma_tok.eog_ids
    assert {gemma_tok.token_text(i) for i in gemma_tok.eog_ids} >= {"<eos>", "<end_of_turn>"}
    assert gemma_tok.is_eog(gemma_tok.encode("<end_of_turn>", add_special=False)[0])
    assert not gemma_tok.is_eog(gemma_tok.bos_id)


def test_vocab_sizes(smollm2_tok, gemma_tok):
    assert smollm2_tok.vocab_size == 49152
    assert gemma_tok.vocab_size == 262144


# -- loading -----------------------------------------------------------------------------------
def test_loading_is_quiet(smollm2_path, capfd):
    Tokenizer(smollm2_path).close()
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_a_file_that_is_not_gguf_is_a_tokenizer_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(TokenizerError, match="not a GGUF"):
        Tokenizer(bad)
    with pytest.raises(TokenizerError, match="no such model file"):
        Tokenizer(tmp_path / "missing.gguf")
