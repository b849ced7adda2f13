"""What eval_main runs: a request in (`EvalRequest`), the model loaded and scored, the result
printed and written to eval.json (`report`).

Every mistake in a request surfaces in `evaluate` as UsageError (one
line); eval_main turns it into exit status 2.
"""

from __future__ import annotations

import dataclasses
import os

import jax

from nnx_zoo.checkpoint.workdir import check_writable_everywhere
from nnx_zoo.errors import UsageError
from nnx_zoo.evaluation import metrics as eval_metrics
from nnx_zoo.evaluation import model as eval_model
from nnx_zoo.evaluation.settings import EvalSettings
from nnx_zoo.runtime.console import warn
from nnx_zoo.runtime.files import write_json_atomic
from zoo.generate import check_can_generate
from zoo.layers.attention import choices as attention_choices

EVAL_FILE = "eval.json"


@dataclasses.dataclass(frozen=True)
class Generation:
    prompt: str
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: all
    seed: int = 0

    def check(self) -> None:
        # `not >= 0` also refuses nan; inf is refused below.
        if self.top_k < 0 or not self.temperature >= 0 or self.max_new_tokens < 1:
            raise UsageError("--top_k and --temperature must be >= 0, --max_new_tokens >= 1")
        if self.temperature == float("inf"):
            raise UsageError("--temperature=inf: must be a finite number >= 0 (0: greedy)")


@dataclasses.dataclass(frozen=True)
class EvalRequest:
    workdir: str
    hf_checkpoint: str | None = None
    step: int | None = None
    evaluate: bool = True  # the held-out metrics; False: only generate
    generation: Generation | None = None
    # Runtime choices over the run's record (None keeps the recorded one); see from_run_info.
    overrides: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class EvalResult:
    request: EvalRequest
    settings: EvalSettings
    mesh: jax.sharding.Mesh
    step: int | None
    metrics: dict | None
    generated: tuple[str, int] | None  # (text, tokens)
    # What each attention call site ran on, and why (attention.choices.to_json).
    attention: dict | None = None


def evaluate(request: EvalRequest) -> EvalResult:
    if not request.evaluate and request.generation is None:
        raise UsageError("--noevaluate leaves nothing to do without --prompt")
    strategy = request.overrides.get("strategy")
    if request.generation is not None and strategy:
        check_can_generate(strategy)  # before reading the checkpoint
    if request.evaluate:
        check_writable_everywhere(request.workdir)  # before the work, not after it
    if request.generation is not None:
        request.generation.check()
    settings, tokenizer, model, mesh, step = load(request)
    if request.generation is not None:
        check_can_generate(settings.strategy)  # the run's own, when no --sharding_strategy
    metrics = None
    with attention_choices.recording() as chosen:
        if request.evaluate:
            metrics = eval_metrics.evaluate(model, mesh, settings, tokenizer)
            metrics = eval_metrics.json_safe(metrics)
        generated = None
        if request.generation is not None:
            generated = _generate(model, mesh, tokenizer, request.generation)
    attention = attention_choices.to_json(chosen)
    return EvalResult(request, settings, mesh, step, metrics, generated, attention)


def load(request: EvalRequest):
    """(settings, tokenizer, model, mesh, step): `eval_model.load` of the request's model
    (also used by --tasks)."""
    return eval_model.load(
        eval_model.LoadRequest(
            request.workdir, request.hf_checkpoint, request.step, request.overrides
        )
    )


def _generate(model, mesh, tokenizer, gen: Generation) -> tuple[str, int]:
    from zoo.generate import generate

    prompt_ids = tokenizer.encode(gen.prompt)
    if not prompt_ids:
        raise UsageError("--prompt is empty after tokenization")
    with jax.set_mesh(mesh):
        new_ids = generate(
            model,
            [prompt_ids],
            max_new_tokens=gen.max_new_tokens,
            temperature=gen.temperature,
            top_k=gen.top_k or None,
            eos_id=tokenizer.eos_id,
            seed=gen.seed,
        )[0]
    return tokenizer.decode(new_ids), len(new_ids)


def record(result: EvalResult) -> dict:
    """eval.json's content."""
    s, request = result.settings, result.request
    out = {
        "step": result.step,
        **result.metrics,
        "data": s.source,
        "split": s.split,
        "eval_batches": s.eval_batches,
        "batch_size": s.batch_size,
        "seq_len": s.seq_len,
        "strategy": s.strategy,
        "mesh_shape": dict(result.mesh.shape),
        "num_devices": jax.device_count(),
        "hf_checkpoint": request.hf_checkpoint,
        "attention": result.attention,
    }
    if result.generated is not None:
        text, tokens = result.generated
        out.update(prompt=request.generation.prompt, generated=text, generated_tokens=tokens)
    return out


def heading(result: EvalResult) -> tuple[str, str]:
    """(what was evaluated, where): 'step 50' or 'hf checkpoint DIR'; 'fsdp_tp on {...}'."""
    request = result.request
    what = (
        f"hf checkpoint {request.hf_checkpoint}" if request.hf_checkpoint else f"step {result.step}"
    )
    return what, f"{result.settings.strategy} on {dict(result.mesh.shape)}"


def report(result: EvalResult) -> str | None:
    """Print the result (before eval.json is written: a failed write must not lose it), then
    write eval.json atomically. Returns its path (None when nothing is written), or raises
    OSError naming the path."""
    if jax.process_index() != 0:
        return None
    request = result.request
    what, where = heading(result)
    if result.metrics is not None:
        print(f"{what}: {eval_metrics.summary(result.metrics)} ({where})", flush=True)
    if result.generated is not None:
        print(f"{request.generation.prompt}{result.generated[0]}", flush=True)
    if result.metrics is None:
        return None
    path = os.path.join(request.workdir, EVAL_FILE)
    try:
        write_json_atomic(path, record(result))
    except OSError as e:
        raise OSError(
            f"cannot write {path} ({e.strerror or e}); the result is printed above"
        ) from e
    print(f"wrote {path}", flush=True)
    if result.metrics["non_finite"]:
        warn(
            f"{', '.join(result.metrics['non_finite'])} not finite (null in eval.json, "
            "listed under non_finite): the parameters have diverged"
        )
    return path
