"""Tokenizers: text <-> token ids, chat prompts, streaming detokenization."""
