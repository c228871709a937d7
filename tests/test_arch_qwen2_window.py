"""Qwen2 with use_sliding_window: full attention below max_window_layers, a window above it
(layers that differ, so the decoder unrolls even when asked to scan), against transformers."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import arch_oracle  # noqa: E402

WINDOW = 8


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return arch_oracle.make_case(tmp_path_factory.mktemp("qwen2"), "qwen2",
                                 use_sliding_window=True, sliding_window=WINDOW,
                                 max_window_layers=1)


class TestQwen2Window(arch_oracle.ArchSuite):
    def test_layers_above_max_window_layers_have_the_window(self, case):
        from jaxserve.model.decoder.decoder import Llama

        loaded = case.load("transformers5")
        assert loaded.config.layer_windows == (None, WINDOW)
        assert Llama(loaded.config, loaded.params, layer_loop="scan").layer_loop == "unroll"
