"""The staged runner of the device checks: each stage in its own child process, with a budget.

A Stage names a function ("module:function") that takes (recorder, config) and records table
rows through the Recorder as it goes. `run_stages` runs the stages one after another, each as
`python -m jaxserve.bench.stage_runner worker ...`, so a stage that raises, crashes the
interpreter, hangs in a compiler or holds device memory cannot stop the next one: an exception
becomes an ERROR row, a stage still running at its budget is killed (with its process group)
and gets a CUT row after the rows it had written, and every stage's device memory is freed
when its process ends. Rows go to a JSON-lines file line by line, so what a stage recorded
before it was cut is kept. A stage may also stop itself in time: `Recorder.left()` is the
seconds remaining before its own deadline (its budget less a margin for the process's exit).

`write_report` writes the table as markdown and the full rows as JSON. The parent process here
never imports jax: only the stages touch a device, and `plan` needs no device at all.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
VERDICTS_FAILING = ("FAIL", "ERROR", "CUT", "MISMATCH")


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str            # short id, used by --only
    title: str           # one line for the plan and the table
    budget_s: float      # wall-clock seconds the stage's process may run
    target: str          # "module:function" taking (Recorder, config dict)
    config: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Row:
    stage: str
    check: str
    result: str
    verdict: str = ""
    data: dict = dataclasses.field(default_factory=dict)


class Recorder:
    """What a stage writes its rows through, and its deadline (in the child process)."""

    def __init__(self, path: Path, stage: str, budget_s: float):
        self.path, self.stage = path, stage
        self.started = time.monotonic()
        # the margin leaves time to write the last rows and exit before the parent kills us
        self.deadline = self.started + budget_s - min(10.0, 0.1 * budget_s)

    def row(self, check: str, result: str, verdict: str = "", **data) -> None:
        line = json.dumps(dataclasses.asdict(Row(self.stage, check, result, verdict, data)),
                          default=str)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")

    def left(self) -> float:
        return self.deadline - time.monotonic()


@dataclasses.dataclass
class StageRun:
    stage: Stage
    status: str          # "ok" | "error" | "cut" | "crashed"
    seconds: float
    rows: list


def plan_text(stages: list[Stage]) -> str:
    lines = [f"{'stage':10s} {'budget':>8s}  what"]
    lines += [f"{s.name:10s} {s.budget_s:7.0f}s  {s.title}" for s in stages]
    lines.append(f"{'total':10s} {sum(s.budget_s for s in stages):7.0f}s")
    return "\n".join(lines)


def run_stages(stages: list[Stage], log_path: Path | None = None, echo=print,
               after=None) -> list[StageRun]:
    """Run each stage in a child process, in order. after(run) may return False to stop
    before the next stage (the device probe does, where there is no device)."""
    runs = []
    for stage in stages:
        echo(f"[{stage.name}] {stage.title} (budget {stage.budget_s:.0f} s)")
        run = run_stage(stage, log_path)
        echo(f"[{stage.name}] {run.status} in {run.seconds:.1f} s, {len(run.rows)} rows")
        runs.append(run)
        if after is not None and after(run) is False:
            break
    return runs


def run_stage(stage: Stage, log_path: Path | None) -> StageRun:
    with tempfile.TemporaryDirectory(prefix=f"stage-{stage.name}-") as tmp:
        rows_path, config_path = Path(tmp) / "rows.jsonl", Path(tmp) / "config.json"
        config_path.write_text(json.dumps(stage.config))
        cmd = [sys.executable, "-m", "jaxserve.bench.stage_runner", "worker", stage.name,
               stage.target, str(config_path), str(rows_path), str(stage.budget_s)]
        env = dict(os.environ, PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                            os.environ.get("PYTHONPATH")])))
        log_file = log_path or Path(tmp) / "log"
        with open(log_file, "a", encoding="utf-8") as log:
            log.write(f"\n===== stage {stage.name}: {' '.join(cmd[3:])}\n")
            log.flush()
            offset = log.tell()
            start = time.monotonic()
            # a session of its own: a timeout kills the stage's children (compilers) too
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    cwd=ROOT, start_new_session=True)
            try:
                code = proc.wait(timeout=stage.budget_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                code = None
            seconds = time.monotonic() - start
        with open(log_file, encoding="utf-8", errors="replace") as log:
            log.seek(offset)
            tail = log.read()[-4000:]
        rows = read_rows(rows_path)
    if code is None:
        status = "cut"
        rows.append(Row(stage.name, f"{stage.name}: budget",
                        f"stopped at its budget of {stage.budget_s:.0f} s", "CUT"))
    elif code == 0:
        status = "ok"
    elif any(r.verdict == "ERROR" for r in rows):
        status = "error"
    else:
        status = "crashed"
        rows.append(Row(stage.name, f"{stage.name}: process",
                        f"exit status {code} without a result: {_last_line(tail) or '-'}",
                        "ERROR"))
    return StageRun(stage, status, seconds, rows)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def read_rows(path: Path) -> list[Row]:
    rows = []
    if not path.exists():
        return rows
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(Row(**json.loads(line)))
        except (json.JSONDecodeError, TypeError):
            continue  # a line cut short when the process was killed
    return rows


def table(rows: list[tuple[str, str, str]]) -> str:
    """(check, result, verdict) rows as an aligned text table."""
    head = ("check", "result", "verdict")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(3)]
    line = "  ".join("{:<%d}" % w for w in widths)
    out = [line.format(*head), line.format(*("-" * w for w in widths))]
    return "\n".join(out + [line.format(*r) for r in rows])


def markdown(runs: list[StageRun], header: str) -> str:
    cell = lambda s: str(s).replace("|", "\\|").replace("\n", " ")
    out = [header, "", "| stage | status | seconds | budget |", "| --- | --- | --- | --- |"]
    out += [f"| {r.stage.name} | {r.status} | {r.seconds:.1f} | {r.stage.budget_s:.0f} |"
            for r in runs]
    out += ["", "| stage | check | result | verdict |", "| --- | --- | --- | --- |"]
    out += [f"| {row.stage} | {cell(row.check)} | {cell(row.result)} | {row.verdict} |"
            for r in runs for row in r.rows]
    return "\n".join(out) + "\n"


def write_report(runs: list[StageRun], out_dir: Path, name: str, header: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    md, js = out_dir / f"{name}.md", out_dir / f"{name}.json"
    md.write_text(markdown(runs, header), encoding="utf-8")
    js.write_text(json.dumps({"header": header, "stages": [
        {"name": r.stage.name, "title": r.stage.title, "budget_s": r.stage.budget_s,
         "status": r.status, "seconds": round(r.seconds, 2),
         "rows": [dataclasses.asdict(row) for row in r.rows]} for r in runs]},
        indent=1, default=str), encoding="utf-8")
    return [md, js]


def failed(runs: list[StageRun]) -> bool:
    return any(r.status != "ok" or any(row.verdict in VERDICTS_FAILING for row in r.rows)
               for r in runs)


def _worker(name: str, target: str, config_path: str, rows_path: str, budget_s: str) -> int:
    import importlib

    recorder = Recorder(Path(rows_path), name, float(budget_s))
    config = json.loads(Path(config_path).read_text())
    try:
        module, function = target.split(":")
        getattr(importlib.import_module(module), function)(recorder, config)
    except Exception as e:  # noqa: BLE001 (any failure of a stage is its row)
        traceback.print_exc()
        recorder.row(f"{name}: exception", f"{type(e).__name__}: {_last_line(str(e)) or '-'}",
                     "ERROR", traceback=traceback.format_exc()[-4000:])
        return 1
    return 0


if __name__ == "__main__" and len(sys.argv) == 7 and sys.argv[1] == "worker":
    status = _worker(*sys.argv[2:])
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit: a stage's leftover threads (compiles past its deadline) must not hold us
    os._exit(status)
