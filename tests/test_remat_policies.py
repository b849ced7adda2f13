"""Every remat policy gives the gradients of no remat, and keeps what it promises.

One compile per policy (the loss and its gradients, a tiny Llama on one device, float32):
the compiled program is run for the gradients and its `memory_analysis` read for the temp
bytes. Rematerialisation recomputes the same float32 ops in the same order, so gradients
agree to rounding (measured: bit-equal or within 1e-7 of the largest entry); 1e-5 is far
below what a dropped or wrong recomputation moves.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _train_helpers import cli_flags, run_train_main
from flax import nnx
from model_utils import one_device_mesh, packed_batch, put_batch

from shardings import get_strategy
from zoo import create_model, get_config
from zoo.build import model_class
from zoo.layers import remat

CFG = get_config("tiny", num_layers=4)
DP = get_strategy("dp")
# Rows long enough that the activations a policy keeps dominate the temp bytes.
BATCH = packed_batch(batch=4, seq=256, vocab=CFG.vocab_size, seed=3, docs_per_row=2)
CPU_POLICIES = tuple(name for name in remat.POLICIES if remat.runs_on(name, "cpu"))
RTOL, ATOL_FRACTION = 1e-5, 1e-5


@pytest.fixture(scope="module")
def results():
    """policy -> (flat gradients, compiled temp bytes)."""
    out = {}
    mesh = one_device_mesh()
    with jax.set_mesh(mesh):
        model = create_model(CFG, DP, rngs=nnx.Rngs(0))
        state = nnx.state(model)
        lm = DP.lm_sharding()
        batch = put_batch(BATCH, DP.batch_spec())
        for name in CPU_POLICIES:
            # The policy lives in the graph definition; the parameters stay those of `model`.
            cfg = CFG.replace(remat=name)
            gd = nnx.graphdef(
                nnx.eval_shape(lambda cfg=cfg: model_class(cfg)(cfg, lm, rngs=nnx.Rngs(0)))
            )

            def loss(state, gd=gd):
                m = nnx.merge(gd, state)
                nll, mask, _ = m.token_nll(
                    batch["tokens"],
                    segment_ids=batch["segment_ids"],
                    positions=batch["positions"],
                    chunk_size=256,
                )
                return jnp.sum(nll) / jnp.sum(mask)

            compiled = jax.jit(jax.grad(loss)).lower(state).compile()
            grads = [np.asarray(g) for g in jax.tree.leaves(compiled(state))]
            out[name] = (grads, compiled.memory_analysis().temp_size_in_bytes)
    return out


@pytest.mark.parametrize("policy", [p for p in CPU_POLICIES if p != "none"])
def test_policy_gives_the_gradients_of_no_remat(results, policy):
    ref, got = results["none"][0], results[policy][0]
    assert len(ref) == len(got)
    for g, r in zip(got, ref, strict=True):
        np.testing.assert_allclose(g, r, rtol=RTOL, atol=ATOL_FRACTION * np.abs(r).max())


def test_temp_bytes_follow_the_promised_order(results):
    """full <= save_qkv_proj <= dots <= none, and remat saves memory at all."""
    temp = {name: results[name][1] for name in CPU_POLICIES}
    assert temp["full"] <= temp["save_qkv_proj"] <= temp["dots"] <= temp["none"], temp
    assert temp["save_out_proj"] <= temp["dots"], temp  # one projection kept of all of them
    assert temp["full"] < 0.5 * temp["none"], temp


def test_every_named_policy_is_known_and_bad_names_are_refused():
    # Only offload needs host memory; every other policy is checked on CPU above.
    assert set(remat.POLICIES) == set(CPU_POLICIES) | {"offload"}
    assert remat.policy("offload") is not None and remat.runs_on("offload", "tpu")
    with pytest.raises(ValueError, match="no rematerialisation"):
        remat.policy("none")
    with pytest.raises(ValueError, match="valid: none, full, dots, save_qkv_proj"):
        get_config("tiny", remat="some")


def test_offload_on_cpu_is_a_usage_error(tmp_path):
    result = run_train_main([f"--workdir={tmp_path}", *cli_flags({"model.remat": "offload"})])
    assert result.returncode == 2, result.stderr[-2000:]
    # Lines other than ours: the CUDA plugin's start-up notes on a machine without CUDA.
    lines = [
        line
        for line in result.stderr.strip().splitlines()
        if not line.startswith(("WARNING: All log messages", "I0000 "))
    ]
    assert len(lines) == 1 and "remat='offload'" in lines[0] and "cpu" in lines[0], lines
