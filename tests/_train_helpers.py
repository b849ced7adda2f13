"""Shared by the train_main tests: one small run, as CLI flags and as an in-process config;
train_main run in this process (`run_train_main`), or as a process where the process is the
subject (`train_main_process`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_MAIN = os.path.join(ROOT, "train_main.py")
# train_main.py is a script, not part of the installed packages: importable from the root.
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.fixtures import (  # noqa: E402 -- shared with the benches
    QUIET_LOGS,
    SMALL_SHAPES,
    STEPS_ONLY,
    config_flags,
)

# configs/tiny.py made smaller still, so a run compiles and trains in seconds on 2 cores.
# Every dim still splits over the default fsdp_tp mesh (data:4, model:2) and over 8 devices
# for dp / fsdp; heads 8 / kv heads 4 as in the preset. bench/process_faults.py runs it too.
SMALL_RUN = {
    **SMALL_SHAPES,
    "optimizer.learning_rate": 3e-3,
    "optimizer.warmup_steps": 5,
    "training.steps": 40,
    "training.eval_every": 20,
    "training.eval_batches": 2,
    # metrics.jsonl is what the tests read; test_train_main's run checks the other files.
    **QUIET_LOGS,
    "checkpoint.enabled": False,
}
# Three steps with no evaluation or checkpoint: for tests of what a run reads, not learns.
QUICK_RUN = {**SMALL_SHAPES, "training.steps": 3, **STEPS_ONLY}


cli_flags = config_flags


def run_config(overrides: dict):
    """The typed RunConfig of configs/tiny.py with `overrides` applied, as the CLI would."""
    from configs import tiny
    from nnx_zoo.training.config import RunConfig

    config = tiny.get_config()
    for path, value in overrides.items():
        section, field = path.split(".")
        setattr(config[section], field, value)
    return RunConfig.from_config_dict(config)


def child_env(num_devices: int = 8) -> dict:
    """A process's environment: the test session's, with XLA's flags (tests/conftest.py:
    the compile pipeline, so a process and this worker compile alike) and `num_devices`."""
    env = dict(os.environ)
    count = "--xla_force_host_platform_device_count="
    kept = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(count)]
    env["XLA_FLAGS"] = " ".join([*kept, f"{count}{num_devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    return env


def run_train_main(args: list[str], *, num_devices: int | None = None):
    """`python train_main.py ARGS` in this process (tests/_entry.py): a Result with its exit
    status, stdout and stderr. `num_devices`: the run's mesh over the first N of the 8
    devices (--config.training.num_devices), the program an N-device process compiles."""
    import _entry

    if num_devices is not None:
        args = [*args, f"--config.training.num_devices={num_devices}"]
    return _entry.train(args)


def train_main_process(args: list[str], *, num_devices: int = 8, timeout: int = 600, **kwargs):
    """train_main as its own process, for the tests whose subject is the process: a signal, a
    kill, a lock between processes, the stderr and exit status of the entry point itself."""
    return subprocess.run(
        [sys.executable, TRAIN_MAIN, *args],
        env=child_env(num_devices),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        **kwargs,
    )


def start_train_main(
    args: list[str], *, num_devices: int = 8, env: dict | None = None, **popen
) -> subprocess.Popen:
    """train_main started as a process that the test signals, kills or runs beside a peer;
    `env`: variables set over the test environment's."""
    return subprocess.Popen(
        [sys.executable, TRAIN_MAIN, *args],
        env={**child_env(num_devices), **(env or {})},
        cwd=ROOT,
        **popen,
    )


def peer_flags(port: int, process_id: int, num_processes: int = 2) -> list[str]:
    """The flags of process `process_id` of a run of several processes on this host."""
    return [
        f"--coordinator_address=localhost:{port}",
        f"--num_processes={num_processes}",
        f"--process_id={process_id}",
    ]


# What a resumed run must reproduce of an uninterrupted one, bit for bit (JSON floats).
HISTORY_KEYS = ("step", "loss", "grad_norm", "learning_rate", "val_loss", "tokens_seen")


def assert_same_history(want: list[dict], got: list[dict], keys=HISTORY_KEYS) -> None:
    """Two metrics.jsonl histories, record by record, equal in `keys`."""
    assert len(got) == len(want)
    for w, g in zip(want, got, strict=True):
        for key in keys:
            assert g.get(key) == w.get(key), (key, w["step"], g.get(key), w.get(key))


def train_losses(workdir: str) -> list[float]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [r["loss"] for r in records if "loss" in r]


def assert_evaluates_under_dp(workdir: str, steps: int) -> None:
    """eval_main under dp on the run's last checkpoint (step `steps`) gives the loss the run
    logged there as val_loss (float32 reassociation: rel 1e-5)."""
    import _entry
    import numpy as np

    result = _entry.evaluate([f"--workdir={workdir}", "--sharding_strategy=dp"])
    assert result.returncode == 0, result.stderr[-3000:]
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        val = [r["val_loss"] for r in map(json.loads, f) if "val_loss" in r]
    with open(os.path.join(workdir, "eval.json")) as f:
        evaluated = json.load(f)
    assert evaluated["step"] == steps
    np.testing.assert_allclose(evaluated["loss"], val[-1], rtol=1e-5)


def char_tokenizer(directory, num_ids: int | None = None) -> tuple[str, int]:
    """A character-level tokenizer.json (printable ASCII, newline, tab, [UNK], </s>: 99 ids,
    which fit the 128-id reference models), padded with filler tokens to `num_ids` when given.
    Returns (path, EOS id)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    chars = [chr(i) for i in range(32, 127)] + ["\n", "\t", "[UNK]", "</s>"]
    chars += [chr(0x4E00 + i) for i in range((num_ids or len(chars)) - len(chars))]
    tokenizer = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    path = os.path.join(directory, "tokenizer.json")
    tokenizer.save(path)
    return path, chars.index("</s>")
