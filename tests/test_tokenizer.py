"""Tokenizer: GGUF-built tokenizers encode, decode and render chat prompts like transformers."""

from __future__ import annotations

import json

import pytest

from jaxserve.model.text.tokenizer import ChatTemplateError, Tokenizer
from model_fixtures import default_gguf_path, real_default_model, tiny_tokenizer, tiny_vocab

TEXTS = [
    "Hello world", "  leading spaces", "trailing spaces   ", "héllo 😀 日本語 Ελληνικά العربية",
    "def f(x):\n    return x**2\n", "<|im_start|>user\nhi<|im_end|>", "tabs\tand\r\nCRLF", "", " ",
    "a  b   c", "It's we'll they're I'M", "x = 2024 and 1,234.56 and 3.14159", "v1.2.3-rc4",
    "émoji 👩‍👩‍👧‍👦 flags 🇫🇷 zwj", "<reponame>foo<filename>bar.py", "```python\nprint('hi')\n```",
    "The quick brown fox jumps over the lazy dog. " * 4, "ｆｕｌｌ width ＡＢＣ", "\u0000 nul \u200b zw",
    "naïve café résumé", "<|im_end|><|im_end|>", "<|im_start", "line\n\n\nbreaks\n", "🙂" * 5,
]
# transformers' GGUF reader ignores `tokenizer.ggml.pre = "smollm"` (digits split one by one
# before the GPT-2 rule, as llama.cpp and SmolLM2's own tokenizer.json do), so it groups a run
# of whitespace in front of a digit differently. These are the model's true tokenizations:
# "ĠĠ" (256) and "ĊĊ" (1116) stay whole, digits come alone.
SMOLLM_DIGIT_CASES = {"  12": [256, 33, 34], "\n\n3": [1116, 35],
                      "Step 1:\n\n2. next": [3512, 216, 33, 42, 1116, 34, 30, 1867]}
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3? 😀"}],
]


@pytest.fixture(scope="module")
def smollm():
    return real_default_model().tokenizer


@pytest.fixture(scope="module")
def hf_smollm():
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    path = default_gguf_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


# ---- the real SmolLM2 tokenizer against transformers --------------------------------------------

@pytest.mark.slow
def test_smollm2_encodes_like_transformers(smollm, hf_smollm):
    for text in TEXTS:
        assert smollm.encode(text) == hf_smollm.encode(text), f"encode({text!r})"


@pytest.mark.slow
def test_smollm2_splits_digits_like_llama_cpp(smollm, hf_smollm):
    for text, ids in SMOLLM_DIGIT_CASES.items():
        assert smollm.encode(text) == ids, f"encode({text!r})"
        assert smollm.decode(ids) == text


@pytest.mark.slow
def test_smollm2_decodes_like_transformers(smollm, hf_smollm):
    for text in TEXTS:
        ids = smollm.encode(text)
        for skip in (True, False):
            assert smollm.decode(ids, skip_special_tokens=skip) == \
                hf_smollm.decode(ids, skip_special_tokens=skip), f"decode({text!r}, skip={skip})"
    assert smollm.decode(smollm.encode("<|im_start|>user\nhi<|im_end|>")) == "user\nhi"


@pytest.mark.slow
def test_smollm2_chat_template_renders_like_transformers(smollm, hf_smollm):
    for messages in CONVERSATIONS:
        for gen in (True, False):
            ours = smollm.apply_chat_template(messages, add_generation_prompt=gen)
            theirs = hf_smollm.apply_chat_template(messages, tokenize=False,
                                                   add_generation_prompt=gen)
            assert ours == theirs
    prompt = smollm.apply_chat_template(CONVERSATIONS[0])
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>assistant\n")
    assert smollm.encode(prompt, add_special_tokens=False)[0] == 1  # <|im_start|> kept whole


@pytest.mark.slow
def test_smollm2_special_ids(smollm):
    assert smollm.bos_token_id == 1 and smollm.id_to_token(1) == "<|im_start|>"
    assert smollm.eos_token_ids == (2,) and smollm.id_to_token(2) == "<|im_end|>"
    assert smollm.vocab_size == 49152
    assert not smollm.add_bos_token
    assert smollm.encode("Hello") == smollm.encode("Hello", add_special_tokens=False)


@pytest.mark.slow
def test_smollm2_save_load_round_trip(smollm, tmp_path):
    smollm.save(tmp_path)
    again = Tokenizer.load(tmp_path)
    for text in TEXTS + list(SMOLLM_DIGIT_CASES):
        assert again.encode(text) == smollm.encode(text), text
    assert again.apply_chat_template(CONVERSATIONS[1]) == \
        smollm.apply_chat_template(CONVERSATIONS[1])
    assert (again.bos_token_id, again.eos_token_ids) == (smollm.bos_token_id, smollm.eos_token_ids)


