"""What a constrained request carries: the shape its reply must take, as a value.

A `Constraint` travels in the request's sampling settings (mesh/sampler.py SamplingParams,
on the wire as `Sampling.constraint`); the last stage turns it into a per-request token
mask (mesh/token_mask.py) that the sampler applies to the logits before it picks a token.
It is frozen and hashable, so it is part of the exact-results keys (mesh/front/
result_memo.py) as every other sampling setting is: a constrained greedy request repeated
is answered from the tokens already known, and never from an unconstrained run's.

The grammar engine is llguidance (`evals/bench_constraint.py` measures it against
xgrammar). Kinds and their text:

    json_object   ""                     any JSON object
    json_schema   the schema, as JSON    one JSON value the schema accepts
    lark          llguidance's Lark      any context-free grammar (https://github.com/
                                         guidance-ai/llguidance/blob/main/docs/syntax.md)

How to build one (the gateway and the tool-call code):

    from skippy.mesh.constraint import json_object, json_schema, lark, tool_call, check
    c = json_schema({"type": "object", "properties": {...}, "required": [...]})
    c = json_object()
    c = lark('start: "yes" | "no"')
    # a tool call in the Qwen/Hermes format: <tool_call>\\n{"name": .., "arguments": {..}}
    # \\n</tool_call>, to one of these functions, arguments matching their schemas:
    c = tool_call([{"name": "get_weather", "parameters": {...}}, ...])
    # tool_choice "auto": free text, or text and then such calls (the grammar starts
    # at "<tool_call>"):
    c = tool_call_or_text([...], open_text="<tool_call>")
    check(c)   # ConstraintError (a RequestError, one line) for a bad schema or grammar
    sampling = SamplingParams(temperature=0, constraint=c)

In Lark, `%json { ...schema... }` embeds a JSON schema as a rule, `"text"` is a literal
(`lark_literal` quotes one) and `<[id]>` is one token by id (`lark_token`): a marker that
the vocabulary has as a special token (Qwen's own `<tool_call>`) must be written as its
token, since llguidance never spells a special token with ordinary text. `tool_call`
takes its `open` and `close` markers as Lark fragments for that reason.

Once the grammar is complete (it accepts nothing but the end), the mask allows only the
model's end-of-generation tokens, so the request stops there with finish_reason "stop".
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from skippy.topology.errors import RequestError, one_line

KINDS = ("json_object", "json_schema", "lark")

# How the JSON kinds are compiled: no free whitespace between tokens (a small model given
# the choice pads with newlines until max_tokens), OpenAI's separators.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintError(RequestError):
    """A schema or grammar that cannot be compiled: the request's; the message is one
    line (the caller that knows which field it came from names the param)."""


@dataclass(frozen=True)
class Constraint:
    kind: str   # one of KINDS
    text: str   # its canonical text (see the module docstring)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConstraintError(f"unknown constraint kind {self.kind!r} "
                                  f"(one of {', '.join(KINDS)})")

    def grammar(self) -> str:
        """The llguidance grammar (its JSON form) that this constraint compiles to."""
        import llguidance
        if self.kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(self.text)
        schema = {"type": "object"} if self.kind == "json_object" else self.text
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema,
                                                                 overrides=JSON_OPTIONS)
        except ValueError as e:
            raise ConstraintError(one_line(e)) from None


def json_object() -> Constraint:
    return Constraint("json_object", "")


def json_schema(schema: Mapping | bool) -> Constraint:
    """The reply is one JSON value that `schema` accepts. Property order is kept (it is the
    order the model writes them in), so the canonical text is compact, not sorted."""
    if not isinstance(schema, (Mapping, bool)):
        raise ConstraintError("a JSON schema must be an object (or a boolean)")
    return Constraint("json_schema", _compact(schema))


def lark(grammar: str) -> Constraint:
    return Constraint("lark", grammar)


def lark_literal(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def lark_token(token_id: int) -> str:
    """One token, by id, as a Lark fragment."""
    return f"<[{int(token_id)}]>"


def tool_call(functions: Sequence[Mapping], *, open: str = lark_literal("<tool_call>\n"),
              close: str = lark_literal("\n</tool_call>"), parallel: bool = False
              ) -> Constraint:
    """A call to one of `functions` ({"name": str, "parameters": JSON schema (optional)},
    OpenAI's `tools[i].function`): open, then {"name": "<name>", "arguments": {...}} with
    the arguments matching that function's parameters, then close. `parallel`: one or
    more such calls, one per line. open / close are Lark fragments (see the module
    docstring): literal text by default, or a special token of the vocabulary."""
    if not functions:
        raise ConstraintError("a tool call needs at least one function")
    rules = _function_rules(functions)
    calls = 'call ("\\n" call)*' if parallel else "call"
    alternatives = " | ".join(f"fn{i}" for i in range(len(functions)))
    return lark("\n".join([f"start: {calls}", f"call: {open} ({alternatives}) {close}",
                           *rules]) + "\n")


def tool_call_or_text(functions: Sequence[Mapping], *, open_text: str = "<tool_call>",
                      close: str = lark_literal("\n</tool_call>"), parallel: bool = False
                      ) -> Constraint:
    """Free text, or free text and then calls as `tool_call` writes them (tool_choice
    "auto"): the grammar starts once the model writes `open_text` (plain text, not a
    special token), so a call to a function not offered, or arguments its schema refuses,
    cannot be written; text alone never holds `open_text`."""
    if not functions:
        raise ConstraintError("a tool call needs at least one function")
    opened = lark_literal(open_text)
    never = _regex_text(open_text)
    calls = f'call ("\\n" {opened} call)*' if parallel else "call"
    rules = _function_rules(functions)
    alternatives = " | ".join(f"fn{i}" for i in range(len(functions)))
    return lark("\n".join([
        f"start: TEXT | lead {calls}",
        f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*{never}(.|\\n)*/",
        f"lead[stop={opened}]: /(.|\\n)*/",
        f'call: "\\n" ({alternatives}) {close}', *rules]) + "\n")


def _regex_text(text: str) -> str:
    """`text` as a regex that matches it literally."""
    return "".join("\\" + c if c in r".^$*+?()[]{}|\/" else c for c in text)


def check(constraint: Constraint) -> None:
    """Compile the constraint without a vocabulary: ConstraintError (one line) when its
    schema or grammar is bad. The gateway calls this so a bad schema is a 400, not a
    stage failure."""
    import llguidance
    error = llguidance.LLMatcher.validate_grammar(constraint.grammar())
    if error:
        raise ConstraintError(one_line(error))


def _function_rules(functions: Sequence[Mapping]) -> list[str]:
    """One Lark rule per function, fn0, fn1, ...: its call's JSON, arguments by schema."""
    rules = []
    for i, f in enumerate(functions):
        params = f.get("parameters")
        schema = {"type": "object",
                  "properties": {"name": {"const": f["name"]},
                                 "arguments": params if params is not None else
                                 {"type": "object"}},
                  "required": ["name", "arguments"], "additionalProperties": False,
                  "x-guidance": JSON_OPTIONS}
        rules.append(f"fn{i}: %json {_compact(schema)}")
    return rules


def _compact(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
