"""Token ids for a GGUF model, from llama.cpp's own vocabulary code: the gateway's
(mesh/front/) to tokenize requests, and the last stage's, whose grammar engine reads the
same vocabulary (mesh/token_mask.py).

We do not reimplement BPE/SPM: `llama_cpp.Llama(path, vocab_only=True)` loads only the
vocabulary (no weights, well under a second for the shipped models) and gives exactly the
ids the reference would compute. Text goes in the way llama-server takes a prompt
(`add_special=True, parse_special=True`: llama.cpp decides from the GGUF whether a BOS is
really added, and `<|im_start|>`-style markers in the text become their special ids).

Text comes out two ways:
- `Tokenizer.decode(ids)`: llama.cpp's `llama_detokenize` over the whole sequence.
- `TextStream`: one id at a time, as llama-server streams a completion; bytes of a UTF-8
  character split across tokens are held back until the character is whole.
The two agree except on SentencePiece models with `add_space_prefix` (none shipped), where
`llama_detokenize` drops the first token's leading space and a stream, being the
continuation of a prompt, keeps it.
"""

from __future__ import annotations

import codecs
import contextlib
import ctypes
import os
import re
import sys
import threading
from functools import cached_property
from pathlib import Path
from typing import Iterable, Iterator

import llama_cpp

from skippy.topology.errors import UserError

from .prefix_tokens import CUT_AT_SPACE, PrefixTokens
from skippy.topology.gguf_file import GGUFError, GGUFFile
from skippy.topology.model_package import is_package, metadata_gguf

_LOAD_LOCK = threading.Lock()  # fd 2 is process-wide: one quiet load at a time
# tokens llama.cpp cuts out of a text before its pre-tokenizer runs
_SPECIAL = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED | \
    llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN


