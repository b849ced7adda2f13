"""A model is planned once (zoo/plan.py): the run assembly, create_model, abstract_model and
from_pretrained take the one ModelPlan, so none of them checks the model or builds its
shapes again. A concrete build (tests/test_plan_equals_train.py counts it, at no compile of its
own) constructs the model twice: the plan's shapes and the initialising jit's trace."""

from __future__ import annotations

import pathlib

import jax
import pytest
from flax import nnx
from model_utils import count_constructions

from nnx_zoo.launch.build import build, model_run
from nnx_zoo.training.config import RunConfig
from shardings import get_strategy
from zoo import abstract_model, create_model, from_pretrained, get_config, plan_model

REF = pathlib.Path(__file__).parent / "hf_reference"


@pytest.fixture
def constructions(monkeypatch):
    return count_constructions(monkeypatch)


def _mesh():
    return get_strategy("fsdp_tp").make_mesh(shape="data:4,model:2")


def test_an_abstract_build_constructs_the_model_once(constructions):
    built = model_run(
        get_config("tiny"), "fsdp_tp", _mesh(), batch_size=8, seq_len=32, abstract=True
    )
    # The plan's shapes, placed on the mesh: the optimizer and the step are built on them.
    assert constructions["n"] == 1
    leaf = jax.tree.leaves(nnx.state(built.model))[0]
    assert isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding.spec is not None


def test_a_build_from_a_hugging_face_directory_constructs_the_model_once(constructions):
    raw = {
        "data": {"seq_len": 32, "global_batch_size": 8},
        "training": {"sharding_strategy": "fsdp_tp"},
    }
    built = build(RunConfig.from_config_dict(raw), init_from=str(REF / "llama"))
    # The weights are read into the plan's placed shapes: no initialisation at all.
    assert constructions["n"] == 1
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(nnx.state(built.model)))


def test_every_path_takes_the_plan_and_its_padded_vocab():
    mesh = _mesh()
    plan = plan_model(get_config("tiny", vocab_size=501), "fsdp_tp", mesh)
    # 501 rows do not divide over model=2: 128 x 2 rows a multiple.
    assert plan.cfg.padded_vocab_size == 512 and plan.strategy.name == "fsdp_tp"
    with jax.set_mesh(mesh):
        # Traced, not compiled: the layout create_model gives, at no compile's cost.
        model = nnx.eval_shape(lambda: create_model(plan, rngs=nnx.Rngs(0)))
    shapes = abstract_model(plan)
    assert model.cfg == plan.cfg == shapes.cfg
    made = nnx.to_flat_state(nnx.state(model))
    placed = nnx.to_flat_state(nnx.state(shapes))
    assert [(p, v.get_value().shape, v.get_value().sharding.spec) for p, v in made] == [
        (p, v.get_value().shape, v.get_value().sharding.spec) for p, v in placed
    ]
    # A fresh model each time: filling one in place leaves the plan's shapes alone.
    assert abstract_model(plan) is not shapes
    with pytest.raises(TypeError, match="pass the plan alone"):
        create_model(plan, "fsdp_tp", rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="takes a ModelPlan alone"):
        from_pretrained(str(REF / "llama"), plan, dtype="bfloat16")


def test_a_plan_names_what_does_not_fit_in_one_line():
    mesh = _mesh()
    with pytest.raises(ValueError, match=r"lack \['stage'\], which strategy 'fsdp_pp' uses"):
        plan_model(get_config("tiny"), "fsdp_pp", mesh)
    with pytest.raises(ValueError, match=r"unknown sharding strategy 'fsdp_typo'"):
        plan_model(get_config("tiny"), "fsdp_typo", mesh)
    with pytest.raises(ValueError, match=r"ffn_dim|mlp|does not divide"):
        plan_model(get_config("tiny", ffn_dim=129), "fsdp_tp", mesh)
