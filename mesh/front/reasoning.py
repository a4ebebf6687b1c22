"""A thinking model's reply split into its reasoning and its answer.

Models that think inside tags (Qwen3, DeepSeek-R1 distills, ...) write
`<think>reasoning</think>answer`; their chat template says so by writing the tags itself.
Some templates open the block in the prompt (`...assistant\\n<think>\\n`): the reply then
starts inside it. The reasoning comes back apart from the answer (chat's
`reasoning_content`, a Responses reasoning item, a Messages thinking block), as
llama-server and vLLM give it; tool calls are read from the answer only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .tool_calls import ReplyDeltas, ToolCallFormat, whole_reply

OPEN, CLOSE = "<think>", "</think>"


def thinks(template_text: str | None) -> bool:
    """Whether a chat template's model thinks in tags (the template writes them)."""
    return template_text is not None and OPEN in template_text and CLOSE in template_text


def opened_in(prompt_text: str) -> bool:
    """Whether a prompt ends inside a think block (its reply starts as reasoning)."""
    return prompt_text.rstrip().endswith(OPEN)


class ThinkSplit:
    """Reply text in, ("reasoning" | "content", text) pieces out, as it streams. A tag
    split across pieces is held back until it is whole; whitespace around the block is
    dropped, as the template writes it."""

    def __init__(self, opened: bool):
        self.state = "in" if opened else "start"
        self._held = ""

    def push(self, text: str) -> list[tuple[str, str]]:
        self._held += text
        out: list[tuple[str, str]] = []
        while self._held:
            if self.state == "start":
                body = self._held.lstrip()
                if OPEN.startswith(body):  # maybe a tag still coming (or only whitespace)
                    return out
                if body.startswith(OPEN):
                    self.state, self._held = "in", body[len(OPEN):].lstrip("\n")
                else:
                    self.state = "content"
            elif self.state == "in":
                at = self._held.find(CLOSE)
                if at >= 0:
                    out.append(("reasoning", self._held[:at].rstrip("\n")))
                    self.state, self._held = "after", self._held[at + len(CLOSE):]
                    continue
                # held: what could begin the tag, and newlines the tag would drop
                body = self._held[:len(self._held) - _partial(self._held, CLOSE)]
                body = body.rstrip("\n")
                out.append(("reasoning", body))
                self._held = self._held[len(body):]
                return [piece for piece in out if piece[1]]
            elif self.state == "after":
                body = self._held.lstrip()
                if not body:
                    return [piece for piece in out if piece[1]]
                self.state, self._held = "content", body
            else:
                out.append(("content", self._held))
                self._held = ""
        return [piece for piece in out if piece[1]]

    def finish(self) -> list[tuple[str, str]]:
        """The text held back once the reply ended (an unclosed block is reasoning)."""
        held, self._held = self._held, ""
        if not held.strip() and self.state in ("start", "after"):
            return []
        kind = "reasoning" if self.state == "in" else "content"
        return [(kind, held)]


def split(text: str, opened: bool) -> tuple[str, str]:
    """A whole reply as (reasoning, content)."""
    splitter = ThinkSplit(opened)
    parts = splitter.push(text) + splitter.finish()
    return ("".join(t for k, t in parts if k == "reasoning"),
            "".join(t for k, t in parts if k == "content"))


def _partial(text: str, tag: str) -> int:
    """How much of the end of `text` could begin `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


@dataclass(frozen=True)
class ReplyFormat:
    """How a request's reply is read: tool calls in `tools` (None: not read), reasoning
    apart where `think` is not None (whether the reply starts inside the block)."""

    tools: ToolCallFormat | None = None
    think: bool | None = None

    def whole(self, text: str, reason: str) -> tuple[str, str | None, str, list[dict]]:
        """A whole reply as (reasoning, content, finish reason, tool calls)."""
        reasoning, text = split(text, self.think) if self.think is not None else ("", text)
        content, reason, calls = whole_reply(self.tools, text, reason)
        return reasoning, content, reason, calls

    def parts(self) -> ReplyParts:
        return ReplyParts(self)


class Part(NamedTuple):
    """One piece of a streamed reply: reasoning text, answer text, or a tool-call delta;
    with the log-probabilities of the tokens it came from (None unless asked for)."""
    reasoning: str | None = None
    content: str | None = None
    call: dict | None = None
    logprobs: list | None = None


class ReplyParts:
    """A streamed reply's text pieces in, its Parts out (see ReplyFormat)."""

    def __init__(self, fmt: ReplyFormat):
        self.split = ThinkSplit(fmt.think) if fmt.think is not None else None
        self.calls = ReplyDeltas(fmt.tools)

    def push(self, text: str, logprobs: list | None) -> list[Part]:
        if self.split is None:
            return self._answer(self.calls.push(text, logprobs))
        return self._pieces(self.split.push(text), logprobs)

    def finish(self) -> list[Part]:
        out = self._pieces(self.split.finish(), None) if self.split is not None else []
        return out + self._answer(self.calls.finish())

    def finish_reason(self, reason: str) -> str:
        return self.calls.finish_reason(reason)

    def _pieces(self, pieces: list[tuple[str, str]], logprobs: list | None) -> list[Part]:
        out: list[Part] = []
        for kind, text in pieces:
            if kind == "reasoning":
                out.append(Part(reasoning=text, logprobs=logprobs))
            else:
                out += self._answer(self.calls.push(text, logprobs))
            logprobs = None if logprobs is None else []  # reported once
        if logprobs and not pieces:  # held back: they ride with the next piece
            out.append(Part(content="", logprobs=logprobs))
        return out

    @staticmethod
    def _answer(deltas: list[tuple]) -> list[Part]:
        return [Part(content=c, call=call, logprobs=lp) for c, call, lp in deltas]
