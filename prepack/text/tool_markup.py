"""The markup of each tool-call layout, spelled once: what the chat formats render, what the
tokenizers add as tokens, and what the parsers (prepack/text/chat/tool_calls.py) read back, so a
layout cannot be written one way and read another.

- hermes (Qwen3's template, chat formats `chatml` and `qwen3`, prepack/text/chat/chatml.py): each
  call between `<tool_call>` and `</tool_call>`, each result between `<tool_response>` and
  `</tool_response>`; all four are added tokens of Qwen's vocabulary (prepack/text/qwen3_bpe.py).
- functiongemma (FunctionGemma's published layout, rendered by
  prepack/text/chat/templates/functiongemma_layout.jinja through chat format `hf`): declarations,
  calls and responses between their start/end tokens, string values between `<escape>` tokens;
  the seven control tokens of the Gemma 3 tokenizer folder (prepack/text/gemma3_hf_folder.py).
  The jinja template spells the same tags (tests/test_tool_calls.py checks it against these).

Pairs are (open, close). Pure constants: this module imports nothing.
"""

__all__ = ["HERMES_CALL", "HERMES_RESPONSE", "FUNCTIONGEMMA_DECLARATION", "FUNCTIONGEMMA_CALL",
           "FUNCTIONGEMMA_RESPONSE", "FUNCTIONGEMMA_ESCAPE", "FUNCTIONGEMMA_TOKENS"]

HERMES_CALL = ("<tool_call>", "</tool_call>")
HERMES_RESPONSE = ("<tool_response>", "</tool_response>")

FUNCTIONGEMMA_DECLARATION = ("<start_function_declaration>", "<end_function_declaration>")
FUNCTIONGEMMA_CALL = ("<start_function_call>", "<end_function_call>")
FUNCTIONGEMMA_RESPONSE = ("<start_function_response>", "<end_function_response>")
FUNCTIONGEMMA_ESCAPE = "<escape>"
# FunctionGemma's control tokens in the order the tokenizer folder gives them ids: declarations,
# calls, responses, and the string delimiter.
FUNCTIONGEMMA_TOKENS = (*FUNCTIONGEMMA_DECLARATION, *FUNCTIONGEMMA_CALL, *FUNCTIONGEMMA_RESPONSE, FUNCTIONGEMMA_ESCAPE)
