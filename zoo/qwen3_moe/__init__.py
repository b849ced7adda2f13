"""Qwen3-MoE: Qwen3 with a mixture of experts in place of every MLP."""

from zoo.qwen3_moe.modeling import Qwen3Moe, Qwen3MoeConfig

__all__ = ["Qwen3Moe", "Qwen3MoeConfig"]
