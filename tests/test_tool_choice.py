"""A request's tools, tool_choice and parallel_tool_calls: what is accepted, what each
choice means, and a one-line error naming the field for everything else."""

from __future__ import annotations

import json

import pytest

from skippy.mesh.front.tool_choice import MAX_TOOLS, CheckedSchemas, ToolSpecError, parse_tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
ADD = {"type": "function", "function": {"name": "add"}}


def test_no_tools_is_no_tool_use():
    assert parse_tools({}) is None
    assert parse_tools({"tools": []}) is None
    assert parse_tools({"tools": None, "tool_choice": "none"}) is None
    assert parse_tools({"tool_choice": "auto"}) is None


def test_auto_is_the_default_and_parallel_calls_are_allowed_unless_turned_off():
    use = parse_tools({"tools": [WEATHER, ADD]})
    assert (use.choice, use.function, use.parallel) == ("auto", None, True)
    assert use.parsed and not use.forced
    assert not parse_tools({"tools": [ADD], "parallel_tool_calls": False}).parallel


def test_the_template_gets_the_tools_in_openais_shape():
    use = parse_tools({"tools": [WEATHER, ADD], "tool_choice": "none"})
    assert use.template_tools == [WEATHER, ADD]
    assert not use.parsed and not use.forced
    assert all(isinstance(t, str) for t in use.tools)  # hashable, canonical JSON
    hash(use)


def test_required_and_a_named_function_force_a_call():
    required = parse_tools({"tools": [WEATHER, ADD], "tool_choice": "required"})
    assert required.forced and [f["name"] for f in required.callable_functions()] == [
        "get_weather", "add"]
    named = parse_tools({"tools": [WEATHER, ADD], "tool_choice": {
        "type": "function", "function": {"name": "add"}}})
    assert named.forced and named.callable_functions() == [{"name": "add"}]


@pytest.mark.parametrize("body, param, message", [
    ({"tools": {"a": 1}}, "tools", "must be an array"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools", "calls functions only"),
    ({"tools": [{"type": "function"}]}, "tools", r"tools\[0\]\.function must be an object"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "1 to 64"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools", "1 to 64"),
    ({"tools": [ADD, ADD]}, "tools", "used twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]}, "tools",
     "description must be a string"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools",
     "JSON schema object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "strin"}}}]}, "tools", "not a valid JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools",
     "strict must be a boolean"),
    ({"tools": [ADD] * (MAX_TOOLS + 1)}, "tools", "at most 128"),
    ({"tools": [ADD], "tool_choice": "always"}, "tool_choice", "must be one of"),
    ({"tools": [ADD], "tool_choice": {"type": "allowed_tools"}}, "tool_choice", "must be"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {}}}, "tool_choice",
     "name must be a string"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "sub"}}},
     "tool_choice", "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [ADD], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
    ({"functions": [{"name": "f"}]}, "functions", "deprecated form of tools"),
    ({"tools": [ADD], "function_call": "auto"}, "function_call", "send tool_choice"),
])
def test_bad_tool_fields_are_one_line_errors_naming_the_field(body, param, message):
    with pytest.raises(ToolSpecError, match=message) as e:
        parse_tools(body)
    assert e.value.param == param and "\n" not in str(e.value)


def test_a_deeply_nested_schema_is_an_error_not_a_crash():
    deep: dict = {"type": "object"}
    for _ in range(3000):
        deep = {"type": "object", "properties": {"x": deep}}
    body = json.loads(json.dumps({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}}}]}))
    body["tools"][0]["function"]["parameters"] = deep
    with pytest.raises(ToolSpecError, match="cannot be read"):
        parse_tools(body)


def _described(name: str, chars: int) -> dict:
    """A function whose schema's JSON is about `chars` characters."""
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "description": "x" * chars}}}


def test_a_schema_or_all_tools_past_their_size_cap_is_a_400_before_any_check(monkeypatch):
    """Checking a schema costs with its size, before admission: a large one is refused by
    its length, the checker never run."""
    import jsonschema
    checked = []
    real = jsonschema.validators.validator_for

    def spy(schema, *args, **kwargs):
        if isinstance(schema, dict) and schema.get("type") == "object":  # ours, not a metaschema
            checked.append(schema)
        return real(schema, *args, **kwargs)

    monkeypatch.setattr(jsonschema.validators, "validator_for", spy)
    with pytest.raises(ToolSpecError, match=r"tools\[1\].function.parameters takes at most "
                                            r"65536 characters") as e:
        parse_tools({"tools": [ADD, _described("big", 70_000)]})
    assert e.value.param == "tools" and checked == []
    five = [_described(f"f{i}", 60_000) for i in range(5)]  # each fits; together 300 KB
    with pytest.raises(ToolSpecError, match=r"at most 262144 characters of JSON together"):
        parse_tools({"tools": five})
    assert len(checked) == 0  # the sum is refused before any schema is checked
    assert parse_tools({"tools": five[:4]}) is not None


def test_a_tenant_has_each_schema_checked_once_and_never_by_anothers_check(monkeypatch):
    """An agent sends its tools every turn: the second time, its schemas are known good.
    Another tenant's identical tools are checked again (a faster answer would tell it that
    someone had sent them), as is a schema that failed."""
    import jsonschema
    checked = []
    real = jsonschema.validators.validator_for

    def spy(schema, *args, **kwargs):
        # ours (not the metaschema, nor its parts, which it checks with)
        if isinstance(schema, dict) and schema.get("type") == "object" \
                and "$dynamicRef" not in str(schema):
            checked.append(schema)
        return real(schema, *args, **kwargs)

    monkeypatch.setattr(jsonschema.validators, "validator_for", spy)
    memory = CheckedSchemas(max_entries=3)
    body = {"tools": [WEATHER, _described("note", 100)]}  # two schemas
    first = parse_tools(body, memory.checker("alpha"))
    assert len(checked) == 2
    assert parse_tools(body, memory.checker("alpha")) == first and len(checked) == 2
    parse_tools(body, memory.checker("beta"))
    assert len(checked) == 4
    bad = {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": 3}}}]}
    for _ in range(2):
        with pytest.raises(ToolSpecError, match="not a valid JSON schema"):
            parse_tools(bad, memory.checker("alpha"))
    assert len(checked) == 6
    parse_tools(body, memory.checker("alpha"))  # 3 kept of the 4 checked: alpha's went
    assert len(checked) == 8
