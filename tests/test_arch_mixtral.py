"""Mixtral (Mistral's attention, a sliding window on every layer, 4 experts top-2) against
transformers."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import moe_oracle  # noqa: E402


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return moe_oracle.make_moe_case(tmp_path_factory.mktemp("mixtral"), "mixtral",
                                    num_local_experts=4, num_experts_per_tok=2,
                                    sliding_window=12)


class TestMixtral(moe_oracle.MoESuite):
    pass
