"""DeepSeek-V3 (zoo/deepseek_v3/): multi-head latent attention, grouped sigmoid routing with
the correction bias, shared experts and dense first layers.

Against transformers' `DeepseekV3ForCausalLM` on a random tiny float32 checkpoint (YaRN with
mscale != mscale_all_dim, interleaved rope dims, a random correction bias that changes the
choice): logits unpacked and packed, export -> import bit-exact, greedy generation with the
latent KV cache token for token. Without transformers: the strategies that carry it equal one
device for ten AdamW steps, the bias is left exactly as it was, the cache holds the latent,
and what cannot run says so in one line.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_strategies_equal_one_device as equal
from flax import nnx
from model_utils import one_device_mesh

import zoo
from nnx_zoo.data.tokenizers import ByteTokenizer
from nnx_zoo.errors import UsageError
from nnx_zoo.serving.engine import Engine
from nnx_zoo.serving.slots import Slots
from shardings import get_strategy
from zoo import hf_io
from zoo.generate import generate
from zoo.registry import PRESET_DIMS

# A float32 transformers model against ours: summation order only (2e-6 measured).
RTOL = 2e-4
T = 24
# Lengths in both of the engine's buckets (16, 32 columns).
PROMPTS = [
    [5, 9, 200, 31, 7],
    [44, 3],
    [100, 200, 30, 40, 17, 60, 7, 9, 11, 8, 1, 2, 3, 4, 5, 6, 7],
]
NEW_TOKENS = 6


def _hf_config(transformers):
    return transformers.DeepseekV3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        routed_scaling_factor=2.5,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        v_head_dim=16,
        qk_nope_head_dim=16,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        rope_interleave=True,
        max_position_embeddings=256,
        initializer_range=0.1,  # routing far from ties, logits far from uniform
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
        },
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """(transformers model, its checkpoint directory, our model loaded from it)."""
    torch = pytest.importorskip("torch", reason="the transformers reference needs torch")
    transformers = pytest.importorskip("transformers", reason="the reference is transformers'")
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(_hf_config(transformers)).float().eval()
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            # A bias as large as the scores' spread: it changes which experts are chosen.
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    path = tmp_path_factory.mktemp("hf") / "deepseek_v3"
    model.save_pretrained(path)
    strategy = get_strategy("fsdp")
    with jax.set_mesh(one_device_mesh()):
        ours = zoo.from_pretrained(str(path), strategy)
    return model, path, ours


def _hf_logits(model, ids_BT):
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(ids_BT)).logits.numpy()


def _our_logits(model, ids_BT, segment_ids_BT, positions_BT):
    with jax.set_mesh(one_device_mesh()):
        return np.asarray(
            model(
                jnp.asarray(ids_BT, jnp.int32),
                segment_ids=jnp.asarray(segment_ids_BT, jnp.int32),
                positions=jnp.asarray(positions_BT, jnp.int32),
            )
        )


def _assert_close(got, want):
    rel = np.abs(got - want).max() / np.abs(want).max()
    assert rel < RTOL, f"max relative logit difference {rel:.2e}"


def test_logits_equal_transformers(hf):
    model, _, ours = hf
    ids = np.random.default_rng(0).integers(0, 512, (2, T))
    positions = np.broadcast_to(np.arange(T), (2, T))
    _assert_close(_our_logits(ours, ids, np.ones((2, T)), positions), _hf_logits(model, ids))


def test_packed_rows_equal_each_document_alone(hf):
    """One row holding two documents and padding: each document's logits are transformers'
    on that document alone."""
    model, _, ours = hf
    a, b = (np.random.default_rng(s).integers(0, 512, (1, n)) for s, n in ((1, 14), (2, 7)))
    ids = np.zeros((1, T), np.int64)
    ids[0, :14], ids[0, 14:21] = a[0], b[0]
    segment_ids = np.array([[1] * 14 + [2] * 7 + [0] * 3])
    positions = np.array([list(range(14)) + list(range(7)) + [0] * 3])
    got = _our_logits(ours, ids, segment_ids, positions)
    _assert_close(got[:, :14], _hf_logits(model, a))
    _assert_close(got[:, 14:21], _hf_logits(model, b))


def test_export_then_import_is_bit_exact(hf, tmp_path):
    """save_pretrained writes transformers' very tensors (per-expert, the correction bias,
    both layer stacks numbered as one) and from_pretrained reads them back onto fsdp_tp_ep."""
    _, path, ours = hf
    zoo.save_pretrained(ours, str(tmp_path / "out"))
    exported, ref = hf_io.CheckpointReader(str(tmp_path / "out")), hf_io.CheckpointReader(path)
    assert sorted(exported.names()) == sorted(ref.names())
    for name in ref.names():
        assert np.array_equal(exported.read(name), ref.read(name)), name
    assert hf_io.read_config(str(tmp_path / "out")) == hf_io.read_config(str(path))
    strategy = get_strategy("fsdp_tp_ep")
    with jax.set_mesh(strategy.make_mesh(shape=(2, 2, 2))):
        again = zoo.from_pretrained(str(tmp_path / "out"), strategy)
    equal_params = {
        "/".join(map(str, p)): np.asarray(v.get_value())
        for p, v in nnx.to_flat_state(nnx.state(again, nnx.Param))
    }
    for p, v in nnx.to_flat_state(nnx.state(ours, nnx.Param)):
        assert np.array_equal(equal_params["/".join(map(str, p))], np.asarray(v.get_value()))


def test_greedy_generation_equals_transformers(hf):
    """The latent KV cache against transformers' `generate` (which caches the same latent),
    prompt by prompt: zoo.generate (left-padded batch, prefill scanned, decode per layer)
    and the serving engine (serve_main's: per-slot cache columns, prompts of two buckets in
    one batch)."""
    import torch

    model, _, ours = hf
    want = []
    for prompt in PROMPTS:
        with torch.no_grad():
            out = model.generate(
                torch.as_tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False
            )
        want.append(out[0, len(prompt) :].tolist())
    assert generate(ours, PROMPTS, max_new_tokens=NEW_TOKENS) == want
    engine = Engine(Slots(ours, max_batch=4, max_seq_len=32), ByteTokenizer(), max_queue=8)
    engine.start()
    try:
        streams = engine.generate(PROMPTS, max_tokens=NEW_TOKENS, ignore_eos=True)
    finally:
        engine.stop()
    assert [s.ids for s in streams] == want


# --- without transformers --------------------------------------------------------------------

# The layer scans kept rolled: one compiled block per stack (CPU compile time).
CFG = zoo.get_config("deepseek-v3-tiny", scan_unroll=1)
# The expert-parallel strategies (experts over 2 and 4; with F over `model` too) and fsdp_tp
# (heads, the latents' up-projections and every expert's F over `model`).
CASES = [("fsdp_ep", (2, 4)), ("fsdp_tp_ep", (2, 2, 2)), ("fsdp_tp", (4, 2))]


def _run(strategy_name, mesh, init_params=None):
    from test_moe_strategies import _objective

    return equal._run(strategy_name, mesh, init_params, cfg=CFG, objective=_objective)


reference, sharded = equal.equality_fixtures(_run, CASES)


def test_layouts_are_declared(sharded):
    name, run = sharded
    equal.check_parameter_layouts(CFG, sharded)
    for kind, want, live in run["records"]:
        assert live == want, f"{name}: a {kind} returned {live}, declared {want}"
    layouts = run["live_layouts"]
    if name != "fsdp_tp":
        assert layouts["blocks/moe/gate"][1] == "expert"  # [L, E/expert, M, F]
    if name != "fsdp_ep":
        assert layouts["blocks/attention/kv_b/weight"][2] == "model"  # [L, C, N/model, D]


def test_ten_adamw_steps_equal_one_device(sharded, reference):
    equal.assert_step_equals_one_device(sharded[1], reference, scalars=("loss", "aux"))
    equal.assert_adamw_steps_equal_one_device(sharded[1], reference)


def test_correction_bias_takes_no_gradient(reference):
    """The bias picks experts only: its gradient is exactly zero (so AdamW leaves it, and a
    'bias' path is never decayed), while the router's is not."""
    assert not np.any(reference["grads"]["blocks/moe/e_score_correction_bias"])
    assert np.abs(reference["grads"]["blocks/moe/router/weight"]).max() > 0


