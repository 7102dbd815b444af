"""Writes sample_sft.jsonl: the small alpaca-format dataset `prepack pack --sample` packs;
and sample_chat.jsonl, a small chat-format set ({"messages": [...]}, 2 to 6 turns) that the
README's mixture walkthrough mixes with it (sample_mix.yaml, sample_remix.yaml); and
sample_preference.jsonl, preference pairs in TRL's {prompt, chosen, rejected} schema for the
README's DPO walkthrough (`--format preference`): the chosen reply right and on topic, the
rejected one wrong (an arithmetic slip, the wrong factor) or off topic.

Written by the project (no third-party text), deterministic, with the length
spread of real SFT sets: many short answers, a long tail, and a few examples
too long for 512 tokens so the drop accounting shows up.

    python prepack/sample_data/generate.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).with_name("sample_sft.jsonl")
CHAT_OUT = Path(__file__).with_name("sample_chat.jsonl")
PREFERENCE_OUT = Path(__file__).with_name("sample_preference.jsonl")
HELD_OUT = Path(__file__).with_name("sample_held_out.jsonl")
TOOLCALL_OUT = Path(__file__).with_name("sample_toolcall.jsonl")
FUNCTIONGEMMA_OUT = Path(__file__).with_name("sample_functiongemma.jsonl")
DIALOG_OUT = Path(__file__).with_name("sample_dialog.jsonl")
RANKING_OUT = Path(__file__).with_name("sample_ranking.jsonl")

UNITS = [("kilometres", "miles", 0.621371), ("kilograms", "pounds", 2.20462), ("litres", "US gallons", 0.264172),
         ("metres", "feet", 3.28084), ("Celsius degrees of difference", "Fahrenheit degrees of difference", 1.8)]
TOPICS = {
    "binary search": "Binary search finds an item in a sorted list by comparing it with the middle element and "
                     "discarding the half that cannot contain it, so each step halves the search space.",
    "a hash table": "A hash table stores key and value pairs in an array of buckets; a hash function turns each "
                    "key into a bucket index, which makes lookups take constant time on average.",
    "photosynthesis": "Photosynthesis is the process by which plants use light energy to turn water and carbon "
                      "dioxide into glucose and oxygen, inside organelles called chloroplasts.",
    "compound interest": "Compound interest is interest computed on the initial amount plus the interest already "
                         "earned, so the balance grows faster over time than with simple interest.",
    "a compiler": "A compiler translates a program written in a high-level language into machine code or another "
                  "lower-level form, checking the program for errors along the way.",
    "gradient descent": "Gradient descent minimises a function by repeatedly moving its parameters a small step "
                        "against the gradient, the direction in which the function increases fastest.",
    "sequence packing": "Sequence packing places several short training examples into one fixed-length row, with "
                        "attention and positions kept separate per example, so fewer tokens are spent on padding.",
    "the water cycle": "The water cycle moves water between the oceans, the air and the land through "
                       "evaporation, condensation, precipitation and runoff.",
}
ADVICE = [
    "Start with the simplest version that works, and measure before you optimise.",
    "Write the test that would have caught the bug before you fix it.",
    "Keep a short written log of what you tried and what you observed.",
    "Break the task into steps that each produce something you can check.",
    "Ask what the reader needs to know first, and put that at the top.",
    "Prefer names that say what a thing is over names that say how it was made.",
    "When two options look equal, pick the one that is easier to undo.",
    "Set a time limit for exploration, then decide with what you have learned.",
]
CONNECTIVES = ["First,", "Next,", "Then,", "After that,", "In addition,", "Finally,"]


def short_arithmetic(rng: random.Random) -> dict:
    a, b = rng.randint(2, 999), rng.randint(2, 999)
    op, result = rng.choice([("plus", a + b), ("minus", a - b), ("times", a * b)])
    return {"instruction": f"What is {a} {op} {b}?", "input": "", "output": f"{a} {op} {b} is {result}."}


def conversion(rng: random.Random) -> dict:
    src, dst, factor = rng.choice(UNITS)
    value = rng.randint(1, 500)
    return {"instruction": f"Convert {value} {src} to {dst}.", "input": "",
            "output": f"{value} {src} is about {value * factor:.2f} {dst}, using a factor of {factor}."}


def explain(rng: random.Random) -> dict:
    topic, text = rng.choice(sorted(TOPICS.items()))
    extra = " ".join(rng.sample(ADVICE, rng.randint(0, 3)))
    return {"instruction": f"Explain {topic} in a few sentences.", "input": "",
            "output": f"{text} {extra}".strip()}


def rewrite(rng: random.Random) -> dict:
    sentence = " ".join(rng.sample(ADVICE, rng.randint(2, 4)))
    return {"instruction": "Rewrite the following advice as a numbered list.", "input": sentence,
            "output": "\n".join(f"{i}. {s}" for i, s in enumerate(sentence.split(". "), start=1))}


def plan(rng: random.Random, paragraphs: int) -> dict:
    topic = rng.choice(sorted(TOPICS))
    body = []
    for p in range(paragraphs):
        steps = [f"{c} {rng.choice(ADVICE).lower()}" for c in rng.sample(CONNECTIVES, 4)]
        body.append(f"Part {p + 1}. " + TOPICS[topic] + " " + " ".join(steps))
    return {"instruction": f"Write a study plan for learning about {topic}.",
            "input": f"The plan should have {paragraphs} parts.", "output": "\n\n".join(body)}


FOLLOW_UPS = [
    ("Can you say that in one sentence?", lambda text, rng: text.split(". ")[0].rstrip(".") + "."),
    ("Give me one piece of advice for learning it.", lambda text, rng: rng.choice(ADVICE)),
    ("What should I read about next?", lambda text, rng: f"Next, read about {rng.choice(sorted(TOPICS))}: "
                                                          f"it builds on the same ideas."),
]


def conversation(rng: random.Random) -> dict:
    """A user asks about a topic, then 0 to 2 follow-ups; the assistant answers each turn."""
    topic, text = rng.choice(sorted(TOPICS.items()))
    answer_text = " ".join([text, *rng.sample(ADVICE, rng.randint(0, 2))])
    messages = [{"role": "user", "content": f"What is {topic}?"}, {"role": "assistant", "content": answer_text}]
    for question, answer in rng.sample(FOLLOW_UPS, rng.randint(0, 2)):
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer(text, rng)}]
    return {"messages": messages}


def write_chat() -> None:
    rng = random.Random(20261201)  # its own stream: sample_sft.jsonl's bytes do not change
    records = [conversation(rng) for _ in range(200)]
    with CHAT_OUT.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"wrote {len(records)} records to {CHAT_OUT}")


def preference_pair(rng: random.Random) -> dict:
    """One pair whose two replies differ in what a reader would care about."""
    kind = rng.random()
    if kind < 0.4:
        a, b = rng.randint(2, 999), rng.randint(2, 999)
        op, result = rng.choice([("plus", a + b), ("minus", a - b), ("times", a * b)])
        slip = result + rng.choice([-10, -1, 1, 10])
        return {"prompt": f"What is {a} {op} {b}?", "chosen": f"{a} {op} {b} is {result}.",
                "rejected": f"{a} {op} {b} is {slip}."}
    if kind < 0.7:
        (src, dst, factor), (_, _, wrong) = rng.sample(UNITS, 2)
        value = rng.randint(1, 500)
        return {"prompt": f"Convert {value} {src} to {dst}.",
                "chosen": f"{value} {src} is about {value * factor:.2f} {dst}, using a factor of {factor}.",
                "rejected": f"{value} {src} is about {value * wrong:.2f} {dst}."}
    (topic, text), (_, other) = rng.sample(sorted(TOPICS.items()), 2)
    messages = [{"role": "user", "content": f"Explain {topic} in a few sentences."}]
    if rng.random() < 0.3:
        messages.insert(0, {"role": "system", "content": "Answer briefly and stay on the question."})
    extra = " ".join(rng.sample(ADVICE, rng.randint(0, 2)))
    return {"prompt": messages, "chosen": [{"role": "assistant", "content": f"{text} {extra}".strip()}],
            "rejected": [{"role": "assistant", "content": other}]}


def write_preference() -> None:
    rng = random.Random(20261205)  # its own stream: the other samples' bytes do not change
    records = [preference_pair(rng) for _ in range(200)]
    with PREFERENCE_OUT.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"wrote {len(records)} records to {PREFERENCE_OUT}")


def write_jsonl(path: Path, records: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"wrote {len(records)} records to {path}")


def write_held_out(training: list[dict]) -> None:
    """Alpaca records sample_sft.jsonl does not hold (no instruction and input in common): the README's
    generate walkthrough scores a model trained on sample_sft.jsonl on these."""
    rng = random.Random(20261206)  # its own stream: the other samples' bytes do not change
    seen = {(r["instruction"], r["input"]) for r in training}
    records: list[dict] = []
    while len(records) < 12:
        record = short_arithmetic(rng) if rng.random() < 0.5 else conversion(rng)
        if (record["instruction"], record["input"]) not in seen:
            seen.add((record["instruction"], record["input"]))
            records.append(record)
    write_jsonl(HELD_OUT, records)


CITIES = ["Lisbon", "Bergen", "Osaka", "Quito", "Accra", "Perth", "Tallinn", "Cusco"]
CURRENCIES = ["EUR", "USD", "JPY", "GBP", "NOK"]
WEATHER_TOOL = {"name": "get_weather", "description": "Current weather in a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CURRENCY_TOOL = {"name": "convert_currency", "description": "Convert an amount between two currencies.",
                 "parameters": {"type": "object", "properties": {"amount": {"type": "number"},
                                                                 "source": {"type": "string"},
                                                                 "target": {"type": "string"}},
                                "required": ["amount", "source", "target"]}}


def tool_request(rng: random.Random) -> tuple[str, dict | None]:
    """A user request and the call that serves it (None: no tool serves it, the reply is text)."""
    kind = rng.random()
    if kind < 0.45:
        city = rng.choice(CITIES)
        return f"What's the weather in {city}?", {"name": "get_weather", "arguments": {"city": city}}
    if kind < 0.85:
        amount, (source, target) = rng.randint(5, 900), rng.sample(CURRENCIES, 2)
        return (f"How much is {amount} {source} in {target}?",
                {"name": "convert_currency", "arguments": {"amount": amount, "source": source, "target": target}})
    return rng.choice([("Tell me a short joke.", None), ("What is a hash table?", None)])


def toolcall_sharegpt(rng: random.Random) -> dict:
    """glaive-function-calling's ShareGPT layout: function_call and observation turns, tools a JSON string."""
    request, call = tool_request(rng)
    turns = [{"from": "human", "value": request}]
    if call is None:
        turns.append({"from": "gpt", "value": "I can only look up the weather and convert currencies."})
    else:
        result = ({"city": call["arguments"].get("city"), "sky": rng.choice(["rain", "sun", "cloud"]),
                   "celsius": rng.randint(-5, 35)} if call["name"] == "get_weather"
                  else {"amount": round(call["arguments"]["amount"] * rng.uniform(0.5, 2.0), 2)})
        turns += [{"from": "function_call", "value": json.dumps(call)},
                  {"from": "observation", "value": json.dumps(result)},
                  {"from": "gpt", "value": f"Here is what I found: {json.dumps(result)}."}]
    return {"conversations": turns, "tools": json.dumps([WEATHER_TOOL, CURRENCY_TOOL])}


