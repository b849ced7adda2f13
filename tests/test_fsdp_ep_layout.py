"""fsdp_ep splits the dense weights over `expert` too (MaxText's and DeepSpeed-MoE's expert
axis doubling as a data axis for the non-expert parameters): on its default mesh for 8
experts on 8 devices (data 1 x expert 8) the attention, router, embedding and head weights
were whole on every device before (gpt-oss-20b: 62.4 GiB of state per H100 against fsdp's
39.05). From the layouts alone (abstract build, no compile: ~2 s); that the numbers do not
change is tests/test_moe_strategies.py's (fsdp_ep on 1x8 and 2x4 equal one device)."""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from nnx_zoo.planning.chips import chip_for
from nnx_zoo.planning.compile import Candidate, Target, layout_state_bytes
from nnx_zoo.training.config import RunConfig
from shardings import get_strategy
from zoo import get_config


def test_dense_weights_are_fsdp_over_data_and_expert():
    lm = get_strategy("fsdp_ep").lm_sharding()
    both = ("data", "expert")
    assert lm.block.attention.q.weight == P(both, None, None)
    assert lm.block.attention.o.weight == P(None, None, both)
    assert lm.block.moe.router.weight == P(both, None)
    assert lm.lm_head.weight == P(both, None)
    # The experts: E over `expert`, so their M over `data` alone (an axis splits one dim).
    assert lm.block.moe.gate == P("expert", "data", None)
    assert lm.block.moe.down == P("expert", None, "data")
    # fsdp_tp_ep is unchanged: its expert axis splits the experts only.
    tp_ep = get_strategy("fsdp_tp_ep").lm_sharding()
    assert tp_ep.block.attention.q.weight == P("data", "model", None)


def test_default_mesh_holds_no_more_state_than_fsdp():
    cfg = get_config("qwen3-moe-tiny")
    ep = get_strategy("fsdp_ep")
    assert ep.default_mesh_shape(8, cfg) == (1, 8)
    run = RunConfig.from_config_dict(
        {"model": {"preset": "qwen3-moe-tiny"}, "data": {"seq_len": 64, "global_batch_size": 8}}
    )
    target = Target("cpu:8", tuple(jax.devices()), chip_for("cpu", memory_gib=16))
    ep_state = layout_state_bytes(run, Candidate("fsdp_ep", (1, 8), "full", 1), target)
    fsdp_state = layout_state_bytes(run, Candidate("fsdp", (8,), "full", 1), target)
    # Every matrix split 8 ways under both; only the (replicated) norms and biases differ.
    total = ep_state.params + ep_state.optimizer + ep_state.gradients
    assert total <= 1.02 * (fsdp_state.params + fsdp_state.optimizer + fsdp_state.gradients)
