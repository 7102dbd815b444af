"""Small Hugging Face tokenizer folders built offline (a BPE trained here, saved with
`save_pretrained`), for the `hf` chat format, `hf:PATH` tokenizers and tool-calling templates."""
from __future__ import annotations

from typing import Any

from prepack.text import gemma3_hf_folder

CORPUS = [
    "Hello world, how are you today?", "The capital of France is Paris.", "user assistant system model",
    "Translate the following text from English to French.", "Bonjour le monde", "2 + 2 = 4",
] * 20

FUNCTIONGEMMA_LAYOUT_TEMPLATE = gemma3_hf_folder.FUNCTIONGEMMA_LAYOUT
FUNCTION_TOKENS = list(gemma3_hf_folder.FUNCTION_TOKENS)
GEMMA_TOKENS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]


def build_hf_dir(path: Any, specials: list[str], chat_template: str | None, corpus: list[str] | None = None,
                 **special_kwargs: Any) -> str:
    """A byte-level BPE of 500 ids trained on `corpus`, with `specials` as added tokens, saved to `path`."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(corpus or CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, **special_kwargs)
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(path))
    return str(path)


def functiongemma_layout_dir(path: Any) -> str:
    """A Gemma-style tokenizer folder with FunctionGemma's function tokens and a chat template in
    FunctionGemma's layout (prepack/text/chat/templates/functiongemma_layout.jinja)."""
    return build_hf_dir(path, GEMMA_TOKENS + FUNCTION_TOKENS, FUNCTIONGEMMA_LAYOUT_TEMPLATE.read_text(),
                        bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                        additional_special_tokens=["<start_of_turn>", "<end_of_turn>", *FUNCTION_TOKENS])
