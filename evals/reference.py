"""llama.cpp as the independent numeric reference: logits at every position of a prompt.

The KV cache is kept in f32 (llama.cpp's default is f16) so that the reference rounds
only where its kernels do, not in storage; flash attention is off for the same reason.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import numpy as np


@contextlib.contextmanager
def _quiet_stderr():
    """llama.cpp logs model loading straight to fd 2; keep test and eval output readable."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


class LlamaCppReference:
    def __init__(self, path: str | Path, n_ctx: int = 1024, threads: int = 2):
        import llama_cpp

        with _quiet_stderr():
            self.llm = llama_cpp.Llama(
                model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                logits_all=True, verbose=False, n_threads=threads,
                type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32,
                flash_attn=False)

    def logits(self, ids: list[int]) -> np.ndarray:
        """[len(ids), vocab] float32 logits, one row per position."""
        self.llm.reset()
        self.llm.eval(list(ids))
        return np.array(self.llm.scores[: len(ids)], dtype=np.float32)

    def greedy_logits(self, ids: list[int], steps: int) -> np.ndarray:
        """The last prompt row's logits, then those after each of `steps` greedy decode
        steps: [steps + 1, vocab] float32."""
        self.llm.reset()
        self.llm.eval(list(ids))
        rows = [np.array(self.llm.scores[self.llm.n_tokens - 1], dtype=np.float32)]
        for _ in range(steps):
            self.llm.eval([int(rows[-1].argmax())])
            rows.append(np.array(self.llm.scores[self.llm.n_tokens - 1], dtype=np.float32))
        return np.stack(rows)

    def greedy(self, ids: list[int], max_tokens: int, stop_ids: set[int] = frozenset()) -> list[int]:
        """llama.cpp's own greedy continuation (argmax after every step)."""
        self.llm.reset()
        self.llm.eval(list(ids))
        out: list[int] = []
        for _ in range(max_tokens):
            token = int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))
            if token in stop_ids:
                break
            out.append(token)
            self.llm.eval([token])
        return out