def toolcall_functiongemma(rng: random.Random) -> dict:
    """FunctionGemma's layout: {tools, messages}, a developer message, replies that are only tool_calls."""
    request, call = tool_request(rng)
    reply = ({"role": "assistant", "content": "I can only look up the weather and convert currencies."}
             if call is None else {"role": "assistant", "tool_calls": [{"type": "function", "function": call}]})
    return {"tools": [{"type": "function", "function": tool} for tool in (WEATHER_TOOL, CURRENCY_TOOL)],
            "messages": [{"role": "developer",
                          "content": "You are a model that can do function calling with the following functions"},
                         {"role": "user", "content": request}, reply]}


def dialog(rng: random.Random) -> dict:
    """sample_chat.jsonl's conversations under other names: {dialog: [{speaker, text}]}, speakers person and bot."""
    messages = conversation(rng)["messages"]
    return {"dialog": [{"speaker": "person" if m["role"] == "user" else "bot", "text": m["content"]}
                       for m in messages]}


def ranking(rng: random.Random) -> dict:
    """LLaMA-Factory's DPO demo layout: {conversations, chosen: {from, value}, rejected: {from, value}}."""
    pair = preference_pair(rng)
    prompt = pair["prompt"] if isinstance(pair["prompt"], str) else pair["prompt"][-1]["content"]
    reply = [(side if isinstance(side, str) else side[0]["content"]) for side in (pair["chosen"], pair["rejected"])]
    return {"conversations": [{"from": "human", "value": prompt}],
            "chosen": {"from": "gpt", "value": reply[0]}, "rejected": {"from": "gpt", "value": reply[1]}}