@pytest.mark.slow
def test_saved_tokenizer_reads_back_in_transformers(smollm, tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    smollm.save(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS + list(SMOLLM_DIGIT_CASES):
        assert hf.encode(text) == smollm.encode(text), text
    assert hf.apply_chat_template(CONVERSATIONS[1], tokenize=False, add_generation_prompt=True) \
        == smollm.apply_chat_template(CONVERSATIONS[1])


# ---- tiny vocabularies ---------------------------------------------------------------------------

def test_bos_is_added_only_when_the_model_wants_it():
    the = tiny_tokenizer().token_to_id("Ġthe")
    assert tiny_tokenizer().encode(" the") == [the]
    wants = Tokenizer.from_gguf(dict(tiny_vocab(), **{"tokenizer.ggml.add_bos_token": True}))
    assert wants.add_bos_token
    assert wants.encode(" the") == [1, the]
    assert wants.encode(" the", add_special_tokens=False) == [the]


def test_special_tokens_match_whole_and_can_be_skipped_when_decoding():
    tok = tiny_tokenizer()
    ids = tok.encode("<|im_start|> the<|im_end|>")
    assert ids == [1, tok.token_to_id("Ġthe"), 2]
    assert tok.decode(ids) == " the"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|> the<|im_end|>"


def test_every_byte_round_trips():
    tok = tiny_tokenizer()
    text = "ünïcödé ✓ 🚀 \t\n\x7f"
    assert tok.decode(tok.encode(text)) == text


def test_chat_template_raise_exception_surfaces_as_chat_template_error():
    tok = tiny_tokenizer()
    tok.chat_template = ("{% if messages[0]['role'] != 'user' %}"
                         "{{ raise_exception('first message must be from the user') }}{% endif %}")
    with pytest.raises(ChatTemplateError, match="first message must be from the user"):
        tok.apply_chat_template([{"role": "assistant", "content": "hi"}])


def test_chat_template_has_hf_helpers_and_extra_variables():
    tok = tiny_tokenizer()
    tok.chat_template = ("{{ bos_token }}{{ messages | tojson }}"
                         "{% generation %}!{% endgeneration %}"
                         "{% for t in tools %}{% if loop.index > 1 %}{% break %}{% endif %}"
                         "{{ t.name }}{% endfor %}")
    out = tok.apply_chat_template([{"role": "user", "content": "é"}],
                                  tools=[{"name": "a"}, {"name": "b"}])
    assert out == '<|im_start|>[{"role": "user", "content": "é"}]!a'


def test_chat_template_is_sandboxed():
    tok = tiny_tokenizer()
    tok.chat_template = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_chat_template_is_a_clear_error():
    tok = tiny_tokenizer()
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_load_reads_hf_tokenizer_config_and_generation_config(tmp_path):
    tiny_tokenizer().backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>",
        "chat_template": [{"name": "default", "template": "{{ 'x' }}"}]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.load(tmp_path)
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2, 0)
    assert tok.apply_chat_template([]) == "x"
    (tmp_path / "chat_template.jinja").write_text("{{ 'y' }}")
    assert Tokenizer.load(tmp_path).apply_chat_template([]) == "y"


def test_missing_tokenizer_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.load(tmp_path)


def test_sentencepiece_gguf_vocab_tokenizes_like_transformers(tmp_path):
    """Llama-2 / TinyLlama / Mistral GGUFs carry a SentencePiece vocabulary with scores and no
    merges; the rebuilt byte-fallback BPE must agree with transformers' reading of the same file."""
    pytest.importorskip("transformers")
    import gguf
    from transformers import AutoTokenizer

    pieces = ["▁", "e", "h", "l", "o", "t", "w", "r", "d", "▁t", "he", "▁the", "ll", "▁he",
              "llo", "▁hello", "▁w", "or", "▁wor", "ld", "▁world", "▁▁", "▁▁▁▁"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(pieces))]
    writer = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = Tokenizer.from_gguf(gguf.GGUFReader(tmp_path / "spm.gguf"))
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    for text in ["hello world", " hello  world", "the  hello\nworld", "héllo 😀", "    the", "x"]:
        assert ours.encode(text) == theirs.encode(text), text
        ids = ours.encode(text)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    assert ours.add_bos_token and ours.encode("the")[0] == 1
