"""A bounded soak of a running jaxserve gRPC server: a seeded mix of requests, then a PASS/FAIL table.

    python scripts/soak.py [--address 127.0.0.1:50051] [--metrics-url http://127.0.0.1:9090/metrics]
        [--requests 300] [--seed 0] [--concurrency 16] [--sigterm-pid PID] [--expect-preemption]

First each of a few distinct greedy requests runs alone (its solo output). Then --requests calls
go out --concurrency at a time, in a seeded order: those greedy requests again (each must equal
its solo run token for token, whatever the batch, chunking or preemption did), streams cancelled
after a few tokens, calls with tiny deadlines, and invalid inputs drawn by hypothesis
(scripts/soak_inputs.py: each must be INVALID_ARGUMENT, or RESOURCE_EXHAUSTED for a size the
pool can never hold). No call may end INTERNAL or UNKNOWN, and none may hang (every call has a
deadline; one that is not tiny must never pass). A stop string completed by the last allowed
token must finish with reason stop. With --metrics-url: afterwards 0 running, 0 waiting and the
free KV pages back to their count before the soak (and with --expect-preemption, both recompute
and swap preemptions seen). With --sigterm-pid (the server's pid, on this machine): SIGTERM
while long requests run; new calls must be UNAVAILABLE, in-flight ones finish or end UNAVAILABLE,
and the server must go away. Exits 1 if any check failed. It only talks to the server (and
signals it when asked); it never starts one.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import random
import re
import signal
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

import soak_inputs  # noqa: E402  (next to this script)

from jaxserve.entrypoints.grpc.client import JaxServeClient, JaxServeError  # noqa: E402
from jaxserve.entrypoints.grpc.pb import jaxserve_pb2 as pb  # noqa: E402

BAD_CODES = {"INTERNAL", "UNKNOWN"}


@dataclass
class Check:
    name: str
    num_run: int = 0
    failures: list[str] = field(default_factory=list)
    skipped: str | None = None      # why it could not run
    note: str = ""                  # what was measured, shown under the row

    def record(self, ok: bool, detail: str = "") -> None:
        self.num_run += 1
        if not ok:
            self.failures.append(detail)

    @property
    def status(self) -> str:
        if self.skipped:
            return "SKIP"
        return "PASS" if self.num_run and not self.failures else "FAIL"  # 0 runs: never checked


class Soak:
    def __init__(self, args):
        self.args, self.rng = args, random.Random(args.seed)
        self.client = JaxServeClient(args.address, timeout=args.hang_seconds)
        self.checks = {key: Check(name) for key, name in (
            ("greedy", "greedy outputs equal their solo runs"),
            ("stop", "a stop string completed by the last allowed token finishes 'stop'"),
            ("cancel", "cancelled streams end CANCELLED (or had finished)"),
            ("deadline", "tiny deadlines end DEADLINE_EXCEEDED (or finish correctly)"),
            ("invalid", "invalid inputs get INVALID_ARGUMENT / RESOURCE_EXHAUSTED"),
            ("codes", "no call ends INTERNAL or UNKNOWN"),
            ("hang", "no hung stream"),
            ("idle", "idle afterwards: 0 running, 0 waiting, free pages as before"),
            ("preemption", "preemption happened (recompute and swap)"),
            ("sigterm", "SIGTERM: new calls UNAVAILABLE, in-flight ones end cleanly, server gone"),
        )}

    # ---- calls -------------------------------------------------------------------------------
    def call(self, request, timeout: float | None = None, cancel_after: int | None = None):
        """(status name, token ids, finish reason, text, seconds) of one Generate call."""
        timeout = timeout or self.args.hang_seconds
        start, tokens, finish, text = time.monotonic(), [], None, ""
        stream = self.client.stub.Generate(request, timeout=timeout)
        try:
            for i, response in enumerate(stream):
                tokens.extend(response.token_ids)
                text += response.text
                if response.finish_reason:
                    finish = pb.FinishReason.Name(response.finish_reason)
                if cancel_after is not None and i + 1 >= cancel_after:
                    stream.cancel()
        except grpc.RpcError as exc:
            return exc.code().name, tokens, finish, exc.details(), time.monotonic() - start
        return "OK", tokens, finish, text, time.monotonic() - start

    def raw_call(self, data: bytes):
        method = self.client.channel.unary_stream("/jaxserve.v1.JaxServe/Generate")
        try:
            list(method(data, timeout=self.args.hang_seconds))
        except grpc.RpcError as exc:
            return exc.code().name, exc.details()
        return "OK", ""

    def note_code(self, code: str, what: str, seconds: float, tiny_deadline: bool = False):
        self.checks["codes"].record(code not in BAD_CODES, f"{what}: {code}")
        hung = code == "DEADLINE_EXCEEDED" and not tiny_deadline
        self.checks["hang"].record(not hung, f"{what}: no end after {seconds:.0f} s")

    # ---- the request mix -----------------------------------------------------------------------
    def greedy_requests(self, info) -> list[pb.GenerateRequest]:
        out, pool_tokens = [], (info.num_pages - 1) * info.page_size
        for i in range(self.args.distinct_greedy):
            max_tokens = self.rng.randint(8, self.args.max_tokens)
            length = self.rng.randint(1, max(1, min(48, pool_tokens // 4 - max_tokens)))
            sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                         ignore_eos=True)
            request = pb.GenerateRequest(sampling=sampling)
            request.token_ids.ids.extend(self.rng.randrange(3, info.vocab_size)
                                         for _ in range(length))
            out.append(request)
        return out

    def solo_runs(self, greedy):
        solos = []
        for request in greedy:
            code, tokens, finish, text, seconds = self.call(request)
            self.note_code(code, f"solo run {len(solos)}", seconds)
            if code != "OK":
                raise RuntimeError(f"solo run {len(solos)} failed: {code} {text}")
            solos.append((tokens, finish, text))
        return solos

    def check_stop_string(self, greedy, solos) -> None:
        """The solo text's last characters as a stop string, max_tokens unchanged."""
        for request, (tokens, _, text) in list(zip(greedy, solos))[:3]:
            # The shortest tail of the text found nowhere earlier in it: only the last token
            # completes it.
            tail = next((text[-k:] for k in range(1, len(text) + 1)
                         if text.find(text[-k:]) == len(text) - k), "")
            if not tail:
                continue
            stopped = pb.GenerateRequest(sampling=request.sampling, token_ids=request.token_ids)
            stopped.sampling.stop[:] = [tail]
            code, got, finish, got_text, seconds = self.call(stopped)
            self.note_code(code, "stop string", seconds)
            self.checks["stop"].record(
                code == "OK" and finish == "FINISH_REASON_STOP" and got == tokens,
                f"stop={tail!r} at token {len(tokens)}: {code} {finish}, {len(got)} tokens")

    def one(self, kind: str, greedy, solos, invalid):
        if kind == "greedy":
            i = self.rng.randrange(len(greedy))
            code, tokens, finish, text, seconds = self.call(greedy[i])
            self.note_code(code, f"greedy {i}", seconds)
            self.checks["greedy"].record(
                code == "OK" and tokens == solos[i][0],
                f"greedy {i}: {code} {text[:80]!r}, tokens {tokens[:8]}... vs solo "
                f"{solos[i][0][:8]}...")
        elif kind == "cancel":
            request = greedy[self.rng.randrange(len(greedy))]
            code, _, _, text, seconds = self.call(request, cancel_after=self.rng.randint(1, 3))
            self.note_code(code, "cancel", seconds)
            self.checks["cancel"].record(code in ("CANCELLED", "OK"), f"cancel: {code} {text}")
        elif kind == "deadline":
            i = self.rng.randrange(len(greedy))
            timeout = self.rng.choice((0.001, 0.005, 0.02, 0.05))
            code, tokens, _, text, seconds = self.call(greedy[i], timeout=timeout)
            self.note_code(code, "tiny deadline", seconds, tiny_deadline=True)
            ok = code == "DEADLINE_EXCEEDED" or (code == "OK" and tokens == solos[i][0])
            self.checks["deadline"].record(ok, f"deadline {timeout}: {code} {text[:80]}")
        else:
            label, payload = invalid[self.rng.randrange(len(invalid))]
            if isinstance(payload, bytes):
                code, details = self.raw_call(payload)
            else:
                code, _, _, details, _ = self.call(payload)
            self.note_code(code, f"invalid ({label})", 0.0)
            self.checks["invalid"].record(code in ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"),
                                          f"{label}: {code} {details[:120]}")

    def mix(self, greedy, solos, invalid) -> None:
        weights = {"greedy": 55, "cancel": 15, "deadline": 10, "invalid": 20}
        kinds = self.rng.choices(list(weights), list(weights.values()), k=self.args.requests)
        # Each call draws its own choices from a generator seeded per call: the same mix for a
        # seed, whatever order the threads run in.
        seeds = [self.rng.getrandbits(32) for _ in kinds]

        def run(kind_seed):
            kind, seed = kind_seed
            worker = Soak.__new__(Soak)
            worker.__dict__.update(self.__dict__, rng=random.Random(seed))
            worker.one(kind, greedy, solos, invalid)

        with concurrent.futures.ThreadPoolExecutor(self.args.concurrency) as pool:
            for future in [pool.submit(run, ks) for ks in zip(kinds, seeds)]:
                future.result(timeout=2 * self.args.hang_seconds)

    # ---- server state --------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.args.metrics_url, timeout=10) as response:
            text = response.read().decode()
        return {m.group(1): float(m.group(2))
                for m in re.finditer(r"^(jaxserve_\w+) (\S+)$", text, re.M)}

    def check_idle(self, before: dict[str, float]) -> None:
        deadline, want = time.monotonic() + 30, before["jaxserve_kv_cache_free_pages"]
        while True:
            now = self.metrics()
            state = (now["jaxserve_num_requests_running"], now["jaxserve_num_requests_waiting"],
                     now["jaxserve_num_requests_swapped"], now["jaxserve_kv_cache_free_pages"])
            if state == (0, 0, 0, want) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        self.checks["idle"].record(state == (0, 0, 0, want),
                                   f"running, waiting, swapped, free pages = {state}; free "
                                   f"before: {want:.0f}")
        preempted = now["jaxserve_preemptions_total"] - before["jaxserve_preemptions_total"]
        swapped = now["jaxserve_swap_outs_total"] - before["jaxserve_swap_outs_total"]
        self.checks["preemption"].note = (f"{preempted - swapped:.0f} recompute and "
                                          f"{swapped:.0f} swap preemptions")
        if self.args.expect_preemption:
            self.checks["preemption"].record(
                swapped > 0 and preempted > swapped,
                f"{preempted - swapped:.0f} recompute and {swapped:.0f} swap preemptions")
        else:
            self.checks["preemption"].skipped = (
                f"not asked (seen: {preempted - swapped:.0f} recompute, {swapped:.0f} swap)")

    def sigterm(self, greedy) -> None:
        check, long = self.checks["sigterm"], greedy[0]
        long = pb.GenerateRequest(token_ids=long.token_ids, sampling=long.sampling)
        long.sampling.max_tokens = self.args.max_tokens * 4
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            running = [pool.submit(self.call, long) for _ in range(4)]
            time.sleep(0.2)
            os.kill(self.args.sigterm_pid, signal.SIGTERM)
            time.sleep(0.2)  # the signal has been handled; the server drains from here on
            gone, deadline = False, time.monotonic() + self.args.hang_seconds
            late = pb.GenerateRequest(text="late", sampling=pb.SamplingParams(max_tokens=1))
            while not gone and time.monotonic() < deadline:
                code, *_ = self.call(late, timeout=5)
                check.record(code == "UNAVAILABLE", f"a new call after SIGTERM: {code}")
                try:  # NOT_SERVING while it drains; UNAVAILABLE (refused) once it has exited
                    health = self.client.health()
                    check.record(health == "NOT_SERVING", f"health after SIGTERM: {health}")
                except JaxServeError as exc:
                    gone = exc.code == grpc.StatusCode.UNAVAILABLE
                    check.record(gone, f"health after SIGTERM: {exc.code.name}")
                time.sleep(0.01)
            for future in running:
                code, _, _, text, _ = future.result(timeout=2 * self.args.hang_seconds)
                check.record(code in ("OK", "UNAVAILABLE"), f"in flight at SIGTERM: {code} {text}")
        check.record(gone, "the server process was still there after the drain")

    # ---- the whole soak ------------------------------------------------------------------------
    def run(self) -> list[Check]:
        info = self.client.model_info()
        if self.client.health() != "SERVING":
            raise RuntimeError(f"the server at {self.args.address} is not SERVING")
        before = self.metrics() if self.args.metrics_url else None
        greedy = self.greedy_requests(info)
        solos = self.solo_runs(greedy)
        self.check_stop_string(greedy, solos)
        invalid = soak_inputs.draw(self.args.seed, self.args.invalid_examples, info.vocab_size,
                                   info.max_model_len)
        self.mix(greedy, solos, invalid)
        if before is not None:
            self.check_idle(before)
        else:
            self.checks["idle"].skipped = self.checks["preemption"].skipped = "no --metrics-url"
        if self.args.sigterm_pid:
            self.sigterm(greedy)
        else:
            self.checks["sigterm"].skipped = "no --sigterm-pid"
        self.client.close()
        return list(self.checks.values())


