"""scripts/rl_loop_example.py --tiny: the toy policy-gradient loop runs (update_weights every
step, sleep / wake_up around training) and the reward it optimises goes up."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_tiny_rl_loop_raises_its_reward_and_its_trainer_agrees_with_the_engine():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "rl_loop_example.py"), "--tiny"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    rewards = [float(r) for r in re.search(r"rewards: (.*)", run.stdout).group(1).split()]
    assert rewards[-1] > rewards[0] + 0.2, rewards
    gap = float(re.search(r"max \|engine - trainer\| logprob: (\S+)", run.stdout).group(1))
    assert gap <= 1e-5, f"the trainer's logprobs differ from the engine's by {gap}"
