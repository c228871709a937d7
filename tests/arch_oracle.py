"""transformers as the oracle for one architecture: a tiny random checkpoint written by
transformers' own classes, loaded by jaxserve's HF loader, and compared on last-position logits
(one ragged prefill step over a batch of prompts) and on greedy tokens through the engine (paging,
chunked prefill with a 16-token budget, forced preemption).

Each tests/test_arch_<name>.py holds only its config; everything here is offline (float32 torch
on CPU, eager attention so sliding windows are masked as transformers masks them).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
# Prompt lengths: all but one longer than the sliding windows the tests use (8-16); one (3)
# fits in a page.
PROMPT_LENGTHS = (30, 3, 19, 41, 26)
NUM_GREEDY = 20
# The engine under test: 16-token budget (prefill in chunks), 4-token pages, and a pool of 16
# usable pages: just the longest request (41 + 20 tokens), so requests are preempted and
# recomputed, even for models whose windows let the scheduler give back pages behind them.
# No prefix cache: a preempted request really recomputes its KV.
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, token_buckets=(16,), seq_buckets=(4,),
              max_model_len=96, page_size=4, num_pages=17, enable_prefix_caching=False)


def prompts(seed: int = 0, vocab: int = 256) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in PROMPT_LENGTHS]


def hf_checkpoint(directory: Path, model_type: str, seed: int = 0, **config_kw):
    """Write a random transformers model of `model_type` to `directory`; return it (eval).

    Every weight is redrawn (norms around their initial 1, or 0 for (1 + w) norms) with enough
    spread that logits are far from ties and greedy decoding does not settle on one token."""
    import torch
    import transformers

    from model_fixtures import tiny_tokenizer

    config = transformers.AutoConfig.for_model(model_type, **{**TINY, **config_kw})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(directory)
    tiny_tokenizer().save(directory)
    return model


def as_transformers4_layout(directory: Path, target: Path) -> Path:
    """A copy of a transformers 5 checkpoint whose config.json has the transformers 4 layout:
    top-level rope_theta / rope_scaling (Gemma 3: rope_local_base_freq for its local layers)
    and partial_rotary_factor, no rope_parameters, no layer_types."""
    shutil.copytree(directory, target)
    d = json.loads((target / "config.json").read_text())
    rope = d.pop("rope_parameters")
    if "full_attention" in rope:
        d["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        rope = rope["full_attention"]
    rope = dict(rope)
    d["rope_theta"] = rope.pop("rope_theta")
    if "partial_rotary_factor" in rope:
        d["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    d["rope_scaling"] = None if rope.get("rope_type") == "default" else rope
    # Before layer_types, the window's layers followed from a rule (every layer, layers from
    # max_window_layers on, Gemma 3's sliding_window_pattern): let the reader derive them.
    d.pop("layer_types", None)
    d.pop("_sliding_window_pattern", None)
    (target / "config.json").write_text(json.dumps(d, indent=2))
    return target


def hf_last_logits(model, batch: list[list[int]]) -> np.ndarray:
    """[len(batch), V] float32: each prompt run alone (no padding)."""
    import torch

    with torch.no_grad():
        return np.stack([model(torch.tensor([p])).logits[0, -1].numpy() for p in batch])


def hf_greedy(model, prompt: list[int], num_tokens: int = NUM_GREEDY) -> list[int]:
    import torch

    model.generation_config.eos_token_id = None  # run the full length, as ignore_eos does
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=num_tokens,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def last_logits(loaded, batch: list[list[int]], *, layer_loop: str = "unroll",
                attention_impl: str = "reference", page_size: int = 4,
                dtype: str = "float32", lora=None, lora_slots=None) -> np.ndarray:
    """[len(batch), V]: one ragged prefill step over every prompt of `batch` (pages shuffled).
    lora: a model/decoder/lora.py LoRAStacks, with prompt i's rows in slot lora_slots[i]."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxserve.model.decoder.attention import AttentionShape, get_attention
    from jaxserve.model.decoder.decoder import Llama, init_kv_cache
    from jaxserve.model.decoder.lora import Adapters
    from jaxserve.model.decoder.step_inputs import AttentionMetadata, ModelInputs

    config = loaded.config
    pages_per_seq = -(-max(map(len, batch)) // page_size)
    num_pages = 1 + pages_per_seq * len(batch)
    order = np.random.default_rng(1).permutation(np.arange(1, num_pages))
    table = order.reshape(len(batch), pages_per_seq).astype(np.int32)
    tokens, positions, slots, cu = [], [], [], [0]
    for s, p in enumerate(batch):
        pos = np.arange(len(p))
        tokens += p
        positions += pos.tolist()
        slots += (table[s, pos // page_size] * page_size + pos % page_size).tolist()
        cu.append(cu[-1] + len(p))
    num_rows = -(-cu[-1] // 16) * 16
    pad = lambda a: jnp.asarray(np.pad(np.asarray(a, np.int32), (0, num_rows - len(a))))
    inputs = ModelInputs(pad(tokens), pad(positions), pad(slots),
                         jnp.asarray(np.asarray(cu[1:]) - 1, jnp.int32))
    adapters = None if lora is None else Adapters(
        lora, pad(np.repeat(lora_slots, [len(p) for p in batch])))
    metadata = AttentionMetadata(jnp.asarray(cu, jnp.int32),
                                 jnp.asarray([len(p) for p in batch], jnp.int32),
                                 jnp.asarray(table), jnp.int32(len(batch)), jnp.int32(0))
    attention = get_attention(attention_impl, AttentionShape(
        group=config.num_heads // config.num_kv_heads, num_kv_heads=config.num_kv_heads,
        page_size=page_size, sliding_windows=config.sliding_windows))
    graphdef, state = nnx.split(Llama(config, loaded.params, getattr(jnp, dtype),
                                      layer_loop=layer_loop))

    @jax.jit
    def forward(state, inputs, metadata, kv, adapters):
        return nnx.merge(graphdef, state)(inputs, metadata, kv, attention, adapters=adapters)[0]

    kv = init_kv_cache(config, num_pages, page_size, getattr(jnp, dtype))
    return np.asarray(forward(state, inputs, metadata, kv, adapters))


def engine_greedy(loaded, batch: list[list[int]], **settings):
    """(token ids per prompt, number of preemptions) through the engine, all prompts at once."""
    from jaxserve import SamplingParams
    from jaxserve.entrypoints.llm import LLM

    llm = LLM(loaded=loaded, progress=False, **{**ENGINE, **settings})
    params = SamplingParams(max_tokens=NUM_GREEDY, temperature=0.0, ignore_eos=True)
    outs = llm.generate(batch, params, use_tqdm=False)
    return [o.token_ids for o in outs], llm.engine.scheduler.num_preemptions


def engine_greedy_in_subprocess(directory: Path, batch, *, tensor_parallel_size: int,
                                **settings) -> tuple[list[list[int]], int]:
    """engine_greedy on `tensor_parallel_size` fake CPU devices (XLA_FLAGS must be set before
    jax starts, hence a fresh interpreter)."""
    import os
    import subprocess
    import sys

    script = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
              "import conftest, arch_oracle\n"
              "from jaxserve.model.loaders.loader import load_model\n"
              f"loaded = load_model({str(directory)!r}, progress=False)\n"
              f"print(json.dumps(arch_oracle.engine_greedy(loaded, {batch!r}, "
              f"tensor_parallel_size={tensor_parallel_size}, **{settings!r})))\n")
    flags = f"--xla_force_host_platform_device_count={tensor_parallel_size}"
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=600, cwd=Path(__file__).parent.parent)
    assert proc.returncode == 0, f"tensor-parallel engine failed:\n{proc.stderr[-4000:]}"
    tokens, num_preemptions = json.loads(proc.stdout.strip().splitlines()[-1])
    return tokens, num_preemptions


def assert_logits_close(got: np.ndarray, want: np.ndarray, atol: float = 1e-4) -> None:
    err = np.abs(got - want).max(axis=-1)
    assert err.max() <= atol, (f"max |logits - transformers| per prompt {np.round(err, 7)} "
                               f"(prompt lengths {PROMPT_LENGTHS}) exceeds {atol}")


def assert_greedy_equal(got: list[list[int]], want: list[list[int]], num_preemptions: int):
    assert num_preemptions > 0, "the page pool was meant to force preemption"
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert not bad, "greedy tokens differ from transformers' for prompts " + ", ".join(
        f"{i} (length {PROMPT_LENGTHS[i]}): got {got[i]}, want {want[i]}" for i in bad)


@dataclasses.dataclass
class Case:
    """One tiny checkpoint in both config layouts, with transformers' answers."""

    directories: dict   # layout ("transformers5" | "transformers4") -> checkpoint directory
    batch: list
    want_logits: np.ndarray
    want_greedy: list
    loaded: dict = dataclasses.field(default_factory=dict)

    def load(self, layout: str):
        from jaxserve.model.loaders.loader import load_model
        if layout not in self.loaded:
            self.loaded[layout] = load_model(str(self.directories[layout]), progress=False)
        return self.loaded[layout]


def make_case(directory: Path, model_type: str, *, seed: int = 0, layouts=None,
              **config_kw) -> Case:
    model = hf_checkpoint(directory / "transformers5", model_type, seed=seed, **config_kw)
    directories = {"transformers5": directory / "transformers5"}
    if "transformers4" in (layouts or LAYOUTS):
        directories["transformers4"] = as_transformers4_layout(
            directory / "transformers5", directory / "transformers4")
    batch = prompts(seed)
    return Case(directories, batch, hf_last_logits(model, batch),
                [hf_greedy(model, p) for p in batch])


LAYOUTS = ("transformers5", "transformers4")


class ArchSuite:
    """The checks every architecture passes; a test file subclasses it (as Test<Name>) with a
    module-scoped `case` fixture returning make_case(...)."""

    engine_settings: dict = {}  # EngineConfig overrides of ENGINE

    def test_both_config_layouts_read_the_same_config(self, case):
        configs = [dataclasses.replace(case.load(layout).config, name="m")
                   for layout in case.directories]
        assert all(c == configs[0] for c in configs), f"layouts disagree: {configs}"

    @pytest.mark.parametrize("layer_loop", ["unroll", "scan"])
    @pytest.mark.parametrize("layout", LAYOUTS)
    def test_last_position_logits_match_transformers(self, case, layout, layer_loop):
        if layout not in case.directories:
            pytest.skip(f"{layout} layout does not exist for this architecture")
        got = last_logits(case.load(layout), case.batch, layer_loop=layer_loop)
        assert_logits_close(got, case.want_logits)

    def test_last_position_logits_through_the_pallas_kernels_match_transformers(self, case):
        """The ragged and decode kernels in interpret mode (windows and soft-caps included)."""
        got = last_logits(case.load("transformers5"), case.batch,
                          attention_impl="pallas-interpret")
        assert_logits_close(got, case.want_logits)

    def test_bfloat16_runs_the_same_decoder_within_bfloat16_error(self, case):
        """The TPU/GPU default dtype: the same code path with every weight, activation and KV
        page in bfloat16 (tiny models' logits here reach about 5; bf16 keeps ~3 digits)."""
        got = last_logits(case.load("transformers5"), case.batch, dtype="bfloat16")
        assert_logits_close(got, case.want_logits, atol=0.25)

    def test_saved_hf_directory_reads_back_in_jaxserve_and_transformers(self, case, tmp_path):
        import torch
        import transformers

        from jaxserve.model.loaders.loader import load_model
        from jaxserve.model.loaders.safetensors_loader import save_hf_directory

        loaded = case.load("transformers5")
        save_hf_directory(tmp_path, loaded.config, loaded.params, loaded.tokenizer)
        again = load_model(str(tmp_path), progress=False)
        assert dataclasses.replace(again.config, name="m") == dataclasses.replace(
            loaded.config, name="m")
        assert all(np.array_equal(again.params[k], v) for k, v in loaded.params.items())
        model = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
        assert_logits_close(hf_last_logits(model, case.batch), case.want_logits, atol=1e-5)

    @pytest.mark.parametrize("layout", LAYOUTS)
    def test_greedy_tokens_through_the_engine_match_transformers(self, case, layout):
        if layout not in case.directories:
            pytest.skip(f"{layout} layout does not exist for this architecture")
        got, num_preemptions = engine_greedy(case.load(layout), case.batch,
                                             **self.engine_settings)
        assert_greedy_equal(got, case.want_greedy, num_preemptions)
