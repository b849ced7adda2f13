"""Qwen3-MoE and Mixtral against transformers (tests/hf_reference/, made by make_reference.py):
logits and the load-balancing loss under dp, fsdp_tp, fsdp_ep (4 experts on expert axes of
2 and 4) and fsdp_tp_ep (expert 2 x model 2), bit-exact export/import, and a checkpoint with
the wrong expert count.

The reference files are read with numpy only (tests/hf_parity.py); neither torch nor
transformers is imported.
"""

from __future__ import annotations

import json
import shutil

import hf_parity as hf
import jax
import numpy as np
import pytest
from flax import nnx

import zoo
from shardings import get_strategy

# The registered mixture-of-experts families with a reference.
FAMILIES = hf.families(moe=True)
# Both sides compute in float32 and differ by summation order (and, sharded, by partial sums
# reduced across devices) -- the same bound as the dense families' parity test. A routing
# convention gotten wrong (top-k renormalisation, one expert fewer) moves these logits by 1.5
# or more (make_reference.py's ablations), so 1e-4 cannot hide one.
ATOL = 1e-4
# The aux loss is a sum of E products of means over 48 rows x 2 layers; float32 rounding
# of those sums stays far below 1e-5 of its value (about 2).
AUX_RTOL = 1e-5
CASES = [
    (family, name, shape)
    for family in FAMILIES
    for name, shape in (
        ("dp", (8,)),
        ("fsdp_tp", (4, 2)),
        ("fsdp_ep", (4, 2)),
        ("fsdp_ep", (2, 4)),
        ("fsdp_tp_ep", (2, 2, 2)),
    )
]


@pytest.mark.parametrize("family,strategy_name,shape", CASES)
def test_logits_and_aux_loss_equal_transformers(family, strategy_name, shape):
    strategy, mesh, model = hf.loaded(family, strategy_name, shape)
    ref = hf.reference(family)
    with jax.set_mesh(mesh):
        forward = nnx.jit(lambda m, t, s, p: m.forward(t, segment_ids=s, positions=p)[::2])
        logits, stats = forward(model, *hf.batch_args(strategy, mesh, ref["input_ids"]))
    diff = np.abs(np.asarray(logits) - ref["logits"]).max()
    assert diff <= ATOL, f"{family} {strategy_name} {shape}: max abs logit diff {diff:.2e}"
    # Tiling the batch repeats every token 4 times: the means, hence the loss, are unchanged.
    np.testing.assert_allclose(float(stats.aux_loss), float(ref["aux_loss"]), rtol=AUX_RTOL)
    hf.assert_declared_layouts(model, strategy, mesh)
    if strategy_name in ("fsdp_ep", "fsdp_tp_ep"):  # each device: E / expert whole experts
        gate = model.blocks.moe.gate.get_value()
        assert gate.addressable_shards[0].data.shape[1] == 4 // mesh.shape["expert"]


@pytest.mark.parametrize("family", FAMILIES)
def test_export_then_import_is_bit_exact(family, tmp_path):
    """fsdp_ep model -> save_pretrained -> the very tensors of the reference checkpoint, and
    from_pretrained onto another strategy -> the very same params."""
    _, _, model = hf.loaded(family, "fsdp_ep", (2, 4))
    hf.assert_export_is_the_reference(model, tmp_path / family, family)
    hf.assert_same_params(model, hf.loaded(family, "fsdp_tp", (4, 2))[2])


@pytest.mark.parametrize("family", FAMILIES)
def test_wrong_expert_count_fails_with_one_line(family, tmp_path):
    """config.json says 8 experts, the weights hold 4 per layer."""
    bad = tmp_path / "bad"
    shutil.copytree(hf.REF / family, bad)
    config = json.loads((bad / "config.json").read_text())
    key = "num_experts" if "num_experts" in config else "num_local_experts"
    config[key] = 8
    (bad / "config.json").write_text(json.dumps(config))
    strategy = get_strategy("dp")
    with jax.set_mesh(strategy.make_mesh()), pytest.raises(ValueError) as err:
        zoo.from_pretrained(str(bad), strategy)
    message = str(err.value)
    assert "\n" not in message
    assert "layer 0 has 4 experts" in message and "num_experts=8" in message, message
