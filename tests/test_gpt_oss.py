"""GPT-OSS against transformers' GptOssForCausalLM on a random tiny float32 config whose
every feature is live: attention sinks, q/k/v/o, router and expert biases (all drawn away
from zero), the clamped SwiGLU (weights large enough that the clamp at 7 bites), YaRN RoPE
(factor 4 over an original 16 tokens) and a window of 5 on the sliding layers, shorter than
the rows. Checked: logits unpacked and packed (segment ids), the HF export read back by
transformers and by us, greedy KV-cache generation token for token against `generate`, the
serving engine's and HTTP app's completion, 10 AdamW steps under fsdp_ep, fsdp_tp_ep and
fsdp_tp equal to one device, splash with sinks (interpret mode) against xla, and the refusals
(cuDNN, context parallelism); MXFP4 checkpoints: tests/test_hub_quantized.py.

Tolerances: both sides float32, differing by summation order: logits within 2e-4 of the
largest (seen: about 1e-6); a dropped sink or bias, a wrong interleave of gate/up, or a
window off by one moves them by 1e-2 or more (checked below for the sinks and the window).
"""

from __future__ import annotations

import json

import _entry
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from model_utils import host_params, load_params, one_device_mesh, packed_batch, put_batch

import zoo
from nnx_zoo.errors import UsageError
from shardings import get_strategy
from zoo.generate import generate
from zoo.layers.attention import CallInfo, Segments, attention

REL = 2e-4
V, T = 384, 12  # V holds ByteTokenizer's 257 ids, for the serving check
WINDOW = 5
HF_CONFIG = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=WINDOW,
    max_position_embeddings=64,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 16,
        "rope_theta": 150000.0,
    },
)


def _rel(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """(transformers model, its save_pretrained directory). The checks that need no reference
    (training equality, splash, the refusals) run without torch, on the newest leg too."""
    global torch, transformers
    torch = pytest.importorskip("torch", reason="the reference is torch + transformers")
    transformers = pytest.importorskip("transformers", reason="the reference is transformers")
    torch.manual_seed(0)
    config = transformers.GptOssConfig(**HF_CONFIG)
    config._attn_implementation = "eager"
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 or name.endswith("_bias"):  # norms, biases, sinks
                p.add_(0.3 * torch.randn_like(p))
            elif "embed" in name:
                p.normal_(0, 0.5)
            else:  # experts [E, in, out], linears [out, in]: fan-in scaled, the clamp bites
                fan_in = p.shape[1] if "experts" in name else p.shape[-1]
                p.normal_(0, 2.5 / fan_in**0.5 if "experts" in name else 1 / fan_in**0.5)
    path = tmp_path_factory.mktemp("gpt_oss_hf")
    model.save_pretrained(path)
    return model, str(path)


@pytest.fixture(scope="module")
def ours(hf):
    """Our model of the HF directory on one device, and its mesh."""
    mesh = one_device_mesh()
    with jax.set_mesh(mesh):
        model = zoo.from_pretrained(hf[1], get_strategy("dp"))
    return model, mesh


def _hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids), dtype=torch.long)).logits.numpy()


def _logits(model, mesh, tokens, segment_ids, positions):
    with jax.set_mesh(mesh):
        call = nnx.jit(lambda m, t, s, p: m(t, segment_ids=s, positions=p))
        return np.asarray(
            call(model, *(jnp.asarray(a, jnp.int32) for a in (tokens, segment_ids, positions)))
        )


def test_config_is_read_with_every_feature_live(ours):
    cfg = ours[0].cfg
    assert isinstance(cfg, zoo.registry.FAMILIES["gpt_oss"].config_cls)
    assert cfg.layer_windows() == [WINDOW, 0]
    assert cfg.rope_scaling == (4.0, 32.0, 1.0, 16, False)
    assert cfg.attention_sinks and cfg.attention_bias and cfg.moe_bias
    assert cfg.moe_activation == "clamped_swiglu"


