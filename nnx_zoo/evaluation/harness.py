"""Run lm-evaluation-harness tasks on this project's model and write the harness's results.

    results = run_tasks(lm, ["zoo_facts"], include_path=EXAMPLE_TASKS)
    write_results(results, "runs/a/lm_eval.json")

Tasks are the harness's own names or those of local task YAML under `include_path` (the
example tasks ship inside this package, nnx_zoo/evaluation/lm_eval_tasks/, and `--include_path=
lm_eval_tasks` names them from anywhere: `include_dir`). Local tasks are looked up first; the
harness's ~15k built-in tasks are indexed (about a minute) only when a name is not among them.
The hub is never asked for a model or a tokenizer (HF_HUB_OFFLINE), and built-in tasks whose
data is not in the local datasets cache need the network.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os

from nnx_zoo.errors import UsageError

INSTALL = 'pip install "nnx-zoo[eval]"  (lm-eval 0.4.13)'
RESULTS_FILE = "lm_eval.json"
EXAMPLE_TASKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lm_eval_tasks")
_EXAMPLES_NAME = os.path.basename(EXAMPLE_TASKS)


def include_dir(value: str) -> str:
    """`--include_path`: a directory as given (`~` expanded, absolute), or the example tasks
    shipped in this package when `value` is not a directory and names them: `lm_eval_tasks`,
    or the checkout paths `examples/lm_eval_tasks` (where they lived) and
    `nnx_zoo/evaluation/lm_eval_tasks`. An existing directory always wins, so a user's own
    `lm_eval_tasks/` is theirs (as nnx_zoo/launch/config_files.py treats config names)."""
    from nnx_zoo.checkpoint.workdir import expand

    path = expand(value)
    if os.path.isdir(path):
        return path
    name, parent = os.path.basename(os.path.normpath(value)), os.path.dirname(value.rstrip("/"))
    if name == _EXAMPLES_NAME and parent in ("", "examples", "evaluation", "nnx_zoo/evaluation"):
        return EXAMPLE_TASKS
    return path


def require_lm_eval() -> None:
    """UsageError naming the install command when the [eval] extra is missing."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UsageError(f"--tasks needs lm-evaluation-harness: {INSTALL}") from None


def parse_tasks(spec: str) -> list[str]:
    names = [t.strip() for t in spec.split(",") if t.strip()]
    if not names:
        raise UsageError(f"--tasks={spec!r} names no task; e.g. --tasks=zoo_facts,zoo_prose")
    return names


def task_manager(names: list[str], include_path: str | None):
    """A TaskManager that knows every name in `names`, or UsageError naming the unknown."""
    from lm_eval.tasks import TaskManager

    if include_path is not None and not os.path.isdir(include_path):
        raise UsageError(
            f"--include_path={include_path!r} is not a directory of task YAML files (or "
            f"{_EXAMPLES_NAME}: the example tasks shipped with this package)"
        )
    where = (
        f"in --include_path={include_path} or the harness's tasks"
        if include_path
        else "among the harness's tasks (a local task needs --include_path=DIR)"
    )
    local = []
    if include_path is not None:
        manager = TaskManager(include_path=include_path, include_defaults=False)
        local = manager.all_tasks
        if all(n in local for n in names):
            return manager
    # A name that no built-in YAML file even mentions is unknown: seconds, not the minute
    # the full index takes.
    unknown = _unmentioned([n for n in names if n not in local])
    if unknown:
        raise UsageError(f"unknown task {', '.join(map(repr, unknown))}: not {where}")
    manager = TaskManager(include_path=include_path)
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise UsageError(f"unknown task {', '.join(map(repr, unknown))}: not {where}")
    return manager


def _unmentioned(names: list[str]) -> list[str]:
    """The names that appear as a word in none of the harness's built-in task YAML files."""
    import re

    import lm_eval.tasks

    if not names:
        return []
    pattern = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, names)) + r")(?![\w-])")
    seen = set()
    for directory, _, files in os.walk(os.path.dirname(lm_eval.tasks.__file__)):
        for name in files:
            if name.endswith((".yaml", ".yml")):
                with open(os.path.join(directory, name), encoding="utf-8", errors="replace") as f:
                    seen.update(pattern.findall(f.read()))
                if len(seen) == len(names):
                    return []
    return [n for n in names if n not in seen]


def prepare(
    tasks: str, include_path: str | None, num_fewshot: int | None, limit: float | None
) -> TaskRequest:
    """The --tasks request, checked before any model is loaded: UsageError (one line) for a
    missing extra, a bad path, an unknown task or a bad count."""
    require_lm_eval()
    names = parse_tasks(tasks)
    if num_fewshot is not None and num_fewshot < 0:
        raise UsageError(f"--num_fewshot={num_fewshot} must be >= 0")
    if limit is not None and not 0 < limit < float("inf"):  # NaN fails both comparisons
        raise UsageError(
            f"--limit={limit} must be a finite number > 0 (N examples, or a fraction below 1)"
        )
    with _harness_settings():
        manager = task_manager(names, include_path)
    return TaskRequest(names, manager, num_fewshot, limit)


