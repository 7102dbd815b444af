"""Small datasets in the schemas public SFT sets are published in, written here (no dataset's
text is copied): what tests, docs/formats.md and benchmarks pack without a conversion script.

Each entry: the `--format` (and options) that reads it, and its records. Every schema of the
"real datasets" issue is here: ShareGPT with function_call/observation turns and a `tools` JSON
string (glaive, LLaMA-Factory's demos); FunctionGemma's `{tools, messages}` with a `developer`
message and a reply that is only a call; OpenAI messages whose content is a list of parts with a
per-message `loss_weight`; a reasoning-and-tool-use set of content parts; plain `{text}`; TRL's
`{prompt, completion}` as strings and as message lists; and a schema of its own column and role
names, read with --columns/--roles.
"""
from __future__ import annotations

import json
from typing import Any

__all__ = ["SCHEMAS", "Schema", "WEATHER_TOOL", "TIME_TOOL"]

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                   "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# ShareGPT sets write bare schemas, often with the types their generator used.
INVOICE_TOOL = {"name": "generate_invoice", "description": "Make an invoice",
                "parameters": {"type": "OBJECT", "properties": {"customer": {"type": "str"}, "total": {"type": "number"}},
                               "required": ["customer", "total"]}}
PASSWORD_TOOL = {"name": "generate_password", "description": "Make a random password",
                 "parameters": {"type": "dict", "properties": {"length": {"type": "integer"}}}}


class Schema:
    def __init__(self, fmt: str, records: list[dict[str, Any]], options: dict[str, str] | None = None,
                 published_as: str = "") -> None:
        self.format, self.records, self.options, self.published_as = fmt, records, options or {}, published_as

    def args(self) -> list[str]:
        """`prepack pack` options that read it."""
        out = ["--format", self.format]
        for key in ("columns", "roles"):
            if key in self.options:
                out += [f"--{key}", self.options[key]]
        return out


