"""A lost process, timed: two train_main processes (4 simulated CPU devices each, a tiny fsdp
run), one SIGKILLed while the other compiles, trains or saves; how long the survivor takes to
exit, its exit status, and what it printed on stderr.

    python -m bench.process_faults [--phases=compile,step,save] [--victim=1] \
        [--peer_timeout=60] [--repeat=1] [--compile_delay=8] [--workdir=/tmp/process_faults]

`--victim=0` kills process 0 (the coordinator, which also relays the watch). With
`--peer_timeout=0` the peer watch is off and JAX's runtime alone decides (its 100 s heartbeat,
then SIGABRT): the figures before nnx_zoo/runtime/peers.py. "detected" runs from the SIGKILL to the
survivor's exit. The survivor's line names the newest complete checkpoint; the bench checks
it against the files (a save cut short stays Orbax's temporary directory), and what the
survivor was doing, which is what each row is filed under: the compile kill comes
`--compile_delay` seconds after the line printed before the first batch, and on a loaded host
the survivor may still be starting then (raise the delay). `--repeat` runs each phase again;
a table of every kill ends the output.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench.fixtures import SMALL_SHAPES  # noqa: E402
from nnx_zoo.checkpoint.steps import checkpoint_dir, complete_steps  # noqa: E402

RUN = {
    **SMALL_SHAPES,  # the tests' small run: it compiles and trains in seconds
    "optimizer.warmup_steps": 0,
    "training.steps": 400,
    "training.eval_every": 0,
    "logging.log_every": 1,
    "logging.progress_bar": False,
    "checkpoint.every": 20,
    "logging.peak_tflops": 1.0,  # no matmul measuring the peak between start-up and compile
}


def _launch(workdir: str, port: int, peer_timeout: float) -> list[subprocess.Popen]:
    env = dict(os.environ)
    env.update(
        XLA_FLAGS="--xla_force_host_platform_device_count=4",
        JAX_PLATFORMS="cpu",
        TF_CPP_MIN_LOG_LEVEL="2",
    )
    flags = [f"--config.{k}={v}" for k, v in RUN.items()]
    flags.append(f"--config.training.peer_timeout_seconds={peer_timeout}")
    procs = []
    for i in range(2):
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    os.path.join(ROOT, "train_main.py"),
                    f"--workdir={workdir}/run",
                    f"--coordinator_address=localhost:{port}",
                    "--num_processes=2",
                    f"--process_id={i}",
                    "--sharding_strategy=fsdp",
                    *flags,
                ],
                env=env,
                cwd=ROOT,
                stdout=open(f"{workdir}/p{i}.out", "w"),  # noqa: SIM115 -- the child owns it
                stderr=open(f"{workdir}/p{i}.err", "w"),  # noqa: SIM115
            )
        )
    return procs


def _metrics_lines(workdir: str) -> int:
    try:
        with open(f"{workdir}/run/metrics.jsonl") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def _ready(phase: str, workdir: str, since: dict, compile_delay: float) -> bool:
    """Whether the survivor is now in `phase`; the step and save kills come after a first
    complete checkpoint (step 20), which the survivor's line should name."""
    if phase == "compile":
        with open(f"{workdir}/p0.out") as f:
            announced = "processes); batch" in f.read()  # printed just before the compile
        if announced:
            since.setdefault("announced", time.monotonic())
        # The first batch (seconds, more under load), then a compile of 10-30 s.
        return announced and time.monotonic() - since["announced"] > compile_delay
    complete = complete_steps(checkpoint_dir(f"{workdir}/run"), warn=False)
    if phase == "step":
        return bool(complete) and _metrics_lines(workdir) >= RUN["checkpoint.every"] + 5
    return bool(complete) and bool(glob.glob(f"{workdir}/run/checkpoints/*orbax-checkpoint-tmp*"))


def _doing(line: str) -> str:
    """What the survivor's one line says it was doing ('while compiling the train step')."""
    match = re.search(r"\) ((?:while|during) [^;]*?)(?:;|$)", line)
    return match.group(1) if match else "-"


def one(
    phase: str, victim: int, peer_timeout: float, root: str, port: int, compile_delay: float
) -> dict | None:
    workdir = os.path.join(root, f"{phase}_victim{victim}")
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    procs = _launch(workdir, port, peer_timeout)
    survivor = procs[1 - victim]
    since: dict = {}
    try:
        while not _ready(phase, workdir, since, compile_delay):
            if any(p.poll() is not None for p in procs):
                print(f"{phase}: a process ended before the kill: {[p.poll() for p in procs]}")
                return None
            time.sleep(0.02)
        steps_logged = _metrics_lines(workdir)
        procs[victim].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        try:
            survivor.wait(timeout=600)
            seconds = time.monotonic() - killed
            detected = f"{seconds:.2f} s"
        except subprocess.TimeoutExpired:
            seconds, detected = None, "over 600 s"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    with open(f"{workdir}/p{1 - victim}.err") as f:
        err = f.read().splitlines()
    complete = complete_steps(checkpoint_dir(f"{workdir}/run"), warn=False)
    leftovers = glob.glob(f"{workdir}/run/checkpoints/*orbax-checkpoint-tmp*")
    print(
        f"{phase:8s} kill process {victim} after {steps_logged} logged steps: survivor exit "
        f"{survivor.returncode} after {detected}; {len(err)} stderr lines; complete "
        f"checkpoints {complete}; temporary dirs {len(leftovers)}",
        flush=True,
    )
    print(f"         last stderr line: {err[-1] if err else '(none)'}", flush=True)
    return dict(
        phase=phase,
        victim=victim,
        seconds=seconds,
        exit=survivor.returncode,
        lines=len(err),
        doing=_doing(err[-1]) if err else "-",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phases", default="compile,step,save")
    parser.add_argument("--victim", type=int, default=1, choices=(0, 1))
    parser.add_argument("--peer_timeout", type=float, default=60.0)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--compile_delay", type=float, default=8.0)
    parser.add_argument("--workdir", default="/tmp/process_faults")
    args = parser.parse_args()
    import portpicker

    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    rows = []
    for _ in range(args.repeat):
        for phase in args.phases.split(","):
            port = portpicker.pick_unused_port()
            row = one(phase, args.victim, args.peer_timeout, args.workdir, port, args.compile_delay)
            if row is not None:
                rows.append(row)
    print("\n| killed in | victim | survivor was | detected (s) | exit | stderr lines |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        took = "-" if r["seconds"] is None else f"{r['seconds']:.2f}"
        print(
            f"| {r['phase']} | {r['victim']} | {r['doing']} | {took} | {r['exit']} | {r['lines']} |"
        )


if __name__ == "__main__":
    main()
