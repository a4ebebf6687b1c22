"""The last stage's side of a constraint (mesh/constraint.py): which tokens may come next.

`Vocabulary` holds the grammar engine's view of one model's tokens, built once per stage
on the first constrained request from the `VocabularyView` its caller's loader returns
(the stage server's: llama.cpp's vocabulary of the stage's own GGUF or package, SmolLM2's
49k tokens in ~0.4 s). `TokenMask` is one request's matcher: the
sampler (mesh/sampler.py) asks it for the allowed tokens before each pick and tells it the
token picked; it lives as long as the request's sampler and is dropped with it.

The model's end-of-generation ids are the grammar's end: a complete reply allows only
them, and the request stops there as any reply that ends does (finish_reason "stop").
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from .constraint import Constraint, ConstraintError

_NEG = np.float32(-np.inf)


class VocabularyView(Protocol):
    """What the grammar engine reads of one model's vocabulary (mesh/tokenizer.py's
    `Tokenizer` is one): llama.cpp's vocabulary handle and the end-of-generation ids."""

    @property
    def llama_vocab(self) -> object: ...

    @property
    def eog_ids(self) -> frozenset[int]: ...


class Vocabulary:
    """The grammar engine's tokenizer for one model, built on first use from the view
    `load` returns (called once)."""

    def __init__(self, load: Callable[[], VocabularyView]):
        self._load = load
        self._lock = threading.Lock()
        self._tokenizer = None
        self._vocab: VocabularyView | None = None  # the engine's tokenizer calls into it

    def tokenizer(self):
        """llguidance's LLTokenizer over this model's vocabulary (built once), whose ends
        are the end-of-generation ids llama.cpp recognises (the ids the gateway stops on).
        It calls into llama.cpp's vocabulary, which therefore stays loaded with it."""
        from llguidance.llamacpp import lltokenizer_from_vocab

        with self._lock:
            if self._tokenizer is None:
                self._vocab = self._load()
                ends = sorted(self._vocab.eog_ids) or None
                with warnings.catch_warnings():  # it calls a llama.cpp name now deprecated
                    warnings.simplefilter("ignore", DeprecationWarning)
                    self._tokenizer = lltokenizer_from_vocab(self._vocab.llama_vocab,
                                                             eos_token=ends)
            return self._tokenizer

    def mask(self, constraint: Constraint) -> TokenMask:
        return TokenMask(self.tokenizer(), constraint)


class TokenMask:
    """One request's grammar state: `apply` masks a logits row, `advance` moves past the
    token sampled from it. A grammar that fails to compile raises ConstraintError here."""

    def __init__(self, tokenizer, constraint: Constraint):
        import llguidance
        self.constraint = constraint
        self._matcher = llguidance.LLMatcher(tokenizer, constraint.grammar(), log_level=0)
        self._raise_if_failed()
        self._n = tokenizer.vocab_size
        self._words = torch.zeros((self._n + 31) // 32, dtype=torch.int32)

    def allowed(self) -> torch.Tensor:
        """A bool row over the vocabulary: True where the grammar allows the token next."""
        self._matcher.unsafe_compute_mask_ptr(self._words.data_ptr(),
                                              self._words.numel() * 4)
        self._raise_if_failed()
        return unpack(self._words, self._n)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` with what the grammar forbids next at -inf (a copy)."""
        return masked(logits, self.allowed())

    def advance(self, token: int) -> None:
        """The token the request produced: the grammar moves past it. A token the grammar
        forbids (a rebuilt request whose tokens came from elsewhere) is ConstraintError."""
        if not self._matcher.consume_token(token):
            self._raise_if_failed()
            raise ConstraintError(f"token {token} does not fit the constraint")

    @property
    def done(self) -> bool:
        """The grammar is complete: only an end-of-generation id may follow."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    def reset(self) -> None:
        """Back to the start of the reply (as if no token had been produced)."""
        self._matcher.reset()

    def _raise_if_failed(self) -> None:
        if self._matcher.is_error():
            raise ConstraintError(" ".join(self._matcher.get_error().split()))


def unpack(words: torch.Tensor, n: int) -> torch.Tensor:
    """A bitmask of int32 words (token i is bit i % 32 of word i // 32, the layout both
    llguidance and xgrammar write) as a bool row of n tokens."""
    return torch.from_numpy(np.unpackbits(words.numpy().view(np.uint8), count=n,
                                          bitorder="little").view(bool))


def masked(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """A float32 copy of `logits` with every token not `allowed` at -inf, tokens past the
    vocabulary (an output head's padding) included.

    In numpy, one thread: torch splits a row this long over its threads, and on a busy
    machine the caller then spins at the join for milliseconds (`evals/
    bench_constraint.py` saw 12 ms for a 65k row). Few tokens allowed (JSON's structure)
    copies just those."""
    row = logits.detach().to(torch.float32).numpy()
    ok = allowed.numpy()[:row.size]
    n = ok.size
    picked = np.flatnonzero(ok)
    if 8 * picked.size < n:
        out = np.full(row.shape, _NEG, dtype=np.float32)
        out[picked] = row[picked]
    else:
        out = np.concatenate([np.where(ok, row[:n], _NEG), np.full(row.size - n, _NEG,
                                                                    dtype=np.float32)])
    return torch.from_numpy(out)
