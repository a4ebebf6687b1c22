"""`POST /tokenize` and `POST /detokenize` over the served model's vocabulary, in the
shapes llama-server and vLLM give them, so that either's clients work:

- tokenize: llama-server's `{"content", "add_special" (default false), "with_pieces"}`,
  or vLLM's `{"prompt", "add_special_tokens" (default true)}` or `{"messages",
  "add_generation_prompt" (default true)}` (a chat rendered by the model's template, as
  /v1/chat/completions would prompt it, tools included); answered with the ids
  (`tokens`), their `count` and the context (`max_model_len`), and each id's text with
  `with_pieces` (its bytes as a list where they are not whole UTF-8).
- detokenize: `{"tokens"}` -> the text, as `content` (llama-server) and `prompt` (vLLM).

Control-token spellings in `content` or `prompt` are those tokens, as both servers do:
this endpoint only counts, nothing runs.
"""

from __future__ import annotations

from collections.abc import Mapping

from .limits import GatewayLimits
from .openai_api import bad, parse_request
from .request_building import ModelView, build_requests, check_model


def tokenize(body: Mapping, view: ModelView, limits: GatewayLimits, tenant: str = ""
             ) -> dict:
    if not isinstance(body, Mapping):
        raise bad("the body must be a JSON object")
    if isinstance(body.get("model"), str):
        check_model(body["model"], view.model)
    tokenizer = view.tokenizer
    if "messages" in body:
        chat = {"model": view.model, "messages": body["messages"], "max_tokens": 1,
                **{k: body[k] for k in ("tools", "tool_choice") if k in body}}
        if body.get("add_generation_prompt", True) is not True:
            raise bad("add_generation_prompt: only true is supported (the prompt a chat "
                      "request would send)", "add_generation_prompt")
        ids = build_requests(parse_request(chat, chat=True), view, limits,
                             tenant).requests[0].tokens
    else:
        key = "content" if "content" in body else "prompt"
        text = body.get(key)
        if not isinstance(text, str):
            raise bad("give the text as content (or prompt), or a chat as messages", key)
        special = body.get("add_special" if key == "content" else "add_special_tokens",
                           key == "prompt")
        if not isinstance(special, bool):
            raise bad("add_special must be a boolean", "add_special")
        ids = tokenizer.encode(text, add_special=special)
    out: dict = {"tokens": list(ids), "count": len(ids), "max_model_len": view.n_ctx}
    if body.get("with_pieces"):
        out["tokens"] = [{"id": t, "piece": _piece(tokenizer.piece(t, special=True))}
                         for t in ids]
    return out


def detokenize(body: Mapping, view: ModelView) -> dict:
    if not isinstance(body, Mapping):
        raise bad("the body must be a JSON object")
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                            for t in ids):
        raise bad("tokens must be an array of token ids", "tokens")
    vocab = view.tokenizer.vocab_size
    outside = [t for t in ids if not 0 <= t < vocab]
    if outside:
        raise bad(f"token id {outside[0]} is outside the vocabulary (0..{vocab - 1})",
                  "tokens")
    text = view.tokenizer.decode(ids, special=True)
    return {"content": text, "prompt": text}


def _piece(raw: bytes) -> str | list[int]:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)