def test_cache_holds_the_latent():
    """Per token and layer the cache keeps C + r numbers (the latent and the shared rotary
    key), not the expanded N (D + Dv): DeepSeek-V3's 576 against 40960, and 2048 for GQA of
    its width with 8 kv heads of 128 (bench/mla_cache.py prints the table)."""
    with jax.set_mesh(one_device_mesh()):
        model = nnx.eval_shape(
            lambda: zoo.create_model(CFG, get_strategy("fsdp"), rngs=nnx.Rngs(0))
        )
        cache = jax.eval_shape(lambda: model.init_cache(2, 32))
    per_token = (cache.k.size + cache.v.size) * 4 // (2 * 32)
    assert per_token == CFG.num_layers * (CFG.kv_lora_rank + CFG.qk_rope_head_dim) * 4
    assert CFG.cache_bytes_per_token(4) == per_token
    big = zoo.get_config("deepseek-v3")
    assert big.cache_bytes_per_token(1) // big.num_layers == 576


def test_what_cannot_run_says_so():
    splash = zoo.get_config("deepseek-v3-tiny", attention_impl="splash")
    with (
        pytest.raises(UsageError, match="latent attention runs on xla"),
        jax.set_mesh(one_device_mesh()),
    ):
        zoo.create_model(splash, get_strategy("fsdp"), rngs=nnx.Rngs(0))
    with pytest.raises(UsageError, match="head_dim"):
        zoo.get_config("deepseek-v3-tiny", head_dim=32)
    mesh = get_strategy("fsdp_tp").make_mesh(shape=(1, 8))
    with pytest.raises(UsageError) as err:  # 4 heads over model=8
        zoo.check_model_fits(CFG, get_strategy("fsdp_tp"), mesh)
    assert "\n" not in str(err.value)