def table(checks: list[Check]) -> str:
    lines = [f"{'check':<72} {'runs':>5} {'fail':>5}  result"]
    for c in checks:
        lines.append(f"{c.name:<72} {c.num_run:>5} {len(c.failures):>5}  {c.status}")
        for detail in c.failures[:3]:
            lines.append(f"    {detail}")
        if c.skipped:
            lines.append(f"    skipped: {c.skipped}")
        elif c.note:
            lines.append(f"    {c.note}")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="127.0.0.1:50051", help="the gRPC server")
    parser.add_argument("--metrics-url", default=None,
                        help="its Prometheus endpoint (jaxserve serve --metrics-port)")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--distinct-greedy", type=int, default=16,
                        help="greedy requests run solo first, then repeated in the mix")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--invalid-examples", type=int, default=100,
                        help="invalid inputs hypothesis draws (the mix picks among them)")
    parser.add_argument("--hang-seconds", type=float, default=120.0,
                        help="a call (not a tiny-deadline one) taking this long is hung")
    parser.add_argument("--sigterm-pid", type=int, default=None,
                        help="SIGTERM this pid (the server) at the end and check the drain")
    parser.add_argument("--expect-preemption", action="store_true",
                        help="fail unless both recompute and swap preemptions happened")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    checks = Soak(parse_args(argv)).run()
    print(table(checks))
    failed = [c.name for c in checks if c.status == "FAIL"]
    print(f"\n{'FAIL' if failed else 'PASS'}: {len(checks) - len(failed)} of {len(checks)} "
          f"checks passed or skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
