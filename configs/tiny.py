"""The default run: a small Llama on byte-level stdlib source, in about two minutes on 2 CPU cores.

Sized by measurement (see the numbers below) so that the training loss falls from ~6.2 (uniform
over 512 ids) to well under 3 nats/byte within the run.
"""

from configs import base_config


def get_config():
    c = base_config()
    c.name = "tiny"
    m = c.model
    m.preset = "tiny"
    m.vocab_size = 512  # byte tokenizer: 256 bytes + EOS, rounded up to a multiple of 128
    m.hidden_dim = 128
    m.num_layers = 4
    m.num_heads = 8  # 8 query heads over 4 kv heads: GQA, splittable by model axes 2 and 4
    m.num_kv_heads = 4
    m.head_dim = 16
    m.ffn_dim = 384
    m.max_seq_len = 256

    d = c.data
    d.seq_len = 128
    d.global_batch_size = 16  # divisible by 8 devices (one row each under dp / fsdp)

    o = c.optimizer
    o.learning_rate = 3e-3  # small models take large rates; warmup keeps the start stable
    o.warmup_steps = 20
    o.weight_decay = 0.1

    t = c.training
    t.steps = 200
    t.eval_every = 50
    t.eval_batches = 4

    c.checkpoint.every = 50
    c.logging.log_every = 10
    c.lock()
    return c