def test_logits_unpacked_and_packed_equal_transformers(hf, ours):
    hf_model, _ = hf
    model, mesh = ours
    rng = np.random.default_rng(0)
    ids = rng.integers(0, V, (2, T))
    ones = np.ones((2, T), np.int32)
    pos = np.tile(np.arange(T), (2, 1))
    want = _hf_logits(hf_model, ids)
    got = _logits(model, mesh, ids, ones, pos)
    assert _rel(got, want) < REL
    # A wrong window, or no sinks, is far outside the tolerance (the features are live).
    hf_model.config.sliding_window = 1000
    assert _rel(_hf_logits(hf_model, ids), want) > 1e-2
    hf_model.config.sliding_window = WINDOW
    with torch.no_grad():
        sinks = [layer.self_attn.sinks.clone() for layer in hf_model.model.layers]
        for layer in hf_model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
        assert _rel(_hf_logits(hf_model, ids), want) > 1e-2
        for layer, s in zip(hf_model.model.layers, sinks, strict=True):
            layer.self_attn.sinks.copy_(s)
    # Packed: documents of 7, 9 and 4 tokens (two longer than the window), then padding; each
    # document's logits are transformers' on that document alone.
    lengths = [7, 9, 4]
    docs = [rng.integers(0, V, n) for n in lengths]
    row = 24
    tokens = np.zeros((1, row), np.int64)
    seg = np.zeros((1, row), np.int32)
    pos = np.zeros((1, row), np.int32)
    start = 0
    for d, doc in enumerate(docs):
        tokens[0, start : start + len(doc)] = doc
        seg[0, start : start + len(doc)] = d + 1
        pos[0, start : start + len(doc)] = np.arange(len(doc))
        start += len(doc)
    got = _logits(model, mesh, tokens, seg, pos)[0]
    start = 0
    for doc in docs:
        want = _hf_logits(hf_model, doc[None])[0]
        assert _rel(got[start : start + len(doc)], want) < REL
        start += len(doc)


def test_export_is_read_back_by_transformers_and_by_us(hf, ours, tmp_path):
    hf_model, hf_dir = hf
    model, mesh = ours
    out = tmp_path / "export"
    with jax.set_mesh(mesh):
        zoo.save_pretrained(model, str(out))
    hf_config = json.loads((out / "config.json").read_text())
    assert hf_config["architectures"] == ["GptOssForCausalLM"]
    assert hf_config["rope_parameters"]["rope_type"] == "yarn"
    back = transformers.GptOssForCausalLM.from_pretrained(str(out)).eval()
    theirs = dict(hf_model.state_dict())
    for name, tensor in back.state_dict().items():  # the same tensors, bit for bit
        assert torch.equal(tensor, theirs[name]), name
    with jax.set_mesh(mesh):
        again = zoo.from_pretrained(str(out), get_strategy("dp"))
    a, b = host_params(model), host_params(again)
    assert set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)


def test_greedy_generation_equals_transformers_generate(hf, ours):
    """Prompt + new tokens cross the window, so the cache's sliding layer drops keys."""
    hf_model, _ = hf
    model, mesh = ours
    prompts = [[5, 17, 200, 3, 99, 42, 7], [300, 1, 2]]
    new = 10
    with jax.set_mesh(mesh):
        got = generate(model, prompts, max_new_tokens=new)
    for prompt, tokens in zip(prompts, got, strict=True):
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([prompt]), max_new_tokens=new, do_sample=False, pad_token_id=0
            )
        assert tokens == out[0, len(prompt) :].tolist()


def test_serving_engine_answers_as_generate():
    """serve_main's engine and HTTP app, in-process, on a tiny GPT-OSS moved away from its
    init (sinks, biases and all): its completion is zoo.generate's, across the window of 8."""
    pytest.importorskip("uvicorn")  # the serve extra
    from _serving_helpers import http_server, perturbed_model, post_json

    from nnx_zoo.data.tokenizers import ByteTokenizer
    from nnx_zoo.serving.api import create_app
    from nnx_zoo.serving.engine import Engine
    from nnx_zoo.serving.slots import Slots

    mesh = one_device_mesh()
    model = perturbed_model(zoo.get_config("gpt-oss-tiny"), get_strategy("dp"), mesh)
    prompt = list(b"sinks!")
    with jax.set_mesh(mesh):
        want = generate(model, [prompt], max_new_tokens=8)[0]
    engine = Engine(Slots(model, max_batch=2, max_seq_len=32), ByteTokenizer(), max_queue=4)
    engine.start()
    try:
        (stream,) = engine.generate([prompt], max_tokens=8, ignore_eos=True)
        with http_server(create_app(engine, served_model="gpt-oss")) as port:
            ask = {"model": "gpt-oss", "prompt": "sinks!", "max_tokens": 8, "temperature": 0}
            status, body = post_json(port, {**ask, "ignore_eos": True})
    finally:
        engine.stop()
    assert stream.ids == want
    assert status == 200, body
    assert body["choices"][0]["text"] == ByteTokenizer().decode(want)


# --- training under the expert-parallel strategies equals one device -------------------

