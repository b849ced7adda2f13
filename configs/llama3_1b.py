"""Llama 3.2 1B at its real shapes (zoo preset 'llama3.2-1b'), for a GPU/TPU cluster.

Give the tokenizer it was trained with (`--config.data.tokenizer=/path/to/Llama-3.2-1B`, the
directory holding tokenizer.json) and a corpus (`--config.data.source=...`); the defaults only
let the file parse and build anywhere.
"""

from configs import base_config


def get_config():
    c = base_config()
    c.name = "llama3_1b"
    m = c.model
    m.preset = "llama3.2-1b"  # V=128256 M=2048 L=16 N=32 K=8 D=64 F=8192, tied embeddings
    m.dtype = "bfloat16"  # compute in bf16 on accelerators; parameters and Adam stay float32
    m.remat = "dots"  # keep matmul outputs, recompute the rest: fits 8k tokens per row
    # splash on TPU, cuDNN fused attention on GPU (packed rows: the document mask as a bias),
    # xla on CPU; KV-cache decode steps run on xla everywhere.
    m.attention_impl = "auto"

    d = c.data
    d.tokenizer = "byte"  # replace with Llama 3's tokenizer.json (its 128256 ids fit V)
    d.seq_len = 8192  # Llama 3's pretraining context
    d.global_batch_size = 128  # 1M tokens per step
    d.num_workers = 4  # tokenizing a BPE vocabulary is worth worker processes

    o = c.optimizer
    o.learning_rate = 3e-4  # Llama 3 recipe scale for ~1B
    o.warmup_steps = 2000
    o.end_learning_rate_ratio = 0.1
    o.weight_decay = 0.1

    t = c.training
    t.steps = 100_000
    t.sharding_strategy = "fsdp_tp"
    t.eval_every = 1000
    t.eval_batches = 16

    c.checkpoint.every = 1000
    c.logging.log_every = 50
    c.lock()
    return c
