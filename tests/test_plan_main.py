"""plan_main.py's bad inputs (exit 2, one line), and `auto`'s choice as memory shrinks, on a
synthetic chip (the 8 simulated CPU devices with a memory size we set)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import _entry
import jax
import pytest

from nnx_zoo.planning.chips import GiB, chip_for
from nnx_zoo.planning.cli import resolve_auto
from nnx_zoo.planning.compile import Target
from nnx_zoo.planning.search import candidate_space, search
from nnx_zoo.training.config import RunConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Runs plan_main with a module hidden, as if its extra were not installed.
_WITHOUT = (
    "import runpy, sys; sys.modules[{module!r}] = None; sys.argv = {argv!r}; "
    "runpy.run_path('plan_main.py', run_name='__main__')"
)


def _plan_main_process(args, hide: str | None = None):
    """plan_main as its own process (its stderr and exit status), `hide` not importable."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2")
    if hide:
        code = _WITHOUT.format(module=hide, argv=["plan_main.py", *args])
        command = [sys.executable, "-c", code]
    else:
        command = [sys.executable, "plan_main.py", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT, timeout=300)


BAD_INPUTS = {
    "unknown topology": ([], ["--model=tiny", "--topology=a100:8"], "unknown target 'a100:8'"),
    "mesh not matching the chips": (
        [],
        ["--model=tiny", "--topology=v5p:2x2x2", "--sharding_strategy=fsdp_tp"]
        + ["--mesh_shape=data:4,model:4"],
        "needs 16 devices but 8 are available",
    ),
    "model that cannot fit": (
        [],
        ["--model=llama3.1-8b", "--topology=v5e:2x4", "--sharding_strategy=dp"],
        "use more chips (at least",
    ),
    "unknown remat policy": (
        [],
        ["--model=tiny", "--topology=cpu:8", "--remat=full,bogus"],
        "--remat=bogus: valid: none, full, dots, save_qkv_proj, save_out_proj, offload",
    ),
    "offload on a cpu target": (
        [],
        ["--model=tiny", "--topology=cpu:8", "--sharding_strategy=dp", "--remat=offload"],
        "remat='offload' moves activations to host memory, which the cpu backend",
    ),
    "missing extra": (
        ["libtpu"],
        ["--model=tiny", "--topology=v5p:2x2x2"],
        "needs the [tpu] extra",
    ),
}


# A process where a module is hidden, and one where the error comes after a TPU target's
# devices load (no libtpu line may reach stderr); the rest in this process (tests/_entry.py).
AS_A_PROCESS = {"missing extra", "mesh not matching the chips"}


@pytest.mark.tpu_compile
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_exits_2_with_one_line(case):
    hide, args, expected = BAD_INPUTS[case]
    if case in AS_A_PROCESS:
        result = _plan_main_process(args, hide=hide[0] if hide else None)
    else:
        result = _entry.plan(args)
    assert result.returncode == 2, result.stderr[-2000:]
    ours = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(ours) == 1 and expected in ours[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr + result.stdout


def _run(**model) -> RunConfig:
    return RunConfig.from_config_dict(
        {
            "model": {"preset": "tiny", **model},
            "data": {"seq_len": 256, "global_batch_size": 16},
        }
    )


def _target(memory_gib: float) -> Target:
    return Target("cpu:8", tuple(jax.devices()), chip_for("cpu", memory_gib=memory_gib))


def test_auto_picks_what_fits_and_changes_its_pick_when_memory_shrinks():
    run = _run()
    roomy = _target(16)
    candidates = candidate_space(run, roomy, ["dp", "fsdp"], ("none", "full"), (1,))
    first = search(run, roomy, candidates)
    assert first.best is not None and first.best.fits
    assert first.reason.startswith("auto picked")
    # Less memory than the first pick needs: it no longer fits, something else must.
    budget = first.best.required_bytes - 1
    tight = _target(budget / GiB)
    second = search(run, tight, candidates)
    assert second.best is not None, second.reason
    assert second.best.candidate != first.best.candidate
    assert second.best.required_bytes <= tight.chip.memory_bytes
    # It was not the pick with room to spare: it is predicted no faster.
    assert second.best.estimate.step_seconds >= first.best.estimate.step_seconds
    # Far too little memory: nothing fits, and the reason names a change to make.
    none = search(run, _target(1e-4), candidates)
    assert none.best is None and "nothing fits" in none.reason and "use " in none.reason


def test_train_main_auto_resolves_to_a_strategy_mesh_remat_and_micro_batches():
    run = _run()
    run = dataclasses.replace(
        run, training=dataclasses.replace(run.training, sharding_strategy="auto")
    )
    said = []
    picked = resolve_auto(run, log=said.append)
    assert picked.training.sharding_strategy in (
        "dp",
        "fsdp",
        "tp",
        "fsdp_tp",
        "tp_sp",
        "fsdp_tp_sp",
    )
    assert picked.training.mesh_shape
    assert picked.model.remat in ("none", "dots", "full")
    assert said and said[0].startswith("auto picked")


def test_recompute_flops_follow_what_each_policy_keeps():
    """The estimate's extra forward FLOPs per token per policy: `full` and `offload` redo every
    block matmul and attention, `save_*_proj` all but those projections, `dots` attention
    alone; the LM head (and its padding) is never rematerialised."""
    from nnx_zoo.planning.estimate import recompute_flops_per_token
    from zoo.layers.remat import POLICIES

    cfg = _run().model.decoder_config()
    T = 256
    extra = {name: recompute_flops_per_token(cfg, T, name) for name in POLICIES}
    M, N, K, D, L = cfg.hidden_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
    F = cfg.ffn_dim
    attention = L * 4.0 * N * D * (T + 1) / 2  # no window in tiny: mean (T+1)/2 keys
    blocks = L * 2.0 * (M * D * (2 * N + 2 * K) + 3 * M * F)
    assert extra["none"] == 0
    assert extra["dots"] == pytest.approx(attention)
    assert extra["full"] == extra["offload"] == pytest.approx(blocks + attention)
    assert extra["full"] - extra["save_qkv_proj"] == pytest.approx(L * 2.0 * M * D * (N + 2 * K))
    assert extra["full"] - extra["save_out_proj"] == pytest.approx(L * 2.0 * N * D * M)
    padded = dataclasses.replace(cfg, padded_vocab_size=cfg.vocab_size + 128)
    assert recompute_flops_per_token(padded, T, "full") == pytest.approx(extra["full"])


def test_a_gpu_holds_what_jaxs_allocator_may_take(monkeypatch):
    """JAX caps its GPU allocator at 75% of the memory by default (seen on an H100: a plan of
    61 GiB, within 80 GB, ran out); TPU chips and --memory_gib are taken as given."""
    from nnx_zoo.planning.chips import chip_for

    for name in (
        "XLA_CLIENT_MEM_FRACTION",
        "XLA_PYTHON_CLIENT_MEM_FRACTION",
        "XLA_PYTHON_CLIENT_ALLOCATOR",
    ):
        monkeypatch.delenv(name, raising=False)
    assert chip_for("h100:8").memory_bytes == int(0.75 * 80e9)
    assert chip_for("v5p:2x2x2").memory_bytes == 95 * GiB
    assert chip_for("h100:8", memory_gib=10).memory_bytes == 10 * GiB
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".9")
    assert chip_for("h200:8").memory_bytes == int(0.9 * 139 * GiB)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
    assert chip_for("h100:8").memory_bytes == 80 * 10**9
    monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "1.5")
    with pytest.raises(ValueError, match=r"XLA_PYTHON_CLIENT_MEM_FRACTION='1.5': must be"):
        chip_for("h100:8")


