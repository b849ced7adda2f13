"""~100M parameters, for throughput benchmarks (bench/train_throughput.py) and short real runs.

GPT-2-small-like width and depth with Llama blocks: M=768, L=12, N=12 heads over K=4 kv heads
(so tensor parallelism up to 4), F=3072. 104M parameters in the blocks, 0.8M in the byte-level
embedding and head.
"""

from configs import base_config


def get_config():
    c = base_config()
    c.name = "small"
    m = c.model
    m.preset = "tiny"  # the Llama family; every shape below replaces the preset's
    m.vocab_size = 512  # byte tokenizer (257 ids) rounded up; set >= a real tokenizer's size
    m.hidden_dim = 768
    m.num_layers = 12
    m.num_heads = 12
    m.num_kv_heads = 4
    m.head_dim = 64
    m.ffn_dim = 3072
    m.max_seq_len = 2048
    m.dtype = "float32"  # CPU runs float32 faster than bfloat16; use bfloat16 on GPU/TPU
    m.remat = "none"  # ~100M fits without recomputation at this batch on one accelerator

    d = c.data
    d.seq_len = 1024
    d.global_batch_size = 64  # 64k tokens per step

    o = c.optimizer
    o.learning_rate = 1e-3
    o.warmup_steps = 200

    t = c.training
    t.steps = 5000
    t.eval_every = 500
    t.eval_batches = 8

    c.checkpoint.every = 500
    c.logging.log_every = 20
    c.lock()
    return c
