"""Token ids of a text that begins as a recent one did: the recent text's ids up to a
word boundary, then only the rest tokenized.

A warm request's prompt is mostly text the server tokenized moments ago (the system
prompt, earlier turns, a shared document), and llama.cpp's tokenizer costs about 1 ms per
130 words once a stage's weights have swept the caches: more than the warm request's own
compute on a small model. The ids stay exactly llama.cpp's:

- A text seen before, whole, gets its ids again (the tokenizer is a pure function).
- A byte-level BPE vocabulary cuts text into words with its pre-tokenizer's regex and
  merges within each word only. For the pre-tokenizers in `CUT_AT_SPACE` no word holds a
  letter followed by a space, so where an ASCII letter is followed by a space and an
  ASCII letter, a word ends and the next begins: the ids of the text are those of the
  part before plus those of the rest. Special tokens (cut out of the text before the
  regex runs) must not meet such a point: a vocabulary whose special tokens hold
  whitespace or begin or end with a letter, or one that appends EOS, only reuses whole
  texts.

tests/test_prefix_tokens.py checks the ids against plain tokenization on texts of every
kind (words, digits, punctuation, newlines, non-ASCII, special tokens)."""

from __future__ import annotations

import bisect
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

# llama.cpp pre-tokenizers (tokenizer.ggml.pre) whose regexes end every letter run before
# a space (GPT-2's ` ?\p{L}+`, Llama 3's and Qwen 2's `[^\r\n\p{L}\p{N}]?\p{L}+`, GPT-4o's
# cased runs), each applied within the pieces of the one before
CUT_AT_SPACE = frozenset({
    "gpt-2", "phi-2", "exaone4", "mellum", "mpt", "olmo", "jais",
    "starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b",
    "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
    "lfm2", "dbrx", "smaug-bpe", "qwen2", "deepseek-r1-qwen", "megrez", "stablelm2",
    "qwen35", "glm4", "chatglm-bpe", "gpt-4o", "llama4", "minimax-m2"})
MIN_BYTES = 256    # shorter texts tokenize in microseconds
ENTRIES = 32           # recent texts kept per (add_special, control),
HELD_BYTES = 16 << 20  # and their bytes (text, ids and ends) at most
_SPACE = 0x20


def _letter(b: int) -> bool:
    return 0x41 <= b <= 0x5A or 0x61 <= b <= 0x7A


@dataclass
class _Known:
    data: bytes
    ids: array      # int32
    ends: array | None  # int32: the byte offset where each id's text ends (None: some
    # id's text is not the text's own bytes, as a SentencePiece space prefix: whole only)

    @property
    def nbytes(self) -> int:
        return len(self.data) + 8 * len(self.ids)


class PrefixTokens:
    """Recent texts' ids, reused as the module says. `encode(data, add_special,
    control)` is the plain tokenizer; `length(id)` the bytes of an id's text (special
    tokens spelled out); `bos`: the id add_special puts first, if any (no text of its
    own); `normal(id)`: an ordinary token, not a special one; `cut()`: whether word
    boundaries may be used (asked once, at the first need; else only whole texts are
    reused)."""

    def __init__(self, encode: Callable[[bytes, bool, bool], list[int]],
                 length: Callable[[int], int], bos: int | None,
                 normal: Callable[[int], bool], cut: Callable[[], bool]):
        self._encode, self._length, self._bos = encode, length, bos
        self._normal, self._cut, self._cuts = normal, cut, None
        self._known: dict[tuple[bool, bool], OrderedDict[bytes, _Known]] = {}
        self._lock = threading.Lock()
        self.reused = 0  # ids taken from a recent text rather than tokenized (tests read it)

    def encode(self, data: bytes, add_special: bool, control: bool) -> list[int]:
        if len(data) < MIN_BYTES:
            return self._encode(data, add_special, control)
        with self._lock:
            known = self._known.setdefault((add_special, control), OrderedDict())
            whole = known.get(data)
            if whole is not None:
                known.move_to_end(data)
                self.reused += len(whole.ids)
                return whole.ids.tolist()
            base, k = self._cut_point(known, data) if self._may_cut() else (None, 0)
        if base is None:
            ids = self._encode(data, add_special, control)
            bos = add_special and ids[:1] == [self._bos]
            ends = self._ends(ids[1:], 0, [0]) if bos else self._ends(ids, 0)
        else:
            o = base.ends[k - 1]
            rest = self._encode(data[o:], False, control)
            ids, ends = base.ids[:k].tolist() + rest, \
                base.ends[:k].tolist() + self._ends(rest, o)
        with self._lock:
            if base is not None:
                self.reused += k
            if (ends[-1] if ends else 0) != len(data):
                ends = None
            self._keep(known, _Known(data, array("i", ids),
                                     None if ends is None else array("i", ends)))
        return ids

    def _keep(self, known: OrderedDict[bytes, _Known], new: _Known) -> None:
        """`new` kept; the oldest texts forgotten beyond ENTRIES or HELD_BYTES."""
        known.pop(new.data, None)
        known[new.data] = new
        held = sum(k.nbytes for k in known.values())
        while len(known) > ENTRIES or (held > HELD_BYTES and len(known) > 1):
            held -= known.popitem(last=False)[1].nbytes

    def _may_cut(self) -> bool:
        if self._cuts is None:
            self._cuts = bool(self._cut())
        return self._cuts

    def _ends(self, ids: list[int], at: int, out: list[int] | None = None) -> list[int]:
        """The offsets where each id's text ends, the first starting at `at`, after
        `out`."""
        out = [] if out is None else out
        for t in ids:
            at += self._length(t)
            out.append(at)
        return out

    def _cut_point(self, known: OrderedDict[bytes, _Known], data: bytes
                   ) -> tuple[_Known | None, int]:
        """The recent text sharing the longest start with `data`, and how many of its
        ids to keep: those ending at the last word boundary both texts share."""
        best, best_n = None, 0
        for k in known.values():
            if k.ends is None:
                continue
            n = _common(k.data, data)
            if n > best_n:
                best, best_n = k, n
        if best is None:
            return None, 0
        # a boundary o: data[o - 1] a letter, data[o] a space, data[o + 1] a letter, all
        # within the shared start (so the recent text has it too), an id ending there
        i = bisect.bisect_right(best.ends, best_n - 2)
        while i > 0:
            o = best.ends[i - 1]
            if o >= 1 and data[o] == _SPACE and _letter(data[o - 1]) and \
                    _letter(data[o + 1]) and self._normal(best.ids[i - 1]):
                return best, i
            i -= 1
            if best_n - o > 4096:  # no boundary near: tokenize it all
                break
        return None, 0


def _common(a: bytes, b: bytes) -> int:
    """The length of the longest common start of a and b (a binary search of slice
    comparisons: memcmp, not a Python loop over the bytes)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