class TokenizerError(UserError):
    """The file cannot be loaded as a llama.cpp vocabulary; the message is one line."""


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence fd 2 and sys.stderr for the duration.

    llama.cpp logs from C (fd 2) and, through llama-cpp-python's log callback, via
    Python's sys.stderr; `verbose=False` silences most but not all of it (creating the
    vocab-only context still warns that n_ctx_train is 0).
    """
    if sys.stderr is not None:
        sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            with contextlib.redirect_stderr(null):
                yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class Tokenizer:
    """llama.cpp's vocabulary of one GGUF file: encode, decode, special ids."""

    def __init__(self, path: str | Path):
        # a package's vocabulary is in its shared part
        self.path = metadata_gguf(path) if is_package(path) else Path(path)
        if not self.path.is_file():
            raise TokenizerError(f"no such model file: {self.path}")
        try:  # a readable reason for a bad file; llama.cpp only says "failed to load"
            GGUFFile(self.path).close()
        except (GGUFError, ValueError, KeyError, OSError) as e:  # also a type gguf-py lacks
            reason = str(e) if isinstance(e, GGUFError) else f"{self.path}: {e}"
            raise TokenizerError(f"cannot read as GGUF: {reason}") from None
        try:
            with _LOAD_LOCK, _quiet_stderr():
                self._llm = llama_cpp.Llama(model_path=str(self.path), vocab_only=True,
                                            verbose=False)
        except (ValueError, RuntimeError) as e:
            raise TokenizerError(f"{self.path}: llama.cpp cannot load its vocabulary "
                                 f"({e})") from None
        self._vocab = llama_cpp.llama_model_get_vocab(self._llm.model)
        if self._vocab is None:
            raise TokenizerError(f"{self.path} has no vocabulary")
        self._lengths: dict[int, int] = {}
        self._prefix = PrefixTokens(self._encode, self._length,
                                    self.bos_id if self.add_bos else None, self._normal,
                                    lambda: self.cuts_at_space)

    # -- text -> ids ---------------------------------------------------------------------
    def encode(self, text: str, *, add_special: bool = True, control: bool = True
               ) -> list[int]:
        """Token ids of `text`. With add_special, BOS/EOS are added where the GGUF says so
        (Gemma: BOS; SmolLM2: nothing). With control (as in llama-server), control-token
        text such as `<|im_start|>` becomes its control id; without, it is plain text.
        A text that begins as a recent one did reuses its ids (mesh/prefix_tokens.py)."""
        return self._prefix.encode(text.encode("utf-8"), add_special, control)

    def _encode(self, data: bytes, add_special: bool, control: bool) -> list[int]:
        """llama.cpp's ids of `data`."""
        # a token per byte at most, plus BOS, EOS and SentencePiece's space prefix: one call
        # (llama-cpp-python sizes its first try by n_ctx_train, 0 for a vocabulary alone,
        # so each of its calls tokenized twice)
        size = len(data) + 3
        while True:
            ids = (llama_cpp.llama_token * size)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), ids, size,
                                         add_special, control)
            if n >= 0:
                return ids[:n]
            if -n <= size:
                raise TokenizerError(f"llama.cpp could not tokenize {len(data)} bytes")
            size = -n

    def _length(self, token_id: int) -> int:
        """The bytes of the token's text as it stands in a text (special tokens
        spelled out)."""
        n = self._lengths.get(token_id)
        if n is None:
            n = self._lengths[token_id] = len(self.piece(token_id, special=True))
        return n

    def _normal(self, token_id: int) -> bool:
        return not llama_cpp.llama_vocab_get_attr(self._vocab, token_id) & _SPECIAL

    @cached_property
    def cuts_at_space(self) -> bool:
        """Whether a text's ids may be cut where an ASCII letter meets a space and a
        letter (mesh/prefix_tokens.py): a byte-level BPE vocabulary whose pre-tokenizer
        ends words there, that appends no EOS, and whose special tokens (cut out before
        the pre-tokenizer runs) hold no whitespace and neither begin nor end with a
        letter."""
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_model_meta_val_str(self._llm.model, b"tokenizer.ggml.pre", buf, 64)
        if llama_cpp.llama_vocab_type(self._vocab) != llama_cpp.LLAMA_VOCAB_TYPE_BPE or \
                n < 0 or buf.value.decode("utf-8", "replace") not in CUT_AT_SPACE or \
                self.add_eos:
            return False
        for i in range(self.vocab_size):
            if llama_cpp.llama_vocab_get_attr(self._vocab, i) & _SPECIAL:
                text = llama_cpp.llama_vocab_get_text(self._vocab, i) or b""
                if not text or any(c in text for c in b" \t\n\r") or \
                        text[:1].isalpha() or text[-1:].isalpha():
                    return False
        return True

    def spells_control(self, text: str) -> bool:
        """Whether `text` tokenizes otherwise with control tokens parsed than as plain text
        (it spells a control token). Text that holds no control token's spelling
        tokenizes the same either way (llama.cpp splits out only those when it parses
        them), so only text that holds one is tokenized, twice, to tell."""
        return self._control.occurs_in(text) and \
            self.encode(text, add_special=False) != \
            self.encode(text, add_special=False, control=False)

    def may_touch_control(self, text: str) -> bool:
        """Whether `text`, set between other text, could be all or part of a control
        token's spelling: it holds one, begins with the end of one, ends with the start of
        one, or lies inside one. Where it cannot, tokenizing it apart from its neighbours
        or within them gives it no control token of its own. A string scan."""
        return self._control.touches(text)

    @cached_property
    def _control(self) -> _Spellings:
        """The spellings of the tokens llama.cpp turns text into only when it parses
        control tokens: control and unknown tokens (llama-vocab.cpp,
        tokenizer_st_partition)."""
        kinds = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
        texts = (llama_cpp.llama_vocab_get_text(self._vocab, i)
                 for i in range(self.vocab_size)
                 if llama_cpp.llama_vocab_get_attr(self._vocab, i) & kinds)
        return _Spellings(frozenset(t.decode("utf-8", errors="replace") for t in texts
                                    if t))

    def encode_pieces(self, pieces: list[tuple[str, bool]]) -> list[int]:
        """Token ids of (text, control) pieces in order, BOS/EOS as for their joined text:
        each piece parsed for control tokens or not. llama.cpp cuts text at control tokens
        before its pre-tokenizer runs, so pieces that meet at one tokenize as the whole."""
        ids = [self.bos_id] if self.add_bos and self.bos_id is not None else []
        for text, control in pieces:
            ids += self.encode(text, add_special=False, control=control)
        return ids + ([self.eos_id] if self.add_eos and self.eos_id is not None else [])

    # -- ids -> text ---------------------------------------------------------------------
    def piece(self, token_id: int, *, special: bool = False) -> bytes:
        """The bytes of one token. With special=False, control tokens (BOS, EOS,
        `<|im_end|>`) give b"", as in llama-server's completion text."""
        # llama-cpp-python's own detokenize uses a fixed 32-byte buffer and returns garbage
        # for longer pieces (SmolLM2 has a 162-byte token), so we size the buffer here.
        size = 64
        while True:
            buf = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_token_to_piece(self._vocab, token_id, buf, size, 0, special)
            if n >= 0:
                return buf.raw[:n]
            size = -n

    def decode(self, ids: Iterable[int], *, special: bool = False) -> str:
        """The text of a whole id sequence (llama.cpp's `llama_detokenize`); invalid UTF-8
        becomes U+FFFD. With special=True, control tokens are rendered as their text."""
        ids = list(ids)
        if not ids:
            return ""
        arr = (llama_cpp.llama_token * len(ids))(*ids)
        size = max(64, 8 * len(ids))
        while True:
            buf = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_detokenize(self._vocab, arr, len(ids), buf, size,
                                           False, special)
            if n >= 0:
                return buf.raw[:n].decode("utf-8", errors="replace")
            size = -n

    def stream_decoder(self, *, special: bool = False) -> TextStream:
        """A fresh `TextStream` over this vocabulary."""
        return TextStream(self, special=special)

    def token_text(self, token_id: int) -> str:
        """The token as text with special tokens spelled out (e.g. "<bos>", "<|im_end|>")."""
        return self.piece(token_id, special=True).decode("utf-8", errors="replace")

    # -- special ids and flags -------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return int(llama_cpp.llama_vocab_n_tokens(self._vocab))

    @property
    def bos_id(self) -> int | None:
        return self._token_or_none(llama_cpp.llama_vocab_bos(self._vocab))

    @property
    def eos_id(self) -> int | None:
        return self._token_or_none(llama_cpp.llama_vocab_eos(self._vocab))

    @property
    def add_bos(self) -> bool:
        """Whether encode(add_special=True) prepends BOS: llama.cpp's reading of
        `tokenizer.ggml.add_bos_token`, with its per-tokenizer default when absent."""
        return bool(llama_cpp.llama_vocab_get_add_bos(self._vocab))

    @property
    def add_eos(self) -> bool:
        return bool(llama_cpp.llama_vocab_get_add_eos(self._vocab))

    @cached_property
    def eog_ids(self) -> frozenset[int]:
        """End-of-generation ids exactly as llama.cpp decides them: EOS, EOT and the tokens
        it recognises by text (`<|im_end|>`, `<end_of_turn>`, `<|endoftext|>`, FIM repo
        separators…). A scan of the vocab: ~20 ms for SmolLM2, ~80 ms for Gemma."""
        is_eog = llama_cpp.llama_vocab_is_eog
        return frozenset(i for i in range(self.vocab_size) if is_eog(self._vocab, i))

    @property
    def llama_vocab(self):
        """llama.cpp's vocabulary handle (for engines that read it, mesh/token_mask.py);
        valid until `close`."""
        return self._vocab

    def special_id(self, text: str) -> int | None:
        """The id of the special token spelled `text`, or None. Special as the grammar
        engine (llguidance) reads a llama.cpp vocabulary: a control token, or a
        user-defined one in angle brackets (Qwen's `<tool_call>`); a grammar must name
        such a token by id, since it never spells it with ordinary text."""
        ids = self.encode(text, add_special=False)
        if len(ids) != 1 or self.token_text(ids[0]) != text:
            return None
        attr = llama_cpp.llama_vocab_get_attr(self._vocab, ids[0])
        angled = text.startswith("<") and text.endswith(">")
        if attr & llama_cpp.LLAMA_TOKEN_ATTR_CONTROL or (
                attr & llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED and angled):
            return ids[0]
        return None

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.eog_ids

    @staticmethod
    def _token_or_none(token_id: int) -> int | None:
        return None if token_id < 0 else int(token_id)  # LLAMA_TOKEN_NULL is -1

    def close(self) -> None:
        """Free the llama.cpp vocabulary now rather than at garbage collection."""
        self._llm.close()

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r})"


