"""Module-scoped fixtures the structured-output tests share: the default model's tokenizer and
a GrammarCompiler over it (closed when the module is done). Import them into a test module to
use them."""

from __future__ import annotations

import pytest
from model_fixtures import real_default_model

from jaxserve.structured.compiler import GrammarCompiler


@pytest.fixture(scope="module")
def tokenizer():
    return real_default_model().tokenizer


@pytest.fixture(scope="module")
def compiler(tokenizer):
    c = GrammarCompiler(tokenizer)
    yield c
    c.close()
