"""Fine-tuning through the entry points (issue 30): train_main on chat data with LoRA from a
local Hugging Face checkpoint, eval_main on the adapted run, export_main to `hf` and `peft`,
and the round trip: PEFT's PeftModel on transformers' model, and transformers alone on the
merged export, give this project's logits (checks 4 and 6)."""

import json
import os
import shutil

import _entry
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _train_helpers import run_train_main, train_losses
from chat_fixtures import chat_template, write_chats_jsonl, write_tiny_checkpoint
from flax import nnx

# Rows hold the longest fixture chat (119 tokens): a longer one is never split into rows
# (data.chat_overflow), and at 64 the default policy would leave half of them out.
TRAIN = [
    "--config.data.format=chat",
    "--config.data.seq_len=128",
    "--config.data.global_batch_size=8",
    "--config.data.validation_fraction=0.25",
    "--config.training.steps=3",
    "--config.training.eval_batches=1",
    "--config.optimizer.warmup_steps=0",
    "--config.optimizer.learning_rate=1e-2",
    "--config.logging.log_every=1",
    "--config.logging.progress_bar=false",
    "--config.checkpoint.every=3",
    "--config.lora.rank=4",
    "--config.lora.alpha=8",
    "--config.lora.targets=q_proj,k_proj,v_proj,o_proj,gate,up,down",
    "--sharding_strategy=dp",
]
QWEN3_TINY = dict(
    hidden_dim=64, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=16, ffn_dim=128,
    max_seq_len=256,
)  # fmt: skip


def _main(script, args):
    """export_main / eval_main in this process (tests/_entry.py)."""
    return _entry.run_main(script.removesuffix(".py"), args)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune")
    chats = write_chats_jsonl(str(root / "chats.jsonl"))
    return {
        "llama": write_tiny_checkpoint(str(root / "llama"), "llama3"),
        "chats": chats,
        "chats_parquet": _to_parquet(chats, str(root / "chats.parquet")),
        "root": root,
    }


