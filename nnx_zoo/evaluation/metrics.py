"""Held-out metrics of a model: loss, perplexity, bits per byte, over a fixed pass of batches
that is the same on every mesh; and the record eval.json holds."""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from nnx_zoo import data
from nnx_zoo.data.mixture import SOURCE_IDS
from nnx_zoo.errors import UsageError
from nnx_zoo.evaluation.settings import EvalSettings
from nnx_zoo.runtime.distributed import to_global
from nnx_zoo.training.mixture_spec import parse_mixture
from shardings.mesh import check_batch
from shardings.specs import split_size
from zoo import pipelined
from zoo.layers import pipeline
from zoo.loss import answer_mask, target_mask


def evaluate(model, mesh, settings: EvalSettings, tokenizer) -> dict:
    """Loss, perplexity, bits per byte and counts over the settings' batches."""

    if model.cfg.vocab_size < tokenizer.vocab_size:
        raise UsageError(
            f"model vocab_size={model.cfg.vocab_size} is smaller than the tokenizer's "
            f"{tokenizer.vocab_size} ids"
        )
    batch_spec = model.sharding.tokens
    rows = settings.batch_size
    multiple = split_size(batch_spec, 0, mesh.shape)
    pp = pipeline.plan_for(model.cfg, model.sharding, mesh)
    multiple *= pp.microbatches if pp is not None else 1  # rows per pipeline micro-batch
    padded_rows = -(-rows // multiple) * multiple  # same data on every mesh, padding rows added
    check_batch(
        padded_rows,
        batch_spec,
        mesh,
        settings.strategy,
        seq_len=settings.seq_len,
        residual_spec=model.sharding.block.residual,
    )
    common = dict(
        tokenizer=tokenizer,
        seq_len=settings.seq_len,
        global_batch_size=rows,
        shuffle=False,
        num_batches=settings.eval_batches,
        text_field=settings.text_field,
        validation_fraction=settings.validation_fraction,
        data_format=settings.data_format,
        chat_template=_chat_template(settings),
    )
    if settings.mixture:  # the run's val_loss batches: its sources' splits mixed by weight
        components = parse_mixture(settings.mixture)
        dataset = data.build_mixture(components, settings.split, **common)
    else:
        dataset = data.build_dataset(settings.source, settings.split, repeat=False, **common)
    graphdef, state = nnx.split(model)

    @jax.jit
    def nll_sum(state, batch):
        m = nnx.merge(graphdef, state)
        nll_BT, mask_BT, _ = pipelined.token_nll(
            m,
            pp,
            batch["tokens"],
            segment_ids=batch["segment_ids"],
            positions=batch["positions"],
            chunk_size=settings.loss_chunk_size,
        )
        if "loss_mask" in batch:  # chat / instruction data: the answers' tokens only
            mask_BT = answer_mask(mask_BT, batch["loss_mask"])
            nll_BT = jnp.where(mask_BT, nll_BT, 0.0)
        return jnp.sum(nll_BT), jnp.sum(mask_BT)

    total_nll, total_tokens, total_bytes = 0.0, 0, 0
    with jax.set_mesh(mesh):
        for local in dataset:
            local = {k: v for k, v in local.items() if k != SOURCE_IDS}
            short = padded_rows // jax.process_count() - local["tokens"].shape[0]
            if short > 0:
                local = {
                    k: np.concatenate([v, np.zeros((short, v.shape[1]), v.dtype)])
                    for k, v in local.items()
                }
            nll, count = nll_sum(state, to_global(local, mesh, batch_spec))
            total_nll += float(nll)
            total_tokens += int(count)
            # Bytes the predicted (target) tokens stand for; this process's rows, summed over
            # processes below.
            targets_BT, mask_BT = (
                np.asarray(a) for a in target_mask(local["tokens"], local["segment_ids"])
            )
            if "loss_mask" in local:
                mask_BT = mask_BT & (np.roll(local["loss_mask"], -1, axis=1) != 0)
            total_bytes += int(tokenizer.token_num_bytes[targets_BT[mask_BT]].sum())
    if jax.process_count() > 1:
        total_bytes = int(np.sum(multihost_utils.process_allgather(np.int64(total_bytes))))
    if total_tokens == 0:
        raise UsageError(
            f"no tokens to evaluate in {settings.mixture or settings.source!r} ({settings.split})"
        )
    loss = total_nll / total_tokens
    return {
        "loss": loss,
        "perplexity": math.exp(min(loss, 700.0)),
        "bits_per_byte": (total_nll / math.log(2) / total_bytes) if total_bytes else None,
        "tokens": total_tokens,
        "bytes": total_bytes,
    }


def _chat_template(settings):
    if settings.data_format == "text" or settings.tokenizer == "byte":
        return None
    from nnx_zoo.data.chat import ChatTemplate

    return ChatTemplate.from_dir(os.path.expanduser(settings.tokenizer))


def json_safe(metrics: dict) -> dict:
    """`metrics` with every non-finite float as None, plus `non_finite`: the keys that were
    (NaN / inf, from a diverged or damaged model); eval.json stays strict JSON."""
    bad = sorted(k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v))
    out = {k: (None if k in bad else v) for k, v in metrics.items()}
    out["non_finite"] = bad
    return out


def summary(metrics: dict) -> str:
    """One line for the console."""

    def number(key, fmt):
        value = metrics.get(key)
        return "n/a" if value is None else format(value, fmt)

    line = (
        f"loss {number('loss', '.4f')}, perplexity {number('perplexity', '.3f')}, "
        f"bits/byte {number('bits_per_byte', '.4f')}, {metrics['tokens']} tokens"
    )
    if metrics.get("non_finite"):
        line += f" (not finite: {', '.join(metrics['non_finite'])})"
    return line