def write_formats() -> None:
    """One small file per layout the README's "Your data as published" block packs."""
    rng = random.Random(20261207)  # its own stream: the other samples' bytes do not change
    write_jsonl(TOOLCALL_OUT, [toolcall_sharegpt(rng) for _ in range(40)])
    write_jsonl(FUNCTIONGEMMA_OUT, [toolcall_functiongemma(rng) for _ in range(40)])
    write_jsonl(DIALOG_OUT, [dialog(rng) for _ in range(40)])
    write_jsonl(RANKING_OUT, [ranking(rng) for _ in range(40)])


def main() -> None:
    rng = random.Random(20261130)
    records = []
    for i in range(400):
        kind = rng.random()
        if kind < 0.25:
            records.append(short_arithmetic(rng))
        elif kind < 0.45:
            records.append(conversion(rng))
        elif kind < 0.70:
            records.append(explain(rng))
        elif kind < 0.85:
            records.append(rewrite(rng))
        else:
            # The long tail: 1 to 12 parts, a few of which pass 512 tokens.
            records.append(plan(rng, rng.choice([1, 1, 2, 2, 3, 4, 6, 12])))
    with OUT.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"wrote {len(records)} records to {OUT}")
    write_chat()
    write_preference()
    write_held_out(records)
    write_formats()


if __name__ == "__main__":
    main()
