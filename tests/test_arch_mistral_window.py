"""Mistral with a sliding window on every layer (prompts longer than the window) against
transformers, through the reference attention and the engine."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import arch_oracle  # noqa: E402

WINDOW = 16  # 8 would let window page reuse keep all four requests in the pool


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return arch_oracle.make_case(tmp_path_factory.mktemp("mistral"), "mistral",
                                 sliding_window=WINDOW)


class TestMistralWindow(arch_oracle.ArchSuite):
    def test_every_layer_has_the_window(self, case):
        config = case.load("transformers5").config
        assert config.layer_windows == (WINDOW,) * config.num_layers
        assert max(map(len, case.batch)) > 2 * WINDOW, "prompts must outgrow the window"