STEPS = 10  # the count: the compiled step is the cost, not the steps
STRATEGIES = [("fsdp_ep", (2, 4)), ("fsdp_tp_ep", (2, 2, 2)), ("fsdp_tp", (4, 2))]


def _train(cfg, name, mesh, init=None):
    strategy = get_strategy(name)
    batch_np = packed_batch(batch=8, seq=16, vocab=cfg.vocab_size)
    with jax.set_mesh(mesh):
        model = zoo.create_model(cfg, strategy, rngs=nnx.Rngs(0))
        if init is not None:
            load_params(model, init)
        params = host_params(model)
        batch = put_batch(batch_np, strategy.batch_spec())
        optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)

        @nnx.jit
        def step(model, optimizer, batch):
            def loss_fn(model):
                out = model.nll_sum(
                    batch["tokens"], segment_ids=batch["segment_ids"], positions=batch["positions"]
                )
                aux = out.router_stats.aux_loss * cfg.router_aux_loss_coef
                return out.total / out.count + aux

            loss, grads = nnx.value_and_grad(loss_fn)(model)
            optimizer.update(model, grads)
            return loss

        losses = [float(step(model, optimizer, batch)) for _ in range(STEPS)]
    return params, losses


@pytest.fixture(scope="module")
def trained():
    # The reference test's sizes (4 experts: fsdp_ep's expert axis 4 holds one each).
    cfg = zoo.get_config(
        "gpt-oss-tiny",
        vocab_size=V,
        hidden_dim=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        ffn_dim=16,
        moe_ffn_dim=16,
        num_experts=4,
        sliding_window=WINDOW,
        router_aux_loss_coef=0.1,
    )
    params, ref = _train(cfg, "dp", one_device_mesh())
    runs = {
        name: _train(cfg, name, get_strategy(name).make_mesh(shape=shape), params)[1]
        for name, shape in STRATEGIES
    }
    return ref, runs


@pytest.mark.parametrize("name", [n for n, _ in STRATEGIES])
def test_adamw_steps_equal_one_device(trained, name):
    ref, runs = trained
    assert ref[-1] < ref[0] - 0.05  # it learns
    np.testing.assert_allclose(runs[name], ref, rtol=1e-4, atol=0)


# --- attention backends -----------------------------------------------------------------


def _attention_call(impl, q, k, v, sinks, segments, window):
    return attention(
        q,
        k,
        v,
        segments,
        scale=q.shape[-1] ** -0.5,
        out_sharding=None,
        sliding_window=window,
        implementation=impl,
        interpret=True,
        sinks=sinks,
    )


def test_splash_takes_sinks_in_interpret_mode():
    """splash's own `sinks` input equals the xla path: forward and every gradient, packed
    rows (two documents, then padding) and a window."""
    B, S, N, K, D = 2, 128, 4, 2, 16
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (B, S, N, D))
    k, v = (jax.random.normal(x, (B, S, K, D)) for x in keys[1:3])
    sinks = jax.random.normal(keys[3], (N,))
    lengths = (70, 50, 8)
    ids = np.concatenate([np.full(n, i) for i, n in zip((1, 2, 0), lengths, strict=True)])
    pos = np.concatenate([np.arange(n) for n in lengths])
    segments = Segments.self_attention(
        jnp.asarray(np.tile(ids, (B, 1)), jnp.int32), jnp.asarray(np.tile(pos, (B, 1)), jnp.int32)
    )
    valid = jnp.asarray(ids != 0)[None, :, None, None]

    def loss(impl, *args):
        out = _attention_call(impl, *args, segments, 16)
        return jnp.sum(jnp.where(valid, out, 0.0) ** 2)

    args = (q, k, v, sinks)
    want = jax.value_and_grad(lambda *a: loss("xla", *a), argnums=(0, 1, 2, 3))(*args)
    got = jax.value_and_grad(lambda *a: loss("splash", *a), argnums=(0, 1, 2, 3))(*args)
    assert _rel(got[0], want[0]) < 1e-5
    for g, w in zip(got[1], want[1], strict=True):
        assert _rel(g, w) < 1e-5


