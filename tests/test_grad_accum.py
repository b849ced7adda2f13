"""Gradient accumulation through the real train step.

tests/test_optim.py checks `accumulate_gradients` on its own; this checks the step train_main
runs (Llama model, fsdp_tp on 8 devices, clipping and AdamW): k micro-batches of B/k rows give
the same step as one batch of B rows, step after step.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from _train_helpers import SMALL_RUN, run_config
from flax import nnx

from nnx_zoo import data
from nnx_zoo.data.tokenizers import make_tokenizer
from nnx_zoo.runtime.distributed import to_global
from nnx_zoo.training import optim
from nnx_zoo.training.loop import Trainer
from shardings import get_strategy
from zoo import create_model

STEPS = 3


def _losses(num_micro_batches: int) -> tuple[list[float], list[float]]:
    run = run_config(SMALL_RUN)
    strategy = get_strategy("fsdp_tp")
    model_cfg = run.model.decoder_config()
    mesh = strategy.make_mesh(config=model_cfg)
    batches = data.make_dataset(
        "default", "train", make_tokenizer("byte"), run.data.seq_len, run.data.global_batch_size
    )
    losses, grad_norms = [], []
    with jax.set_mesh(mesh):
        model = create_model(model_cfg, strategy, rngs=nnx.Rngs(0))
        tx, _ = optim.make_optimizer(learning_rate=1e-2, warmup_steps=0, total_steps=STEPS)
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        trainer = Trainer(
            model,
            optimizer,
            micro_batches=num_micro_batches,
            batch_spec=strategy.batch_spec(),
        )
        for _ in range(STEPS):
            metrics = trainer.train_step(to_global(next(batches), mesh, strategy.batch_spec()))
            losses.append(float(metrics["loss"]))
            grad_norms.append(float(metrics["grad_norm"]))
    return losses, grad_norms


def test_micro_batches_equal_one_big_batch():
    # B=16 rows, k=4: 4 rows per micro-batch, one per device of the data axis (size 4).
    one_loss, one_norm = _losses(1)
    acc_loss, acc_norm = _losses(4)
    # The same token sums in another order (per micro-batch, then across them): float32
    # reassociation, ~1e-7 relative, carried through 3 Adam steps. A per-micro-batch mean
    # of means (the usual mistake) differs by ~1e-3 here (rows hold different token counts).
    np.testing.assert_allclose(acc_loss, one_loss, rtol=2e-5)
    np.testing.assert_allclose(acc_norm, one_norm, rtol=2e-5)
    assert one_loss[0] - one_loss[-1] > 0.1  # the steps changed the model


def test_micro_batches_must_split_the_batch_evenly():
    run = run_config({**SMALL_RUN, "data.global_batch_size": 16})
    with pytest.raises(ValueError, match="micro_batches"):
        type(run)(**{**vars(run), "optimizer": type(run.optimizer)(micro_batches=3)})