# The hub is never asked for a model or a tokenizer; tokenizers' own threads stay off (the
# harness forks its workers). The user's values win.
_HARNESS_ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@contextlib.contextmanager
def _harness_settings():
    """While the harness builds or runs tasks: `_HARNESS_ENV`, and its logger at ERROR (it
    warns at length about every local task's custom loader; errors stay). Put back after."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    saved = {name: os.environ.get(name) for name in _HARNESS_ENV}
    for name, value in _HARNESS_ENV.items():
        os.environ.setdefault(name, value)
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run_tasks(
    lm,
    names: list[str],
    *,
    manager=None,
    include_path: str | None = None,
    num_fewshot: int | None = None,
    limit: float | None = None,
    log_samples: bool = False,
) -> dict:
    """The harness's results dict (`simple_evaluate`) for `lm` on tasks `names`."""
    with _harness_settings():
        import lm_eval

        manager = manager or task_manager(names, include_path)
        return lm_eval.simple_evaluate(
            model=lm,
            tasks=names,
            task_manager=manager,
            num_fewshot=num_fewshot,
            limit=limit,
            log_samples=log_samples,
            torch_random_seed=None,  # no torch here
        )


def write_results(results: dict, path: str) -> None:
    """`results` as the harness's CLI writes them (its serializer; samples left out)."""
    from lm_eval.utils import handle_non_serializable

    from nnx_zoo.runtime.files import write_json_atomic

    record = {k: v for k, v in results.items() if k != "samples"}
    write_json_atomic(path, json.loads(json.dumps(record, default=handle_non_serializable)))


def summary(results: dict) -> list[str]:
    """One line per task: its metrics."""
    lines = []
    for task, metrics in results["results"].items():
        shown = ", ".join(
            f"{k.split(',')[0]} {v:.4f}"
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and "stderr" not in k and k != "sample_len"
        )
        lines.append(f"{task}: {shown}")
    return lines


@dataclasses.dataclass(frozen=True)
class TaskRequest:
    """eval_main's --tasks, --include_path, --num_fewshot, --limit (checked by `prepare`)."""

    names: list[str]
    manager: object  # lm_eval.tasks.TaskManager
    num_fewshot: int | None = None
    limit: float | None = None  # examples per task: N, or a fraction when < 1


def check_strategy(tasks: TaskRequest, strategy: str) -> None:
    """UsageError (one line) when `strategy` cannot generate (a pipeline's, a context-parallel
    one: zoo.generate.check_can_generate) and a requested task does (output_type
    generate_until). The tasks are built to read their type only in that case."""
    from shardings import get_strategy
    from zoo.generate import check_can_generate

    get_strategy(strategy)  # an unknown name is its own error
    try:
        check_can_generate(strategy)
    except ValueError:
        with _harness_settings():
            built = tasks.manager.load(tasks.names)["tasks"]
        generating = sorted(n for n, t in built.items() if t.OUTPUT_TYPE == "generate_until")
        if generating:
            shown = ", ".join(generating[:3]) + (
                f" and {len(generating) - 3} more" if len(generating) > 3 else ""
            )
            check_can_generate(strategy, what=f"--tasks: {shown} (output_type generate_until)")


def evaluate(request, tasks: TaskRequest, seed: int = 0):
    """(results, EvalResult): the harness's results for the request's model (loaded as for
    the held-out metrics), and what eval_main prints beside them. `seed` draws the samples of
    sampled `generate_until` tasks (the same seed, the same text)."""
    from nnx_zoo.checkpoint.workdir import check_writable_everywhere
    from nnx_zoo.evaluation import run
    from nnx_zoo.evaluation.harness_lm import ZooLM

    strategy = request.overrides.get("strategy")
    if strategy:
        check_strategy(tasks, strategy)  # before reading the checkpoint
    check_writable_everywhere(request.workdir)  # before the work, not after it
    settings, tokenizer, model, mesh, step = run.load(request)
    if not strategy:
        check_strategy(tasks, settings.strategy)  # the run's own: still before any task runs
    # A run's context is the length it trained at (--seq_len overrides); an HF model's, the
    # length its config allows (the hf backend reads max_position_embeddings).
    seq_len = request.overrides.get("seq_len")
    max_length = seq_len or (None if request.hf_checkpoint else settings.seq_len)
    lm = ZooLM(model, mesh, tokenizer, rows=settings.batch_size, max_length=max_length, seed=seed)
    limit = tasks.limit
    if limit is not None and limit >= 1:
        limit = int(limit)
    results = run_tasks(
        lm, tasks.names, manager=tasks.manager, num_fewshot=tasks.num_fewshot, limit=limit
    )
    return results, run.EvalResult(request, settings, mesh, step, None, None)


def report(results: dict, result) -> str | None:
    """Print one line per task, then write the harness's results JSON beside eval.json."""
    import jax

    if jax.process_index() != 0:
        return None
    from nnx_zoo.evaluation import run

    request = result.request
    what, where = run.heading(result)
    for line in summary(results):
        print(f"{what}: {line} ({where})", flush=True)
    path = os.path.join(request.workdir, RESULTS_FILE)
    try:
        write_results(results, path)
    except OSError as e:
        raise OSError(
            f"cannot write {path} ({e.strerror or e}); the result is printed above"
        ) from e
    print(f"wrote {path}", flush=True)
    return path
