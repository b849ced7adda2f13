"""Llama 3.1 8B at its real shapes (zoo preset 'llama3.1-8b'), for a multi-node cluster.

As with llama3_1b.py: give `--config.data.tokenizer` (Llama 3's tokenizer.json) and
`--config.data.source`. At 8k tokens per row the activations need full rematerialisation.
"""

from configs import base_config


def get_config():
    c = base_config()
    c.name = "llama3_8b"
    m = c.model
    m.preset = "llama3.1-8b"  # V=128256 M=4096 L=32 N=32 K=8 D=128 F=14336
    m.dtype = "bfloat16"  # compute in bf16; parameters and Adam moments stay float32
    m.remat = "full"  # recompute each block in the backward pass: O(1) saved activations/layer
    # splash on TPU, cuDNN fused attention on GPU (packed rows: the document mask as a bias),
    # xla on CPU; KV-cache decode steps run on xla everywhere.
    m.attention_impl = "auto"

    d = c.data
    d.tokenizer = "byte"  # replace with Llama 3's tokenizer.json
    d.seq_len = 8192
    d.global_batch_size = 512  # 4M tokens per step, as in Llama 3 pretraining
    d.num_workers = 8

    o = c.optimizer
    o.learning_rate = 3e-4  # Llama 3 8B's peak rate
    o.warmup_steps = 2000
    o.end_learning_rate_ratio = 0.1
    o.weight_decay = 0.1
    o.micro_batches = 4  # 128 rows per pass: accumulate to 512 within device memory

    t = c.training
    t.steps = 250_000
    t.sharding_strategy = "fsdp_tp"  # FSDP over nodes' data axis, TP inside a node
    t.eval_every = 2000
    t.eval_batches = 16

    c.checkpoint.every = 1000
    c.checkpoint.keep = 2  # ~100 GB each with Adam moments
    c.logging.log_every = 50
    c.lock()
    return c