def test_a_variant_that_cannot_fit_is_not_compiled():
    """After (fsdp, data:8, dots, k=2) needs 30 GiB of a 16 GiB chip (4 of them arguments),
    less remat or fewer micro-batches of the same layout cannot fit, and k=4 needs at least
    4 + 26/2 = 17 GiB; k=8 (at least 10.5) and another layout stay candidates."""
    from types import SimpleNamespace

    from nnx_zoo.planning.compile import Candidate
    from nnx_zoo.planning.search import _cannot_fit

    state = SimpleNamespace(params=1 * GiB, optimizer=3 * GiB)
    failed = [
        SimpleNamespace(
            candidate=Candidate("fsdp", (8,), "dots", 2), state=state, required_bytes=30 * GiB
        )
    ]

    def why(strategy, mesh, remat, k):
        return _cannot_fit(Candidate(strategy, mesh, remat, k), failed, 16 * GiB)

    assert "does not fit" in why("fsdp", (8,), "none", 2)
    assert "does not fit" in why("fsdp", (8,), "dots", 1)
    assert "needs at least 17.0 GiB" in why("fsdp", (8,), "dots", 4)
    assert why("fsdp", (8,), "dots", 8) is None
    assert why("fsdp", (8,), "full", 2) is None  # more remat: may fit
    assert why("fsdp_tp", (4, 2), "none", 1) is None  # another layout
    assert why("fsdp", (8,), "dots", 2) is None  # itself: not a verdict on a variant


def test_auto_tries_both_context_parallel_methods_and_takes_ring_when_only_it_fits():
    # Rows of 512 under fsdp_cp (data:2, context:4): all_gather holds every K/V and
    # [T/4, T] logits per device, ring one block of each; the same compute.
    run = dataclasses.replace(
        _run(remat="full"),
        data=dataclasses.replace(_run().data, seq_len=512, global_batch_size=2),
    )
    roomy = _target(16)
    meshes = {"fsdp_cp": (2, 4)}
    space = candidate_space(
        run,
        roomy,
        ["fsdp_cp", "fsdp_tp_sp"],
        ("full",),
        (1,),
        mesh_shapes=meshes,
        choose_context_parallel=True,
    )
    assert {c.context_parallel for c in space if c.strategy == "fsdp_cp"} == {"all_gather", "ring"}
    assert {c.context_parallel for c in space if c.strategy == "fsdp_tp_sp"} == {""}
    # Named (not auto): the config's method only.
    named = candidate_space(run, roomy, ["fsdp_cp"], ("full",), (1,), mesh_shapes=meshes)
    assert [c.context_parallel for c in named] == ["all_gather"]

    cp = [c for c in space if c.strategy == "fsdp_cp"]
    plans = {p.candidate.context_parallel: p for p in search(run, roomy, cp, exhaustive=True).plans}
    ring, gather = plans["ring"], plans["all_gather"]
    assert ring.temp_bytes < gather.temp_bytes, (ring.temp_bytes, gather.temp_bytes)
    between = _target((ring.required_bytes + gather.required_bytes) / 2 / GiB)
    result = search(run, between, cp)
    assert result.best is not None and result.best.candidate.context_parallel == "ring"
    assert "context_parallel=ring" in result.reason and "did not fit" in result.reason