def _to_parquet(jsonl: str, path: str) -> str:
    """The same chats as a Parquet file (a `messages` column of structs)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with open(jsonl, encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def _write(path, lines):
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(json.dumps(x) for x in lines) + "\n")
    return str(path)


def _with_template(base: str, path: str, template: str) -> str:
    """A copy of checkpoint `base` at `path` whose tokenizer_config.json has `template`."""
    shutil.copytree(base, path)
    with open(os.path.join(path, "tokenizer_config.json")) as f:
        config = json.load(f)
    config["chat_template"] = template
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return path


# A role the template does not know: Qwen3's renders nothing for `narrator` (Llama 3's writes
# any role's header, so the template, not a list, is the judge). Line 4 brings the role, after
# chats that are fine (lines 3 and 4 fall in the training split), and is still refused before
# training.
HELLO = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
STORY = [
    {"role": "user", "content": "Tell me a story"},
    {"role": "narrator", "content": "Once"},
    {"role": "assistant", "content": "upon a time"},
]
NARRATOR = [HELLO, HELLO, HELLO, {"messages": STORY}, HELLO, HELLO]
BAD = {
    "no_messages": ([{"text": "hello"}], [], "no 'messages' field"),
    "unknown_role": (
        NARRATOR,
        [],
        "message 1 has role 'narrator', which the chat template does not know (it renders "
        "nothing of that message); roles it renders there: system, user, assistant, tool",
    ),
    "rank_0": (None, ["--config.lora.rank=0"], "lora.rank=0"),
    "unknown_target": (None, ["--config.lora.targets=q_proj,qproj"], "unknown qproj"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_exits_2_with_one_line(case, files, tmp_path):
    records, extra, needle = BAD[case]
    source = _write(tmp_path / "bad.jsonl", records) if records else files["chats"]
    base = files["llama"]
    if case == "unknown_role":
        base = _with_template(base, str(tmp_path / "qwen_template"), chat_template("qwen3"))
    args = [
        f"--workdir={tmp_path / 'run'}",
        f"--init_from={base}",
        f"--config.data.source={source}",
        *TRAIN,
        *extra,
    ]
    result = run_train_main(args, num_devices=1)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-2000:]
    assert needle in lines[0]


def _error_line_of_chat_run(files, tmp_path, base) -> str:
    """The one stderr line of a fine-tuning run from `base` on the chats that exits 2."""
    args = [f"--workdir={tmp_path / 'run'}", f"--init_from={base}"]
    result = run_train_main(
        [*args, f"--config.data.source={files['chats']}", *TRAIN], num_devices=1
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_a_target_this_model_lacks_exits_2(files, tmp_path):
    """'gate' is a valid target name, but a mixture-of-experts block has no dense MLP gate."""
    base = write_tiny_checkpoint(str(tmp_path / "moe"), "qwen3", "qwen3-moe-tiny")
    assert "'gate' names no module" in _error_line_of_chat_run(files, tmp_path, base)


def test_a_template_that_raises_exits_2(files, tmp_path):
    template = "{{ raise_exception('System role not supported') }}"
    base = _with_template(files["llama"], str(tmp_path / "copy"), template)
    assert "System role not supported" in _error_line_of_chat_run(files, tmp_path, base)


def _our_logits(workdir, ids):
    from nnx_zoo.checkpoint.restore import read_meta
    from nnx_zoo.evaluation import model as eval_model
    from nnx_zoo.evaluation.settings import from_run_info

    _, meta = read_meta(workdir, None)
    run_info = meta["run_info"]
    settings = from_run_info(run_info, strategy="dp")
    model, mesh, _ = eval_model.load_from_checkpoint(workdir, run_info, settings, None)
    with jax.set_mesh(mesh):
        t = jnp.asarray(ids, jnp.int32)
        pos = jnp.broadcast_to(jnp.arange(t.shape[1]), t.shape)
        return np.asarray(model(t, segment_ids=jnp.ones_like(t), positions=pos))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_peft_round_trip(family, files, tmp_path):
    torch = pytest.importorskip("torch", reason="the reference is torch + transformers + peft")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    if family == "llama":
        base = files["llama"]
    else:
        base = write_tiny_checkpoint(str(tmp_path / "qwen3"), "qwen3", "qwen3-0.6b", **QWEN3_TINY)
    workdir = str(tmp_path / "run")
    # The same chats, as JSONL for one family and Parquet for the other.
    source = files["chats"] if family == "llama" else files["chats_parquet"]
    result = run_train_main(
        [f"--workdir={workdir}", f"--init_from={base}", f"--config.data.source={source}"] + TRAIN,
        num_devices=1,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # The checkpoint holds the adapters and their optimizer state only, and points at the base.
    with open(os.path.join(workdir, "run_info.json")) as f:
        assert json.load(f)["init_from"] == base
    step_dir = os.path.join(workdir, "checkpoints", "3")
    for item in ("params", "opt_state"):
        with open(os.path.join(step_dir, item, "_METADATA")) as f:
            paths = list(json.load(f)["tree_metadata"])
        # Scalars aside (the optimizer's step and Adam's / the schedule's counts).
        arrays = [p for p in paths if "count" not in p and p != "('step',)"]
        assert arrays and all("lora" in p for p in arrays), (item, paths)
    outs = {}
    for fmt in ("hf", "peft"):
        outs[fmt] = str(tmp_path / fmt)
        flags = [f"--workdir={workdir}", f"--format={fmt}", f"--out={outs[fmt]}"]
        done = _main("export_main.py", flags)
        assert done.returncode == 0, done.stderr[-3000:]
    evaluated = _main("eval_main.py", [f"--workdir={workdir}", "--sharding_strategy=dp"])
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    with open(os.path.join(workdir, "eval.json")) as f:
        assert np.isfinite(json.load(f)["loss"])

    ids = np.random.default_rng(0).integers(0, 384, (8, 24))  # 8 rows: dp over 8 devices
    ours = _our_logits(workdir, ids)
    with torch.no_grad():
        hf_base = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        base_logits = hf_base(torch.tensor(ids)).logits.numpy()
        adapted = peft.PeftModel.from_pretrained(hf_base, outs["peft"])
        peft_logits = adapted(torch.tensor(ids)).logits.numpy()
        merged = transformers.AutoModelForCausalLM.from_pretrained(outs["hf"], dtype=torch.float32)
        merged_logits = merged(torch.tensor(ids)).logits.numpy()
    assert np.abs(peft_logits - base_logits).max() > 1e-3  # the adapters changed something
    # float32 on both sides; the bound.
    np.testing.assert_allclose(peft_logits, ours, atol=1e-4, rtol=0)
    np.testing.assert_allclose(merged_logits, ours, atol=1e-4, rtol=0)


def test_lora_on_a_bfloat16_base_with_a_tool_role_trains_and_evaluates(files, tmp_path):
    """`--config.model.dtype=bfloat16`: the frozen base stored in bf16, the adapters in f32;
    train_main trains, eval_main evaluates. The chats hold Llama 3.1's tool-output role
    `ipython`, which Llama 3's template renders (a fixed role list refused it before)."""
    from nnx_zoo.checkpoint.restore import read_meta
    from nnx_zoo.evaluation import model as eval_model
    from nnx_zoo.evaluation.settings import from_run_info
    from zoo.layers.lora import LoraParam

    tool = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "ipython", "content": '{"capital": "Paris"}'},
        {"role": "assistant", "content": "Paris is the capital."},
    ]
    with open(files["chats"], encoding="utf-8") as f:
        chats = [json.loads(line) for line in f]
    source = _write(tmp_path / "tool_chats.jsonl", [{"messages": tool}, *chats])
    workdir = str(tmp_path / "run")
    args = [
        f"--workdir={workdir}",
        f"--init_from={files['llama']}",
        f"--config.data.source={source}",
    ]
    result = run_train_main([*args, *TRAIN, "--config.model.dtype=bfloat16"], num_devices=1)
    assert result.returncode == 0, result.stderr[-3000:]
    assert all(np.isfinite(train_losses(workdir))) and len(train_losses(workdir)) == 3
    evaluated = _main("eval_main.py", [f"--workdir={workdir}", "--sharding_strategy=dp"])
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    with open(os.path.join(workdir, "eval.json")) as f:
        assert np.isfinite(json.load(f)["loss"])
    _, meta = read_meta(workdir, None)
    settings = from_run_info(meta["run_info"], strategy="dp")
    model, _, _ = eval_model.load_from_checkpoint(workdir, meta["run_info"], settings, None)
    dtypes = {
        isinstance(var, LoraParam): var[...].dtype
        for _, var in nnx.to_flat_state(nnx.state(model, nnx.Any(nnx.Param, LoraParam)))
    }
    assert dtypes == {False: jnp.bfloat16, True: jnp.float32}, dtypes
