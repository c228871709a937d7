"""A tiny "reasoning model" for tests: model_fixtures' byte-level BPE vocabulary plus <think> and
</think> as added (non-special) tokens, as reasoning models' tokenizers have them, so each tag
is one token that decodes into the text; a random Llama over it; and two chat templates of our
own in ChatML: OPENS_THINK opens the think section in the generation prompt (DeepSeek R1 and
Qwen3 Thinking style) and QWEN3 leaves it to the reply (Qwen3 hybrid style). Both close an empty
section instead when chat_template_kwargs say enable_thinking=false."""

from __future__ import annotations

from model_fixtures import random_model, tiny_vocab
from tiny_models import TinyLoaded

from jaxserve.model.text.tokenizer import Tokenizer

TOKEN_TYPE_USER_DEFINED = 4  # GGUF: an added token that matches whole and stays text
_MESSAGES = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
             "message['content'] + '<|im_end|>\\n' }}{% endfor %}")
_THINKING_OFF = "enable_thinking is defined and not enable_thinking"
OPENS_THINK = (_MESSAGES + "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
               "{% if " + _THINKING_OFF + " %}{{ '<think>\\n\\n</think>\\n\\n' }}"
               "{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}")
QWEN3 = (_MESSAGES + "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
         "{% if " + _THINKING_OFF + " %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
         "{% endif %}")


def think_vocab(chat_template: str = OPENS_THINK) -> dict:
    vocab = tiny_vocab()
    vocab["tokenizer.ggml.tokens"] = vocab["tokenizer.ggml.tokens"] + ["<think>", "</think>"]
    vocab["tokenizer.ggml.token_type"] = (vocab["tokenizer.ggml.token_type"]
                                          + [TOKEN_TYPE_USER_DEFINED] * 2)
    vocab["tokenizer.chat_template"] = chat_template
    return vocab


def think_tokenizer(chat_template: str = OPENS_THINK) -> Tokenizer:
    return Tokenizer.from_gguf(think_vocab(chat_template))


def think_ids(tokenizer) -> tuple[int, int]:
    """The token ids of <think> and </think>."""
    start = tokenizer.encode("<think>", add_special_tokens=False)
    end = tokenizer.encode("</think>", add_special_tokens=False)
    assert len(start) == len(end) == 1, (start, end)
    return start[0], end[0]


def think_loaded(seed: int = 0) -> TinyLoaded:
    """A random tiny Llama over the think vocabulary; its own template is OPENS_THINK."""
    tokenizer = think_tokenizer()
    config, params = random_model(seed=seed, vocab_size=tokenizer.vocab_size)
    return TinyLoaded(config, params, tokenizer=tokenizer)
