"""Run configs: one `get_config()` per file, each starting from `base_config()` below.

Every field is commented here, once; the files change values and say why. `train_main.py`
loads a file with `--config=configs/<name>.py`, applies `--config.<section>.<field>=value`
overrides (a misspelt field is an error: the ConfigDict is locked), then converts it to the
typed `training.config.RunConfig`, which validates every value.
"""

from ml_collections import ConfigDict
from ml_collections.config_dict import placeholder


def base_config() -> ConfigDict:
    """Defaults shared by every run; unlocked so a config file can change them."""
    c = ConfigDict()
    c.name = "run"  # names the default workdir, ./runs/<name>

    c.model = m = ConfigDict()
    m.preset = "tiny"  # a zoo preset (zoo.get_config): tiny, llama3.2-1b, qwen3-0.6b, gpt2, ...
    # Shape overrides of the preset; None keeps the preset's value.
    m.vocab_size = placeholder(int)  # V; must be >= the tokenizer's vocabulary
    m.hidden_dim = placeholder(int)  # M, residual width
    m.num_layers = placeholder(int)  # L
    m.num_heads = placeholder(int)  # N, query heads
    m.num_kv_heads = placeholder(int)  # K, key/value heads (divides N, and the model axis)
    m.head_dim = placeholder(int)  # D
    m.ffn_dim = placeholder(int)  # F, MLP hidden width
    m.max_seq_len = placeholder(int)  # KV-cache length for generation
    m.dtype = "float32"  # compute dtype, float32 | bfloat16 (parameters stay float32)
    m.scan_layers = True  # stack layers and run them with nnx.scan: one compiled block
    # Layers per scan iteration: 0 = auto (all of them on CPU with remat=none, 10-20% faster
    # there; else 1), 1 = rolled (fastest compile, least memory), n = n per iteration.
    m.scan_unroll = 0
    # What the backward pass recomputes: none | full | dots | save_qkv_proj | save_out_proj |
    # offload (the residual stream to host memory; TPU/GPU only). See zoo/layers/remat.py.
    m.remat = "none"
    # xla (einsums, everywhere) | splash (Pallas flash kernel, TPU) | cudnn (fused attention,
    # NVIDIA GPU, bf16) | auto (splash on TPU, cudnn on GPU, xla on CPU); packed rows on all.
    # --attention_impl overrides; an explicit backend that cannot run here is an error.
    m.attention_impl = "xla"
    m.attention_interpret = False  # run splash in Pallas interpret mode (CPU tests only; slow)
    # Projections (q/k/v/o, MLP) in low precision, forward and backward: none | fp8 (e4m3,
    # e5m2 gradients; cuBLASLt fp8 GEMMs on H100/H200) | int8 (TPU's int8 MXU path).
    m.quantization = "none"

    c.data = d = ConfigDict()
    d.source = "default"  # 'default' (stdlib source text, no download) or a path / dir / glob
    d.tokenizer = "byte"  # 'byte', a tokenizer.json (or its dir), or a SentencePiece .model
    d.text_field = "text"  # JSONL field / Parquet column holding the text
    d.seq_len = 128  # T, tokens per packed row
    d.global_batch_size = 16  # rows per optimizer step, over all processes and micro-batches
    d.num_workers = 0  # Grain worker processes for reading/tokenizing (0: in-process)
    d.shuffle_seed = 0  # seeds document shuffling and packing order
    d.validation_fraction = 0.02  # share of documents held out for validation loss

    c.optimizer = o = ConfigDict()
    o.learning_rate = 3e-4  # peak rate, reached after warmup
    o.warmup_steps = 0  # linear warmup from 0
    o.decay_steps = placeholder(int)  # cosine schedule length incl. warmup; None: training.steps
    o.end_learning_rate_ratio = 0.1  # final rate as a fraction of the peak
    o.weight_decay = 0.1  # decoupled AdamW decay (off for norms and embeddings)
    o.decay_norms_and_embeddings = False  # True: decay every parameter
    o.clip_grad_norm = 1.0  # clip the global gradient norm; <= 0 turns clipping off
    o.b1 = 0.9  # Adam first-moment decay
    o.b2 = 0.95  # Adam second-moment decay
    o.eps = 1e-8  # Adam epsilon
    o.micro_batches = 1  # gradient accumulation: k micro-batches of global_batch_size / k

    c.training = t = ConfigDict()
    t.steps = 100  # optimizer steps in the run
    t.seed = 0  # parameter initialisation seed
    t.sharding_strategy = (
        "fsdp_tp"  # dp | fsdp | tp | fsdp_tp | fsdp_ep (--sharding_strategy overrides)
    )
    t.mesh_shape = ""  # e.g. 'data:4,model:2'; '' = the strategy's default (--mesh_shape overrides)
    t.eval_every = 0  # validation loss every N steps (and at the end); 0: only at the end
    t.eval_batches = 4  # global batches of validation data per evaluation
    # Tokens per device per chunk of the LM head fused with the loss (train and eval): a
    # device holds the logits of this many tokens at a time, never its [B, T, V] share.
    # 0: build the full logits.
    t.loss_chunk_size = 1024

    c.checkpoint = k = ConfigDict()
    k.enabled = True  # save under <workdir>/checkpoints and resume from there
    k.every = 100  # save every N steps (and at the end)
    k.keep = 3  # keep the last N checkpoints
    k.async_save = True  # write in the background; training blocks only for the device->host copy

    c.logging = g = ConfigDict()
    g.log_every = 10  # metrics.jsonl / TensorBoard / progress-bar line every N steps
    g.peak_tflops = placeholder(float)  # per-device peak for MFU; None: table, or measured on CPU
    g.progress_bar = True  # tqdm bar on stderr (process 0)
    return c
