"""Tokenizer: text <-> token ids and chat prompts, as Hugging Face transformers would produce them.

Wraps a `tokenizers.Tokenizer` (from tokenizer.json or rebuilt from GGUF metadata) together with the
special ids the engine needs (BOS, every EOS) and the model's chat template, rendered with sandboxed
jinja2 exactly as transformers' `apply_chat_template` does. It must not touch model weights, and
knows nothing of requests or streaming.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as Backend

from jaxserve.model.text import gguf_tokenizer


class ChatTemplateError(ValueError):
    """The chat template refused the conversation (its `raise_exception`) or failed to render."""


class _GenerationTag(Extension):
    """transformers' `{% generation %}` block marks assistant text for training masks; rendering
    only needs its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _token_content(value) -> str | None:
    """tokenizer_config.json spells a special token as a string or as an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


class Tokenizer:
    """A model's tokenizer: encode/decode, special ids and the chat template."""

    def __init__(self, backend: Backend, *, bos_token_id: int | None,
                 eos_token_ids: tuple[int, ...], chat_template: str | None = None,
                 pad_token_id: int | None = None):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self.pad_token_id = pad_token_id
        self.chat_template = chat_template
        self._template_cache: tuple[str, jinja2.Template] | None = None

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | Path, *, bos_token_id: int | None = None,
                  eos_token_ids: tuple[int, ...] = (), chat_template: str | None = None,
                  pad_token_id: int | None = None) -> "Tokenizer":
        """A bare tokenizer.json; special ids and template come from the caller."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        return cls(Backend.from_file(str(path)), bos_token_id=bos_token_id,
                   eos_token_ids=eos_token_ids, chat_template=chat_template,
                   pad_token_id=pad_token_id)

    @classmethod
    def from_gguf(cls, source) -> "Tokenizer":
        """From a `gguf.GGUFReader` or its metadata as a dict of python values."""
        if isinstance(source, dict):
            metadata = source
        else:
            metadata = {k: f.contents() for k, f in source.fields.items()
                        if k.startswith("tokenizer.")}
        eos = [metadata[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                     "tokenizer.ggml.eom_token_id") if k in metadata]
        return cls(gguf_tokenizer.build_backend(metadata),
                   bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
                   eos_token_ids=tuple(eos),
                   chat_template=metadata.get("tokenizer.chat_template"),
                   pad_token_id=metadata.get("tokenizer.ggml.padding_token_id"))

    @classmethod
    def load(cls, directory: str | Path) -> "Tokenizer":
        """A Hugging Face tokenizer directory: tokenizer.json plus, when present,
        tokenizer_config.json, chat_template.jinja and generation_config.json."""
        directory = Path(directory)
        tokenizer = cls.from_file(directory / "tokenizer.json")
        cfg_path = directory / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        token_id = lambda key: (None if _token_content(cfg.get(key)) is None
                                else tokenizer.token_to_id(_token_content(cfg[key])))
        tokenizer.bos_token_id = token_id("bos_token")
        tokenizer.pad_token_id = token_id("pad_token")
        eos = list(cfg.get("eos_token_ids") or [])
        if token_id("eos_token") is not None:
            eos.append(token_id("eos_token"))
        gen_path = directory / "generation_config.json"
        if gen_path.exists():
            gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
            if gen_eos is not None:
                eos.extend(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        tokenizer.eos_token_ids = tuple(dict.fromkeys(eos))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            template = {t["name"]: t["template"] for t in template}.get("default")
        jinja_path = directory / "chat_template.jinja"
        tokenizer.chat_template = jinja_path.read_text() if jinja_path.exists() else template
        return tokenizer

    def save(self, directory: str | Path) -> None:
        """tokenizer.json and a tokenizer_config.json that both `load` and transformers read."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(directory / "tokenizer.json"))
        token = lambda i: None if i is None else self.backend.id_to_token(i)
        cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": token(self.bos_token_id),
            "eos_token": token(self.eos_token_ids[0]) if self.eos_token_ids else None,
            "pad_token": token(self.pad_token_id),
            "add_bos_token": self.add_bos_token,
            "clean_up_tokenization_spaces": False,
            "eos_token_ids": list(self.eos_token_ids),
            "chat_template": self.chat_template,
        }
        (directory / "tokenizer_config.json").write_text(
            json.dumps(cfg, indent=2, ensure_ascii=False))

    # ---- properties ----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def add_bos_token(self) -> bool:
        """Whether encoding with special tokens prepends BOS (the tokenizer's own post-processor
        decides, as in transformers)."""
        ids = self.backend.encode("", add_special_tokens=True).ids
        return self.bos_token_id is not None and ids[:1] == [self.bos_token_id]

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    # ---- text <-> ids --------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; BOS is prepended only when the model wants it."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # ---- chat ----------------------------------------------------------------------------------
    def _compiled_template(self) -> jinja2.Template:
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; send a plain prompt instead")
        if self._template_cache is None or self._template_cache[0] != self.chat_template:
            self._template_cache = (self.chat_template, _compile_template(self.chat_template))
        return self._template_cache[1]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs: Any) -> str:
        """The prompt text for a conversation (encode it with add_special_tokens=False: the
        template writes any BOS itself, as transformers does). tools: the function tools as
        JSON schema dicts ({"type": "function", "function": {...}}), given to the template as
        `tools` (None when there are none, as transformers gives it); kwargs: more template
        variables (a request's chat_template_kwargs)."""
        token = lambda i: "" if i is None else self.backend.id_to_token(i)
        context = dict(bos_token=token(self.bos_token_id),
                       eos_token=token(self.eos_token_ids[0] if self.eos_token_ids else None),
                       pad_token=token(self.pad_token_id), documents=None)
        context.update(kwargs)
        try:
            return self._compiled_template().render(messages=messages, tools=tools,
                                                  add_generation_prompt=add_generation_prompt,
                                                  **context)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as e:
            # the template's own expression failed on this conversation (e.g. `+` on a None)
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