def test_cudnn_refuses_sinks_by_name_and_auto_on_gpu_runs_xla():
    from zoo.layers.attention import dispatch

    q = jnp.zeros((1, 8, 4, 8))
    k = jnp.zeros((1, 8, 2, 8))
    seg = Segments.self_attention(jnp.ones((1, 8), jnp.int32), jnp.arange(8)[None])
    with pytest.raises(UsageError, match="attention-sink"):
        _attention_call("cudnn", q, k, k, jnp.zeros(4), seg, None)
    # `auto`'s choice for a bf16 GPU call: cuDNN could run it, but not with sinks.
    gpu = CallInfo(dtype=jnp.bfloat16, head_dim=64, q_len=8, kv_len=8, platform="gpu")
    assert dispatch._auto(gpu, q, k, seg, None)[0] == "cudnn"
    name, why = dispatch._auto(gpu, q, k, seg, None, True)
    assert name == "xla" and "attention-sink" in why


def test_context_parallel_all_gather_takes_sinks_ring_refuses():
    """fsdp_cp (data 4 x context 2): all_gather's logits equal one device's, packed rows
    crossing the chunks; the ring refuses the sinks with a UsageError."""
    from _serving_helpers import perturbed_model

    cfg = zoo.get_config("gpt-oss-tiny")
    batch_np = packed_batch(batch=4, seq=16, vocab=cfg.vocab_size)
    one = one_device_mesh()
    reference = perturbed_model(cfg, get_strategy("dp"), one)
    want = _logits(reference, one, *batch_np.values())
    strategy = get_strategy("fsdp_cp")
    mesh = strategy.make_mesh(shape=(4, 2))
    for method in ("all_gather", "ring"):
        with jax.set_mesh(mesh):
            batch = put_batch(batch_np, strategy.batch_spec())
            model = zoo.create_model(
                cfg.replace(context_parallel=method), strategy, rngs=nnx.Rngs(0)
            )
            load_params(model, host_params(reference))
            args = (batch["tokens"],)
            kwargs = dict(segment_ids=batch["segment_ids"], positions=batch["positions"])
            if method == "ring":
                with pytest.raises(UsageError, match="sinks .* context_parallel='ring'"):
                    model(*args, **kwargs)
            else:
                assert _rel(np.asarray(model(*args, **kwargs)), want) < REL


def test_published_presets():
    """OpenAI's model card: gpt-oss-20b 20.91B params, 3.61B active per token; gpt-oss-120b
    116.83B, 5.13B active (the active count takes the LM head, not the embedding, as
    `matmul_params` does)."""
    for preset, total, active in (
        ("gpt-oss-20b", 20.91e9, 3.61e9),
        ("gpt-oss-120b", 116.83e9, 5.13e9),
    ):
        cfg = zoo.get_config(preset)
        assert abs(cfg.num_params() / total - 1) < 0.001, preset
        assert abs(cfg.matmul_params() / active - 1) < 0.002, preset
        assert cfg.layer_windows()[:3] == [128, 0, 128]


def test_explain_shows_every_new_parameter():
    proc = _entry.explain(["--model=gpt-oss-tiny", "--strategies=fsdp_ep,fsdp_tp_ep"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {line.split()[0]: line.split()[2:] for line in proc.stdout.splitlines() if "/" in line}
    assert rows["blocks/attention/sinks"] == ["2", "8", "2", "8"]  # replicated under both
    assert rows["blocks/moe/gate_bias"] == ["2", "8/expert", "64", "2", "8/expert", "64/model"]
    assert rows["blocks/moe/down_bias"][:3] == ["2", "8/expert", "64"]
    for name in ("q/bias", "k/bias", "v/bias", "o/bias"):
        assert f"blocks/attention/{name}" in rows
    assert "blocks/moe/router/bias" in rows and "blocks/moe/up_bias" in rows


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_table_and_attention_factor_equal_transformers(truncate):
    """The published models' YaRN (factor 32 over 4096 tokens, head dim 64), truncated or not,
    against transformers' `_compute_yarn_parameters`; the ramp is live (differs from both the
    plain and the fully interpolated table)."""
    pytest.importorskip("transformers", reason="the reference is transformers")
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    from zoo.layers import rope

    scaling = (32.0, 32.0, 1.0, 4096, truncate)
    rope_parameters = {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 4096,
        "truncate": truncate,
    }
    config = GptOssConfig(rope_parameters=rope_parameters)
    inv_freq, factor = _compute_yarn_parameters(config)
    ours = rope.inverse_frequencies(64, 150000.0, scaling)
    np.testing.assert_allclose(ours, inv_freq.numpy(), rtol=1e-6, atol=0)
    assert rope.attention_factor(scaling) == pytest.approx(factor, rel=1e-12)
    plain = rope.inverse_frequencies(64, 150000.0)
    assert not np.allclose(ours, plain) and not np.allclose(ours, plain / 32)