def test_train_main_logs_the_load_and_moves_the_bias(tmp_path):
    """train_main under fsdp_ep: metrics.jsonl carries each expert's load and correction bias,
    and the bias moves by the rate's sign step per layer and step, towards the less loaded
    experts."""
    records, _ = train_and_check_bias_updates(tmp_path, "fsdp_ep")
    first = records[0]
    # After step 1 an expert loaded above the mean in both layers has bias -rate.
    assert np.array(first["moe_router_bias"])[np.argmax(first["expert_load"])] < 0


def train_and_check_bias_updates(workdir, strategy: str, rate=0.01, steps=3):
    """Three train_main steps of the tiny preset under `strategy` with the bias update on;
    each step's logged bias is a multiple of rate / 2 (the mean of the 2 MoE layers' sign
    steps), nonzero, at most step x rate. (The metrics records, the run's output.)"""
    from _train_helpers import SMALL_RUN, cli_flags, run_train_main

    # The small run's settings, not its model dims (the preset's MLA dims hold together).
    overrides = {
        **{k: v for k, v in SMALL_RUN.items() if not k.startswith("model.")},
        "model.preset": "deepseek-v3-tiny",
        # The base config file's model dims are Llama's: the preset's instead.
        **{f"model.{f}": getattr(CFG, f) for f in PRESET_DIMS},
        "optimizer.warmup_steps": 1,
        "model.scan_unroll": 1,  # one compiled block per stack (CPU compile time)
        "training.steps": steps,
        "training.eval_every": 0,
        "training.moe_bias_update_rate": rate,
        "data.global_batch_size": 8,
    }
    result = run_train_main(
        [f"--sharding_strategy={strategy}", f"--workdir={workdir}", *cli_flags(overrides)]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(f"{workdir}/metrics.jsonl", encoding="utf-8") as f:
        records = [json.loads(line) for line in f if '"loss"' in line]
    assert len(records) == steps and all(np.isfinite(r["loss"]) for r in records)
    for step, record in enumerate(records, start=1):
        load, bias = np.array(record["expert_load"]), np.array(record["moe_router_bias"])
        assert len(load) == 8 and abs(load.sum() - 1) < 1e-3
        halves = bias / (rate / 2)
        np.testing.assert_allclose(halves, np.round(halves), atol=1e-2)
        assert np.abs(bias).max() <= step * rate + 1e-6 and np.abs(bias).max() > 0
    return records, result.stderr + result.stdout


def test_auto_attention_runs_xla_and_says_why():
    from zoo.layers.attention import choices

    cfg = CFG.replace(attention_impl="auto", num_layers=2)
    with jax.set_mesh(one_device_mesh()):
        model = zoo.create_model(cfg, get_strategy("fsdp"), rngs=nnx.Rngs(0))
        ids = jnp.ones((2, 8), jnp.int32)
        with choices.recording() as kept:
            model(ids, segment_ids=ids, positions=jnp.broadcast_to(jnp.arange(8), (2, 8)))
    latent = [c for c in kept if c.asked == "auto"]
    assert latent and all(c.backend == "xla" and "latent attention" in c.why for c in latent)
