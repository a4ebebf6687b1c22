"""The two functions the tool-calling tests offer (tests/test_openai_tools.py,
tests/test_agent_clients.py): parameters bounded by enums and ranges, so a call forced
through the grammar on random weights is always short and valid."""

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}
ADD = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                      "b": {"type": "integer", "minimum": 0, "maximum": 999}}}
