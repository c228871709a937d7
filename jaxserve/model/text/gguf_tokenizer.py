"""Build a `tokenizers.Tokenizer` from the tokenizer a GGUF file describes in its metadata.

A GGUF carries no tokenizer.json: it stores llama.cpp's vocabulary (`tokenizer.ggml.*`) and we
rebuild the pipeline the model was trained with. Byte-level BPE ("gpt2") takes its split rule from
`tokenizer.ggml.pre`, matching llama.cpp and the model's original tokenizer.json (SmolLM2's
"smollm" splits digits one by one, which transformers' GGUF reader does not do; Qwen 2/3 write
"qwen2"); a name it does not implement is an error, never a silent fallback. SentencePiece
vocabularies ("llama") become a byte-fallback BPE, as transformers' LlamaTokenizer builds them.
This module only builds the backend; it must not read files or know about chat templates.
"""

from __future__ import annotations

import logging

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from jaxserve.model.text.byte_level import bytes_to_unicode

log = logging.getLogger(__name__)

TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 2, 3, 4

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# llama.cpp's pre-tokenizer names, grouped by the split rule they use (llama-vocab.cpp).
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_LLAMA3 = {"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"}
_QWEN2 = {"qwen2", "deepseek-r1-qwen", "megrez"}
_GPT2 = {"gpt2"}
KNOWN_PRE_TOKENIZERS = frozenset(_DIGITS_THEN_GPT2 | _LLAMA3 | _QWEN2 | _GPT2)


def build_backend(metadata: dict) -> Backend:
    """The tokenizer described by `tokenizer.ggml.*` keys (python values, as GGUFReader gives)."""
    kind = metadata.get("tokenizer.ggml.model")
    if "tokenizer.ggml.tokens" not in metadata:
        raise ValueError("GGUF has no tokenizer (no tokenizer.ggml.tokens)")
    if kind == "gpt2":
        backend = _byte_level(metadata)
    elif kind == "llama":
        backend = _sentencepiece(metadata)
    else:
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r}; supported: gpt2, llama")
    _add_special_tokens(backend, metadata, byte_level=kind == "gpt2")
    _set_post_processor(backend, metadata)
    return backend


def wants_bos(metadata: dict) -> bool:
    """llama.cpp adds BOS to SentencePiece vocabularies unless the file says otherwise."""
    default = metadata.get("tokenizer.ggml.model") == "llama"
    return bool(metadata.get("tokenizer.ggml.add_bos_token", default))


def _merges(metadata: dict) -> list[tuple[str, str]]:
    return [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]


def _byte_level(metadata: dict) -> Backend:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for index, token in enumerate(metadata["tokenizer.ggml.tokens"]):
        if not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    pre = _pre_tokenizer(metadata)
    backend = Backend(models.BPE(vocab, _merges(metadata), fuse_unk=False, byte_fallback=False,
                                 ignore_merges=pre in _LLAMA3))
    if pre in _DIGITS_THEN_GPT2:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    elif pre in _LLAMA3 or pre in _QWEN2:
        split = _LLAMA3_SPLIT if pre in _LLAMA3 else _QWEN2_SPLIT
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        if pre in _QWEN2:
            backend.normalizer = normalizers.NFC()
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    return backend


def _pre_tokenizer(metadata: dict) -> str:
    """The byte-level split rule's name: one we implement, or an error naming it. A file that
    names none ("default", or no key: llama.cpp's converter found no match for the tokenizer)
    gets GPT-2's rule, with a warning, since nothing says what the model was trained with."""
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre == "default":
        log.warning("GGUF tokenizer.ggml.pre is %r: splitting text with GPT-2's rule, which may "
                    "not be the rule this model was trained with (its tokens can differ from "
                    "the original tokenizer's)", metadata.get("tokenizer.ggml.pre"))
        return "gpt2"
    if pre not in KNOWN_PRE_TOKENIZERS:
        raise ValueError(f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre={pre!r}: jaxserve "
                         f"cannot split text the way this model was trained (supported: "
                         f"{', '.join(sorted(KNOWN_PRE_TOKENIZERS))}); load the Hugging Face "
                         f"directory, whose tokenizer.json carries the rule")
    return pre


def _sentencepiece(metadata: dict) -> Backend:
    tokens = metadata["tokenizer.ggml.tokens"]
    vocab = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    if "tokenizer.ggml.merges" in metadata:
        merges = _merges(metadata)
    else:
        merges = _merges_from_scores(vocab, dict(zip(tokens, metadata["tokenizer.ggml.scores"])))
    types = metadata.get("tokenizer.ggml.token_type") or ()
    unk = next((t for t, k in zip(tokens, types) if k == TOKEN_TYPE_UNKNOWN), None)
    backend = Backend(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    add_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_prefix else "never", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """SentencePiece files list no merges: every split of a token into two vocabulary pieces is a
    merge, ranked by the merged token's score (as transformers' `generate_merges`)."""
    ranked = []
    for token, score in scores.items():
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        ranked.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in ranked]


def _add_special_tokens(backend: Backend, metadata: dict, byte_level: bool) -> None:
    """Control tokens (<|im_end|>) match whole and are special; user-defined ones match whole but
    stay ordinary text. A byte-level control token spelled outside the byte alphabet is a llama.cpp
    mislabel, and is left alone (as transformers does)."""
    tokens = metadata["tokenizer.ggml.tokens"]
    types = metadata.get("tokenizer.ggml.token_type") or ()
    alphabet = set(bytes_to_unicode().values())
    control = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types)
               if k == TOKEN_TYPE_CONTROL and (not byte_level or set(t) <= alphabet)]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types)
            if k == TOKEN_TYPE_USER_DEFINED]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)


def _set_post_processor(backend: Backend, metadata: dict) -> None:
    tokens = metadata["tokenizer.ggml.tokens"]
    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    eos_id = metadata.get("tokenizer.ggml.eos_token_id")
    add_bos = wants_bos(metadata) and bos_id is not None
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None
    if not (add_bos or add_eos):
        return
    head = [tokens[bos_id]] if add_bos else []
    tail = [tokens[eos_id]] if add_eos else []
    single = head + ["$A"] + tail
    pair = single + [f"{t}:1" for t in head] + ["$B:1"] + [f"{t}:1" for t in tail]
    special_ids = ([bos_id] if add_bos else []) + ([eos_id] if add_eos else [])
    special = [(tokens[i], i) for i in special_ids]
    backend.post_processor = processors.TemplateProcessing(
        single=" ".join(single), pair=" ".join(pair), special_tokens=special)