def _call(name: str, arguments: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


SCHEMAS: dict[str, Schema] = {
    "sharegpt_tools": Schema("sharegpt", [
        {"conversations": [
            {"from": "human", "value": "Make an invoice for Ada Lovelace, total 42.5."},
            {"from": "function_call", "value": json.dumps({"name": "generate_invoice",
                                                           "arguments": {"customer": "Ada Lovelace", "total": 42.5}})},
            {"from": "observation", "value": json.dumps({"invoice_id": "INV-7", "status": "created"})},
            {"from": "gpt", "value": "Invoice INV-7 for Ada Lovelace (42.5) is created."}],
         "tools": json.dumps([INVOICE_TOOL, PASSWORD_TOOL])},
        {"conversations": [
            {"from": "human", "value": "I need two passwords, of 8 and 12 characters."},
            {"from": "function_call", "value": json.dumps([{"name": "generate_password", "arguments": {"length": 8}},
                                                           {"name": "generate_password", "arguments": {"length": 12}}])},
            {"from": "observation", "value": "k3J9xq2L"},
            {"from": "observation", "value": "pQ7zR1tV0wYb"},
            {"from": "gpt", "value": "Here they are: k3J9xq2L and pQ7zR1tV0wYb."}],
         "tools": json.dumps([INVOICE_TOOL, PASSWORD_TOOL])},
        {"conversations": [{"from": "human", "value": "Tell me a joke."},
                           {"from": "gpt", "value": "I would, but I can only make invoices and passwords."}],
         "system": "You are a billing assistant.", "tools": "[]"},
    ], published_as="ShareGPT with function_call and observation turns and a `tools` JSON string (glaive-function-calling, "
                    "LLaMA-Factory's glaive_toolcall demos)"),
    "functiongemma": Schema("chat", [
        {"tools": [WEATHER_TOOL, TIME_TOOL], "messages": [
            {"role": "developer", "content": "You are a model that can do function calling with the following functions"},
            {"role": "user", "content": "What's the weather in Lisbon?"},
            {"role": "assistant", "tool_calls": [_call("get_weather", {"city": "Lisbon"})]}]},
        {"tools": [WEATHER_TOOL, TIME_TOOL], "messages": [
            {"role": "developer", "content": "You are a model that can do function calling with the following functions"},
            {"role": "user", "content": "What time is it in Tokyo and in Oslo?"},
            {"role": "assistant", "tool_calls": [_call("get_time", {"city": "Tokyo"}), _call("get_time", {"city": "Oslo"})]}]},
    ], published_as="FunctionGemma's cookbook data: `{tools, messages}` with a developer message and a reply that is only "
                    "tool calls, arguments as objects"),
    "parts_loss_weight": Schema("chat", [
        {"messages": [
            {"role": "system", "content": [{"type": "text", "text": "Answer in one word."}]},
            {"role": "user", "content": [{"type": "text", "text": "Capital of France?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Paris"}], "loss_weight": 0.0},
            {"role": "user", "content": [{"type": "text", "text": "And of Italy?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Rome"}], "loss_weight": 1.0}]},
        {"messages": [
            {"role": "user", "content": [{"type": "text", "text": "Spell "}, {"type": "text", "text": "cat."}]},
            {"role": "assistant", "content": [{"type": "text", "text": "C-A-T"}], "loss_weight": 1}]},
    ], published_as="OpenAI messages whose content is a list of typed parts, with LLaMA-Factory's per-message loss_weight"),
    "reasoning_tools": Schema("chat", [
        {"tools": [WEATHER_TOOL], "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Should I take an umbrella in Bergen?"}]},
            {"role": "assistant", "content": [{"type": "reasoning", "text": "Rain depends on the weather; ask the tool."},
                                              {"type": "tool_call", "value": {"name": "get_weather",
                                                                              "arguments": {"city": "Bergen"}}}]},
            {"role": "tool", "content": [{"type": "text", "text": "rain, 9 C"}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "It rains there."},
                                              {"type": "text", "text": "Yes, it is raining in Bergen."}]}]},
    ], published_as="a reasoning-and-tool-use set of content parts (reasoning/thinking parts, tool_call parts)"),
    "text": Schema("text", [
        {"text": "The quick brown fox jumps over the lazy dog. It was a bright cold day in April."},
        {"text": "Packing puts several documents in one row, each in its own segment."},
    ], published_as="plain `{text}` documents (continued pretraining)"),
    "prompt_completion": Schema("prompt_completion", [
        {"prompt": "The sky is", "completion": "blue."},
        {"prompt": [{"role": "user", "content": "Say hi in French."}],
         "completion": [{"role": "assistant", "content": "Bonjour !"}]},
    ], published_as="TRL's prompt-completion, as strings and as conversational message lists"),
    "preference": Schema("preference", [
        {"prompt": "Name a primary colour.", "chosen": "Red.", "rejected": "Green is a primary colour of paint."},
        {"prompt": [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "2 + 2?"}],
         "chosen": [{"role": "assistant", "content": "4"}], "rejected": [{"role": "assistant", "content": "5"}]},
        {"prompt": [{"role": "user", "content": "Weather in Oslo?"}],
         "chosen": [{"role": "assistant", "tool_calls": [_call("get_weather", {"city": "Oslo"})]}],
         "rejected": [{"role": "assistant", "content": "It is always sunny in Oslo."}], "tools": [WEATHER_TOOL]},
    ], published_as="TRL's preference pairs `{prompt, chosen, rejected}`: strings, message lists, tool calls"),
    "ranking": Schema("preference", [
        {"conversations": [{"from": "human", "value": "Say hello in Spanish."}], "chosen": {"from": "gpt", "value": "Hola."},
         "rejected": {"from": "gpt", "value": "Bonjour."}},
        {"conversations": [{"from": "human", "value": "What is the capital of Japan?"}],
         "chosen": {"from": "gpt", "value": "Tokyo."}, "rejected": {"from": "gpt", "value": "Kyoto, I think."}},
    ], options={"columns": "content=value,prompt=conversations,role=from"},
       published_as="a ranking file `{conversations: [{from, value}], chosen: {from, value}, rejected: {from, value}}` "
                    "(LLaMA-Factory's dpo demos), read with --columns"),
    "own_columns": Schema("chat", [
        {"dialog": [{"speaker": "person", "text": "Name a prime number."}, {"speaker": "bot", "text": "7"}],
         "functions": [], "sys": "Be short."},
    ], options={"columns": "content=text,messages=dialog,role=speaker,system=sys,tools=functions",
                "roles": "assistant=bot,user=person"},
       published_as="a schema of its own names, read with --columns and --roles"),
}
