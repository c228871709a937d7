"""Measure llguidance and xgrammar on this machine with the default model's tokenizer.

For each library, in its own subprocess (so memory figures are its own): tokenizer-info build
time, compile time of the ten JSON schemas of jaxserve/bench/structured_schemas.py (cold: no
cache), host time to fill one request's bitmask per step and one step's bitmasks for 16
requests, and resident memory after compiling. Each request walks its grammar with random
logits through the mask (argmax of masked logits, like greedy constrained decoding), so the
masks measured are the ones a real decode would need. Measurement only: nothing in jaxserve
imports this script.

    python scripts/grammar_libs.py [--lib llguidance|xgrammar|jaxserve.structured] [--steps N]

JSON whitespace is bounded the same way for both (at most 16 characters per gap), as
jaxserve.structured does: unbounded whitespace lets random logits pad forever.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def load_tokenizer():
    import gguf

    from jaxserve.model.loaders.default_model import default_model_path
    from jaxserve.model.text.tokenizer import Tokenizer
    return Tokenizer.from_gguf(gguf.GGUFReader(default_model_path()))


def bits_of(row: np.ndarray, vocab: int) -> np.ndarray:
    return np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab].astype(bool)


class Llg:
    name = "llguidance"

    def __init__(self, tok):
        import llguidance as llg
        import llguidance.numpy as llnp
        self.llg, self.llnp, self.vocab = llg, llnp, tok.vocab_size
        self.tok = llg.LLTokenizer(tok.backend.to_str(), n_vocab=self.vocab,
                                   eos_token=list(tok.eos_token_ids))
        self.executor = llg.LLExecutor(2)

    def compile(self, schema):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,16}"})
        matcher = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def matcher(self, grammar):
        return self.llg.LLMatcher(self.tok, grammar, log_level=0)

    def alloc(self, n):
        return self.llnp.allocate_token_bitmask(n, self.vocab)

    def fill(self, m, out, i):
        self.llnp.fill_next_token_bitmask(m, out, i)

    def fill_batch(self, ms, out):
        self.llnp.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)],
                                              out)

    def accept(self, m, t):
        assert m.consume_token(t), m.get_error()

    def done(self, m):
        return m.is_stopped()


class Xgr:
    name = "xgrammar"

    def __init__(self, tok):
        import xgrammar as xgr
        self.xgr, self.vocab = xgr, tok.vocab_size
        vocab = [tok.id_to_token(i) for i in range(self.vocab)]
        self.info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=self.vocab,
                                      stop_token_ids=list(tok.eos_token_ids))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=2) if hasattr(
            xgr, "BatchGrammarMatcher") else None

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema), max_whitespace_cnt=16)

    def matcher(self, grammar):
        return self.xgr.GrammarMatcher(grammar)

    def alloc(self, n):
        return self.xgr.allocate_token_bitmask(n, self.vocab)

    def fill(self, m, out, i):
        m.fill_next_token_bitmask(out, i)

    def fill_batch(self, ms, out):
        if self.batch is not None:
            self.batch.batch_fill_next_token_bitmask(ms, out)
        else:
            for i, m in enumerate(ms):
                m.fill_next_token_bitmask(out, i)

    def accept(self, m, t):
        assert m.accept_token(t)

    def done(self, m):
        return m.is_terminated()


class Ours:
    """jaxserve.structured: GrammarCompiler + GrammarMatcher + fill_batch (llguidance inside)."""

    name = "jaxserve.structured"

    def __init__(self, tok):
        from jaxserve.structured import compiler, matcher, params
        self.params, self.matcher_mod = params, matcher
        self.compiler = compiler.GrammarCompiler(tok, cache_size=1)
        self.vocab = tok.vocab_size

    def compile(self, schema):
        return self.compiler.get(self.params.StructuredOutputs(json=schema))

    def matcher(self, grammar):
        return grammar.new_matcher()

    def alloc(self, n):
        return np.zeros((n, self.matcher_mod.bitmask_words(self.vocab)), dtype=np.int32)

    def fill(self, m, out, i):
        m.fill_bitmask(out[i])

    def fill_batch(self, ms, out):
        self.matcher_mod.fill_batch(ms, out[:len(ms)])

    def accept(self, m, t):
        assert m.accept([t])

    def done(self, m):
        return m.is_stopped()


def as_numpy(mask):
    return mask.numpy() if hasattr(mask, "numpy") else mask


def walk(lib, grammars, steps, batch, seed=0):
    """Decode `batch` requests (grammars cycled) for `steps` steps; per-step mask fill times."""
    rng = np.random.default_rng(seed)
    names = list(grammars)
    matchers = [lib.matcher(grammars[names[i % len(names)]]) for i in range(batch)]
    mask = lib.alloc(batch)
    times = []
    for _ in range(steps):
        live = [m for m in matchers if not lib.done(m)]
        if not live:
            break
        t0 = time.perf_counter()
        if batch == 1:
            lib.fill(live[0], mask, 0)
        else:
            lib.fill_batch(live, mask)
        times.append(time.perf_counter() - t0)
        arr = as_numpy(mask)
        for i, m in enumerate(live):
            logits = rng.standard_normal(lib.vocab).astype(np.float32)
            logits[~bits_of(arr[i], lib.vocab)] = -np.inf
            lib.accept(m, int(np.argmax(logits)))
    finished = sum(lib.done(m) for m in matchers)
    return times, finished


def measure(lib_name: str, steps: int) -> dict:
    from jaxserve.bench.structured_schemas import JSON_SCHEMAS
    tok = load_tokenizer()
    rss0 = rss_mib()
    __import__("llguidance" if lib_name == "jaxserve.structured" else lib_name)
    rss_import = rss_mib()
    t0 = time.perf_counter()
    lib = {"llguidance": Llg, "xgrammar": Xgr, "jaxserve.structured": Ours}[lib_name](tok)
    tokenizer_s = time.perf_counter() - t0
    rss_tok = rss_mib()
    compile_ms = {}
    grammars = {}
    for name, schema in JSON_SCHEMAS.items():
        t0 = time.perf_counter()
        grammars[name] = lib.compile(schema)
        compile_ms[name] = (time.perf_counter() - t0) * 1e3
    rss_compiled = rss_mib()
    one_all = []
    for name in grammars:
        t, _ = walk(lib, {name: grammars[name]}, steps, 1)
        one_all += t
    sixteen, finished = walk(lib, grammars, steps, 16)
    pct = lambda xs, q: float(np.percentile(np.array(xs) * 1e3, q))
    return {
        "lib": lib.name, "tokenizer_info_s": round(tokenizer_s, 3),
        "compile_ms": {k: round(v, 2) for k, v in compile_ms.items()},
        "compile_ms_median": round(statistics.median(compile_ms.values()), 2),
        "compile_ms_max": round(max(compile_ms.values()), 2),
        "mask_1req_ms_mean": round(float(np.mean(one_all)) * 1e3, 3),
        "mask_1req_ms_median": round(pct(one_all, 50), 3),
        "mask_1req_ms_p99": round(pct(one_all, 99), 3),
        "mask_16req_ms_mean": round(float(np.mean(sixteen)) * 1e3, 3),
        "mask_16req_ms_median": round(pct(sixteen, 50), 3),
        "mask_16req_ms_p99": round(pct(sixteen, 99), 3),
        "steps_16req": len(sixteen), "finished_of_16": finished,
        "rss_mib_import": round(rss_import - rss0, 1),
        "rss_mib_tokenizer_info": round(rss_tok - rss_import, 1),
        "rss_mib_10_compiles": round(rss_compiled - rss_tok, 1),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", choices=("llguidance", "xgrammar", "jaxserve.structured"))
    ap.add_argument("--steps", type=int, default=400)
    args = ap.parse_args()
    if args.lib:
        print(json.dumps(measure(args.lib, args.steps)))
        return
    for lib in ("llguidance", "xgrammar", "jaxserve.structured"):
        out = subprocess.run([sys.executable, __file__, "--lib", lib, "--steps", str(args.steps)],
                             capture_output=True, text=True)
        print(out.stdout.strip() or out.stderr[-2000:])


if __name__ == "__main__":
    main()