class _Spellings:
    """A set of token spellings, searched for in text without a tokenizer."""

    def __init__(self, spellings: frozenset[str]):
        self.spellings = spellings
        self.longest = max(map(len, spellings), default=0)
        self._lengths: dict[str, set[int]] = {}  # first character -> spelling lengths
        for s in spellings:
            self._lengths.setdefault(s[0], set()).add(len(s))
        self._heads = {s[:k] for s in spellings for k in range(1, len(s))}
        self._tails = {s[k:] for s in spellings for k in range(1, len(s))}
        self._starts = re.compile("|".join(map(re.escape, sorted(self._lengths)))) \
            if spellings else None

    def occurs_in(self, text: str) -> bool:
        if self._starts is None:
            return False
        for m in self._starts.finditer(text):
            i = m.start()
            if any(text[i:i + n] in self.spellings for n in self._lengths[m.group()]):
                return True
        return False

    def touches(self, text: str) -> bool:
        """`text` holds a spelling, or meets one across either of its edges."""
        if not text or self._starts is None:
            return False
        edge = range(1, min(len(text), self.longest) + 1)
        return (self.occurs_in(text) or any(text[-k:] in self._heads for k in edge)
                or any(text[:k] in self._tails for k in edge)
                or (len(text) < self.longest and any(text in s for s in self.spellings)))


class TextStream:
    """Token ids in, text out, one id at a time, never splitting a UTF-8 character.

    A character such as an emoji is often spread over several byte-level tokens; each
    `push` returns only the text completed so far and keeps the trailing partial bytes for
    the next call. `flush` ends the stream: bytes still held back are not valid UTF-8 and
    come out as U+FFFD. The pieces joined equal `Tokenizer.decode` of the same ids (see the
    module docstring for the one exception).
    """

    def __init__(self, tokenizer: Tokenizer, *, special: bool = False):
        self._tokenizer = tokenizer
        self._special = special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """The text that `token_id` completes (possibly "")."""
        return self._utf8.decode(self._tokenizer.piece(token_id, special=self._special))

    def flush(self) -> str:
        """Whatever is still held back, as replacement characters; the stream resets."""
        tail = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return tail

    @property
    def pending(self) -> bool:
        """Whether bytes of an unfinished character are being held back."""
        return bool(self._utf8.getstate()[0])
