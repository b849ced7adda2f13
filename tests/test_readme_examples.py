"""The Python examples in the docs run as written (issue 40, item 7).

Every ```python block right after a line `<!-- runnable -->` in README.md and docs/*.md is
executed (on the 8 simulated devices); finding none is a failure, so the marker cannot be
lost silently. The README's model example also runs with each strategy of STRATEGIES named
in it, eagerly (a pipeline or context-parallel model, called outside jit, jits itself), and
a batch that does not divide the devices is the project's one-line ValueError.

On 9d09506 the README's example raised NameError (`tokens`, `seg`, `pos` undefined); with
fsdp_pp it raised JAX's "shard_map out_specs argument must refer to an axis marked as
manual", with fsdp_cp a shard_map replication error, and a batch of 4 over 8 devices a raw
JAX sharding error.
"""

from __future__ import annotations

import glob
import os
import re

import jax
import jax.numpy as jnp
import pytest
from _entry import ROOT
from flax import nnx

from shardings import STRATEGIES, get_strategy
from zoo import create_model, get_config

_BLOCK = re.compile(r"^<!-- runnable -->[ \t]*\n```python\n(.*?)^```", re.M | re.S)
DOCS = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]


def runnable_blocks() -> list[tuple[str, str]]:
    """(where, code) of every marked block."""
    found = []
    for path in DOCS:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for match in _BLOCK.finditer(text):
            line = text[: match.start()].count("\n") + 1
            found.append((f"{os.path.relpath(path, ROOT)}:{line}", match.group(1)))
    return found


BLOCKS = runnable_blocks()


def test_the_docs_mark_runnable_examples():
    assert BLOCKS, f"no ```python block after a '<!-- runnable -->' line in {DOCS}"


@pytest.mark.parametrize("where,code", BLOCKS, ids=[w for w, _ in BLOCKS])
def test_runnable_block_runs(where, code):
    namespace = {"__name__": f"example {where}"}
    exec(compile(code, where, "exec"), namespace)  # noqa: S102 -- the docs' own example


def _model_example() -> str:
    code = next((c for _, c in BLOCKS if "get_strategy(" in c and "model(tokens" in c), None)
    assert code is not None, "no runnable example calls a model built by get_strategy"
    return code


# SMALL_RUN's shapes: the sweep below builds and calls one model per strategy.
SMALL = 'get_config("tiny", hidden_dim=64, num_layers=2, head_dim=8, ffn_dim=128)'


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_model_example_runs_under_every_strategy(strategy):
    code = _model_example()
    code = re.sub(r'get_strategy\("\w+"\)', f'get_strategy("{strategy}")', code)
    code, n = re.subn(r'get_config\("tiny"\)', SMALL, code)
    assert n == 1, "the example no longer builds get_config('tiny')"
    namespace = {}
    exec(compile(code, f"README example with {strategy}", "exec"), namespace)  # noqa: S102
    B, T = namespace["tokens"].shape
    assert namespace["logits"].shape == (B, T, namespace["cfg"].vocab_size)
    assert bool(jnp.isfinite(namespace["logits"]).all())


def test_a_batch_that_does_not_divide_the_devices_is_one_line():
    strategy = get_strategy("dp")
    cfg = get_config("tiny", hidden_dim=64, num_layers=2, head_dim=8, ffn_dim=128)
    mesh = strategy.make_mesh(config=cfg)
    assert dict(mesh.shape) == {"data": 8}
    tokens = jnp.zeros((4, 16), jnp.int32)
    with jax.set_mesh(mesh):
        model = create_model(cfg, strategy, rngs=nnx.Rngs(0))
        with pytest.raises(ValueError) as e:
            model(tokens, segment_ids=jnp.ones_like(tokens), positions=jnp.zeros_like(tokens))
    assert str(e.value) == (
        "model input tokens [B, T]: batch size 4 is split over mesh axis data=8, which does "
        "not divide it; use a batch size that is a multiple of 8"
    )
