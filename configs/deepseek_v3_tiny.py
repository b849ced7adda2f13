"""The tiny DeepSeek-V3 (zoo/deepseek_v3/) on byte-level stdlib source: configs/tiny.py's data
and optimizer, the model's dims all from its preset (latent attention's must agree with each
other, so none is overridden here). Train it under an expert-parallel strategy:

    python train_main.py --config=configs/deepseek_v3_tiny.py --sharding_strategy=fsdp_ep \
        --workdir=runs/dsv3
"""

from configs import tiny


def get_config():
    c = tiny.get_config()
    c.unlock()
    c.name = "deepseek_v3_tiny"
    m = c.model
    m.preset = "deepseek-v3-tiny"
    for dim in ("vocab_size", "hidden_dim", "num_layers", "num_heads", "num_kv_heads"):
        setattr(m, dim, None)
    m.head_dim = m.ffn_dim = m.max_seq_len = None
    # DeepSeek-V3's auxiliary-loss-free balancing, at its published rate (0.001 per step).
    c.training.moe_bias_update_rate = 0.001
    c.lock()
    return c
