"""Layer by layer against the Hugging Face reference (tests/hf_reference/*.npz, made by
make_reference.py --layers): the embedding, layer 0's attention and layer 0's whole block,
each fed the reference's own input, so that a failure names the layer that broke instead of
only moving the final logits (test_zoo_parity.py).

The modules are intercepted by class, whatever their other arguments: the first Block call
gets the reference's embedding output in place of ours, the first Attention call the
reference's normed input; their outputs are compared with the reference's.
"""

from __future__ import annotations

import contextlib
import functools
import pathlib

import jax
import numpy as np
import pytest
from model_utils import one_device_mesh

import zoo
from zoo.layers.attention import Attention
from zoo.layers.decoder import Block

REF = pathlib.Path(__file__).parent / "hf_reference"
# The registered families whose reference recorded per-layer outputs (make_reference.py
# records them for the dense families that share Llama's block layout).
FAMILIES = tuple(
    sorted(
        name
        for name in zoo.registry.FAMILIES
        if (REF / name / "inputs_and_logits.npz").exists()
        and "attn0_out" in np.load(REF / name / "inputs_and_logits.npz").files
    )
)
# float32 on both sides, one layer deep: they differ by summation order only (PyTorch eager
# vs XLA on CPU). Seen: at most 2.9e-6 on outputs up to |9|; a wrong norm offset, RoPE
# convention, attention scale or window moves these by 1e-1 or more.
ATOL = 2e-5


@contextlib.contextmanager
def _first_call_fed(cls, replacement, record: dict):
    """On the first call of `cls`, its first argument becomes `replacement` (None: kept);
    records that call's original input and its output."""
    original = cls.__call__

    def call(self, x, *args, **kwargs):
        if "out" in record:
            return original(self, x, *args, **kwargs)
        record["in"] = np.asarray(x)
        out = original(self, x if replacement is None else replacement, *args, **kwargs)
        record["out"] = np.asarray(out[0] if isinstance(out, tuple) else out)
        return out

    cls.__call__ = call
    try:
        yield record
    finally:
        cls.__call__ = original


@functools.cache
def _model(family):
    mesh = one_device_mesh()
    with jax.set_mesh(mesh):
        return mesh, zoo.from_pretrained(str(REF / family), "dp", scan_layers=False)


def _run(family, cls, replacement):
    """Our model on the reference inputs, eagerly, with `cls`'s first call fed `replacement`."""
    mesh, model = _model(family)
    ref = np.load(REF / family / "inputs_and_logits.npz")
    tokens_BT = ref["input_ids"]
    B, T = tokens_BT.shape
    positions_BT = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    with jax.set_mesh(mesh), _first_call_fed(cls, replacement, {}) as record:
        model(tokens_BT, segment_ids=np.ones((B, T), np.int32), positions=positions_BT)
    return record


def _reference(family, name):
    return np.load(REF / family / "inputs_and_logits.npz")[name]


@pytest.mark.parametrize("family", FAMILIES)
def test_embedding_equals_reference(family):
    ours = _run(family, Block, None)["in"]
    np.testing.assert_allclose(ours, _reference(family, "embed_out"), atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_attention_of_layer_0_equals_reference(family):
    ours = _run(family, Attention, _reference(family, "attn0_in"))["out"]
    np.testing.assert_allclose(ours, _reference(family, "attn0_out"), atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_block_0_equals_reference(family):
    ours = _run(family, Block, _reference(family, "embed_out"))["out"]
    np.testing.assert_allclose(ours, _reference(family, "block0_out"), atol=ATOL, rtol=0)
