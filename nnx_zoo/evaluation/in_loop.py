"""lm-evaluation-harness tasks inside training (the run config's `eval` section).

    run_tasks = make(run, strategy_name, mesh, tokenizer)   # checks; UsageError in one line
    scores = run_tasks(model)   # {"lm_eval/zoo_facts/acc": 0.25, ...}

The training loop calls `run_tasks` every `eval.every` steps (and at the end) with its own
model, the parameters it trains (nnx_zoo/training/loop.py syncs them; nothing is copied or
gathered), on the run's mesh and strategy. Everything else is what `eval_main --tasks` does on
that step's checkpoint: the same LM (nnx_zoo/evaluation/harness_lm.py) with the run's tokenizer,
rows of the run's global batch size, the run's sequence length as the context, and the same
harness call, so the scores are the same (tests/test_in_loop_evals.py).

The train_main entry point passes `make` to nnx_zoo/launch/session.py (launch may not import
evaluation; docs/ARCHITECTURE.md).
"""

from __future__ import annotations

from collections.abc import Callable

from flax import nnx

from nnx_zoo.errors import UsageError
from nnx_zoo.evaluation import harness
from nnx_zoo.training.config import RunConfig

PREFIX = "lm_eval/"


def make(run: RunConfig, strategy_name: str, mesh, tokenizer) -> Callable[[object], dict]:
    """model -> scores for the run's `eval.tasks`. UsageError (one line) when lm-eval is
    missing, a task or the include path is unknown, or a generating task meets a strategy
    that cannot generate: raised while the run is prepared, before anything is written."""
    section = run.eval
    include = harness.include_dir(section.include_path) if section.include_path else None
    try:
        tasks = harness.prepare(section.tasks, include, section.num_fewshot, section.limit)
        harness.check_strategy(tasks, strategy_name)
    except UsageError as e:
        # harness's lines name eval_main's flag; here it is a config field.
        why = str(e).replace("--include_path", "eval.include_path")
        raise UsageError(f"config eval.tasks={section.tasks!r}: {why}") from None
    limit = section.limit
    if limit is not None and limit >= 1:
        limit = int(limit)

    def run_tasks(model) -> dict:
        from nnx_zoo.evaluation.harness_lm import ZooLM

        # A view, not a copy: LoRA's dropout off, as eval_main's model has it.
        model = nnx.view(model, deterministic=True, raise_if_not_found=False)
        lm = ZooLM(
            model,
            mesh,
            tokenizer,
            rows=run.data.global_batch_size,
            max_length=run.data.seq_len,
            seed=section.seed,
        )
        results = harness.run_tasks(
            lm, tasks.names, manager=tasks.manager, num_fewshot=tasks.num_fewshot, limit=limit
        )
        return scores(results)

    return run_tasks


def scores(results: dict) -> dict[str, float]:
    """The harness's numeric results as `lm_eval/<task>/<metric>` (`<metric>_<filter>` for a
    filter other than `none`); stderr values the harness could not compute ("N/A") and the
    example counts (`sample_len`) are left out."""
    out = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if key.startswith("sample_len"):  # a count of examples, not a score
                continue
            metric, _, kept = key.partition(",")
            name = metric if kept in ("", "none") else f"{metric}_{kept}"
            out[f"{PREFIX}{task}/{name}"] = float(value)
    return out
