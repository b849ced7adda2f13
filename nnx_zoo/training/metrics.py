"""Training metrics: `metrics.jsonl`, TensorBoard events, a console progress bar, a loss plot.

Only the main process writes; on the others every method is a no-op, so the training loop
calls them unconditionally.

Files under `workdir`:
  metrics.jsonl    one JSON object per line. Training lines carry `step` and whatever the loop
                   logs (at least `loss`, `learning_rate`, `grad_norm`, `tokens_per_second`,
                   `mfu`; with data.mixture, `tokens/<name>` per source: its non-padding
                   tokens since the previous training line); evaluation lines carry `step`
                   and `val_loss`. Each line is flushed and fsync'ed as it is written.
                   Non-finite floats are written as null (the file stays strict JSON).
  tensorboard/     event files: `train/<key>` and `eval/<key>` scalars (unless turned off).
  loss_curve.png   written by `finalize()`: train and validation loss against step (unless
                   turned off).

On an object store (`gs://`, `s3://` workdir) nothing can be appended: an object is written
whole. metrics.jsonl is then held in memory and written whole (one request) by `flush()`:
at every checkpoint save (the training loop calls it), at most `FLUSH_S` seconds after the
previous write, and at the end; the TensorBoard events are written to a local directory and
copied up at the same moments. A crash loses at most the lines of the last `FLUSH_S` seconds,
and only lines after the last checkpoint, which a resumed run drops anyway (`resume_step`):
a resumed run's metrics.jsonl is whole up to its checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import string
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from nnx_zoo.runtime import storage
from nnx_zoo.runtime.files import atomic_write

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
LOSS_CURVE_FILE = "loss_curve.png"
# On an object store, the longest metrics.jsonl goes unwritten between checkpoint saves.
FLUSH_S = 30.0


def _line(record: Mapping[str, Any]) -> str:
    return json.dumps(record, allow_nan=False) + "\n"


def _to_json_value(value: Any) -> Any:
    """Python scalar for a jax/numpy scalar or 0-d array; None for NaN/inf; other values as is."""
    if hasattr(value, "shape") and np.ndim(value) == 0:
        value = np.asarray(value).item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The JSON objects in a metrics.jsonl file (local or `gs://`/`s3://`); a line that is not
    complete JSON is skipped."""
    records = []
    if not storage.exists(path):
        return records
    with storage.open_read(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
            if isinstance(record, dict):
                records.append(record)
    return records


def _summary_writer_class():
    """tensorboardX's SummaryWriter, imported without torch. tensorboardX imports torch
    whenever it is installed (to accept torch tensors, which we never pass): ~3 s at every
    start of a run on a machine that has torch (as the `hf` extra brings). The import is
    hidden for that one statement only; torch imports normally afterwards."""
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX allows
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class MetricsWriter:
    """Writes training and evaluation metrics; see the module docstring for the files.

    Args:
      workdir: directory of the run (created if missing, main process only).
      is_main_process: False makes every method a no-op (`jax.process_index() != 0`).
      total_steps: the run's last step, for the progress bar's ETA.
      resume_step: when resuming from a checkpoint at this step, lines with a larger step
        (written after that checkpoint, before the crash) are dropped from metrics.jsonl and
        TensorBoard is told to purge its events after it.
      progress_bar: show the tqdm bar (on stderr).
      tensorboard: write the TensorBoard event files.
      loss_curve: write loss_curve.png at `finalize()`.
    """

    def __init__(
        self,
        workdir: str,
        is_main_process: bool,
        total_steps: int,
        *,
        resume_step: int | None = None,
        progress_bar: bool = True,
        tensorboard: bool = True,
        loss_curve: bool = True,
    ):
        self.workdir = workdir
        self.loss_curve = loss_curve
        self.is_main_process = is_main_process
        self.total_steps = total_steps
        self.path = storage.join(workdir, METRICS_FILE)
        self._file = None
        self._tb = None
        self._bar = None
        self._bar_step = 0
        # Object stores: the file's lines, written whole by `flush` (module docstring).
        self._remote = storage.is_url(workdir)
        self._lines: list[str] = []
        self._flushed_at = time.monotonic()
        self._tb_dir = os.path.join(workdir, TENSORBOARD_DIR)
        if not is_main_process:
            return
        if self._remote:
            self._lines = [_line(r) for r in read_metrics(self.path)]
            if resume_step is not None:
                self.truncate_after(resume_step)
            self._tb_dir = tempfile.mkdtemp(prefix="nnx-zoo-tensorboard-")
        else:
            os.makedirs(workdir, exist_ok=True)
            if resume_step is not None:
                self.truncate_after(resume_step)
            else:
                self._drop_partial_last_line()
            self._file = open(self.path, "a")  # noqa: SIM115 -- held open for the whole run

        if tensorboard:
            SummaryWriter = _summary_writer_class()
            # purge_step: TensorBoard hides events at steps >= it that an earlier, crashed run
            # wrote.
            purge_step = None if resume_step is None else resume_step + 1
            self._tb = SummaryWriter(self._tb_dir, purge_step=purge_step)
        if progress_bar:
            from tqdm import tqdm

            self._bar_step = resume_step or 0
            self._bar = tqdm(
                total=total_steps, initial=self._bar_step, unit="step", dynamic_ncols=True
            )

    # --- writing ---------------------------------------------------------------------------

    def _append(self, record: Mapping[str, Any]) -> None:
        line = json.dumps({k: _to_json_value(v) for k, v in record.items()}, allow_nan=False)
        if self._remote:
            self._lines.append(line + "\n")
            if time.monotonic() - self._flushed_at >= FLUSH_S:
                self.flush()
            return
        self._file.write(line + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def flush(self) -> None:
        """Make every line written so far durable. Local files already are (each line is
        fsync'ed); on an object store, metrics.jsonl is written whole and the TensorBoard
        events copied up. The training loop calls this at each checkpoint save."""
        if not self.is_main_process or not self._remote:
            return
        storage.write_bytes(self.path, "".join(self._lines).encode())
        if self._tb is not None:
            self._tb.flush()
        if os.path.isdir(self._tb_dir) and os.listdir(self._tb_dir):
            storage.upload_tree(self._tb_dir, storage.join(self.workdir, TENSORBOARD_DIR))
        self._flushed_at = time.monotonic()

    def _add_scalars(self, prefix: str, step: int, metrics: Mapping[str, Any]) -> None:
        if self._tb is None:
            return
        for key, value in metrics.items():
            value = _to_json_value(value)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._tb.add_scalar(f"{prefix}/{key}", value, global_step=step)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Log one training step: a metrics.jsonl line, TensorBoard scalars, the progress bar."""
        if not self.is_main_process:
            return
        step = int(step)
        self._append({"step": step, **metrics})
        self._add_scalars("train", step, metrics)
        if self._bar is not None:
            postfix = {}
            for key, label, fmt in (
                ("loss", "loss", "{:.4f}"),
                ("tokens_per_second", "tok/s", "{:,.0f}"),
                ("mfu", "mfu", "{:.2%}"),
            ):
                value = _to_json_value(metrics.get(key))
                if isinstance(value, (int, float)):
                    postfix[label] = fmt.format(value)
            self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(max(step - self._bar_step, 0))
            self._bar_step = max(step, self._bar_step)

    def write_eval(self, step: int, val_loss: float, **extra: Any) -> None:
        """Log a validation result: a line with `step`, `val_loss` and `extra`, and TensorBoard
        scalars `eval/loss` and `eval/<key>` for each extra key."""
        if not self.is_main_process:
            return
        step = int(step)
        self._append({"step": step, "val_loss": val_loss, **extra})
        self._add_scalars("eval", step, {"loss": val_loss, **extra})
        if self._bar is not None:
            value = _to_json_value(val_loss)
            if isinstance(value, float):
                self._bar.write(f"step {step}: val_loss {value:.4f}")

    def write_scores(self, step: int, scores: Mapping[str, Any]) -> None:
        """Log the in-loop eval tasks' scores (`lm_eval/<task>/<metric>`, `lm_eval/eval_time`):
        a metrics.jsonl line with `step` and `scores`, and TensorBoard scalars by those names."""
        if not self.is_main_process:
            return
        step = int(step)
        self._append({"step": step, **scores})
        if self._tb is not None:
            for key, value in scores.items():
                value = _to_json_value(value)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, global_step=step)
        if self._bar is not None:
            shown = ", ".join(
                f"{k.removeprefix('lm_eval/')} {v:.4f}"
                for k, v in scores.items()
                if isinstance(v, float) and k != "lm_eval/eval_time"
            )
            self._bar.write(f"step {step}: {shown}")

    # --- resuming --------------------------------------------------------------------------

    def truncate_after(self, step: int) -> None:
        """Keep only the metrics.jsonl lines with `step` <= `step` (and drop any partial line),
        rewriting the file atomically. For resuming from a checkpoint at `step`."""
        if not self.is_main_process or not storage.exists(self.path):
            return
        kept = [r for r in read_metrics(self.path) if r.get("step", math.inf) <= step]
        self._rewrite(kept)

    def _drop_partial_last_line(self) -> None:
        # A crash in the middle of a write leaves a last line with no newline; appending after
        # it would glue the next record onto it.
        if not os.path.exists(self.path):
            return
        with open(self.path, "rb") as f:
            data = f.read()
        if data and not data.endswith(b"\n"):
            self._rewrite(read_metrics(self.path))

    def _rewrite(self, records: list[dict[str, Any]]) -> None:
        if self._remote:
            self._lines = [_line(r) for r in records]
            self.flush()
            return
        reopen = self._file is not None
        if reopen:
            self._file.close()
        text = "".join(json.dumps(r, allow_nan=False) + "\n" for r in records)
        atomic_write(self.path, lambda f: f.write(text.encode()))
        if reopen:
            self._file = open(self.path, "a")  # noqa: SIM115 -- held open for the whole run

    # --- the end ---------------------------------------------------------------------------

    def plot_loss_curve(self) -> str | None:
        """Write loss_curve.png (train and validation loss against step) atomically, from
        metrics.jsonl, so the steps logged before a resume are on it too. Returns its path."""
        if not self.is_main_process:
            return None
        # Imported here, at the end of a run: matplotlib costs a second of start-up to every
        # process that only logs.
        import matplotlib

        matplotlib.use("Agg")  # no display on a training machine
        import matplotlib.pyplot as plt

        records = read_metrics(self.path)
        train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
        val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        if train:
            ax.plot(*zip(*train, strict=True), label="train loss", linewidth=1)
        if val:
            ax.plot(*zip(*val, strict=True), "o-", label="validation loss", markersize=3)
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
        if train or val:
            ax.legend()
        fig.tight_layout()
        path = storage.join(self.workdir, LOSS_CURVE_FILE)
        try:
            atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120))
        finally:
            plt.close(fig)
        return path

    def close(self) -> None:
        """Close the files and the bar (no plot). Safe to call twice."""
        if self._remote and self.is_main_process and self._tb_dir is not None:
            self.flush()
            if self._tb is not None:
                self._tb.close()
                self._tb = None
                self.flush()  # the events closing wrote
            shutil.rmtree(self._tb_dir, ignore_errors=True)
            self._tb_dir = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def finalize(self) -> None:
        """End of training: close everything and write loss_curve.png (if asked for)."""
        if not self.is_main_process:
            return
        self.close()
        if self.loss_curve:
            self.plot_loss_curve()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


# --- Weights & Biases -------------------------------------------------------------------------

WANDB_INSTALL = 'pip install "nnx-zoo[wandb]"'
WANDB_RUN_FILE = "wandb_run.json"  # the W&B run this workdir logs to: {"id", "project", ...}
_ID_CHARS = string.ascii_lowercase + string.digits


def require_wandb() -> None:
    """UsageError naming the install command when logging.wandb_project is set and the
    `wandb` package is missing (checked before the run is built)."""
    from nnx_zoo.errors import UsageError

    try:
        import wandb  # noqa: F401
    except ImportError:
        raise UsageError(
            f"config logging.wandb_project needs the wandb package: {WANDB_INSTALL}"
        ) from None


def _scalars(prefix: str, metrics: Mapping[str, Any]) -> dict[str, float | int]:
    out = {}
    for key, value in metrics.items():
        value = _to_json_value(value)
        if value is None:
            value = math.nan  # metrics.jsonl's null: W&B plots a gap, as for NaN
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"{prefix}{key}"] = value
    return out


class WandbWriter:
    """The records MetricsWriter writes, logged to one Weights & Biases run per workdir.

    Training lines as `train/<key>`, validation as `eval/loss` and `eval/<key>`, in-loop
    eval tasks under their own names (`lm_eval/<task>/<metric>`), each at its `step`. The run's
    id is kept in `<workdir>/wandb_run.json`: a run resumed from a checkpoint (`resume_step`
    > 0) continues that W&B run (`resume="allow"`); one that starts at step 0 starts a new
    W&B run, as metrics.jsonl starts over. W&B's own files go under `<workdir>/wandb` unless
    WANDB_DIR says where; WANDB_MODE=offline logs without a network (`wandb sync` uploads).
    Only the main process logs; on the others every method is a no-op.
    """

    def __init__(
        self,
        workdir: str,
        is_main_process: bool,
        *,
        project: str,
        entity: str = "",
        name: str = "",
        tags: list[str] | None = None,
        config: Mapping[str, Any] | None = None,
        resume_step: int | None = None,
    ):
        self._run = None
        if not is_main_process:
            return
        import wandb

        path = storage.join(workdir, WANDB_RUN_FILE)
        run_id = None
        if resume_step and storage.exists(path):
            run_id = json.loads(storage.read_bytes(path)).get("id")
        # W&B's own form of id: 8 lowercase letters and digits.
        run_id = run_id or "".join(secrets.choice(_ID_CHARS) for _ in range(8))
        # Recorded before the run starts: a crash inside init still leaves the id to resume.
        record = {"id": run_id, "project": project, "entity": entity or None}
        atomic_write(path, lambda f: f.write((json.dumps(record) + "\n").encode()))
        self._run = wandb.init(
            project=project,
            entity=entity or None,
            name=name or os.path.basename(os.path.normpath(workdir)),
            tags=tags or None,
            id=run_id,
            resume="allow",
            config=dict(config or {}),
            # A resumed run's record (memory, platform) may differ from the first one's.
            allow_val_change=True,
            # W&B writes its files with POSIX calls: for a bucket workdir, its default (./wandb).
            dir=None if os.environ.get("WANDB_DIR") or storage.is_url(workdir) else workdir,
        )
        self.run_id = run_id

    def _log(self, step: int, values: dict) -> None:
        if self._run is not None and values:
            self._run.log(values, step=int(step))

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        self._log(step, _scalars("train/", metrics))

    def write_eval(self, step: int, val_loss: float, **extra: Any) -> None:
        self._log(step, _scalars("eval/", {"loss": val_loss, **extra}))

    def write_scores(self, step: int, scores: Mapping[str, Any]) -> None:
        self._log(step, _scalars("", scores))

    def close(self, exit_code: int = 0) -> None:
        """Finish the W&B run (exit_code 1 marks it failed). Safe to call twice."""
        if self._run is not None:
            self._run.finish(exit_code=exit_code)
            self._run = None

    def finalize(self) -> None:
        self.close()


class Writers:
    """MetricsWriter and the trackers beside it (WandbWriter) as one writer: the loop's
    `write`, `write_eval` and `write_scores` go to each, in order."""

    def __init__(self, metrics: MetricsWriter, *trackers):
        self.metrics = metrics
        self.all = (metrics, *trackers)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        for w in self.all:
            w.write(step, metrics)

    def write_eval(self, step: int, val_loss: float, **extra: Any) -> None:
        for w in self.all:
            w.write_eval(step, val_loss, **extra)

    def write_scores(self, step: int, scores: Mapping[str, Any]) -> None:
        for w in self.all:
            w.write_scores(step, scores)

    def flush(self) -> None:
        """metrics.jsonl made durable (MetricsWriter.flush); the trackers keep their own."""
        self.metrics.flush()
