"""The lm-eval backend without torch: BOS/EOS conventions where tokenizers differ, packed rows
score like one request per row, dp on 1 device equals fsdp_tp on 8, and eval_main --tasks on
a run trained by train_main and on a Hugging Face directory (results JSON in the harness's
schema; bad input, and generation under a strategy that cannot generate, exit 2). The same
trained run (no LoRA) is exported by export_main (issue 30: any run, any step)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import _entry
import jax
import numpy as np
import pytest
from _stderr import ours
from _train_helpers import SMALL_RUN, child_env, cli_flags, run_train_main

from bench.fixtures import ROOT, STYLES, TASKS, write_tiny_llama, write_tokenizer
from nnx_zoo.data.tokenizers import ByteTokenizer, make_tokenizer
from nnx_zoo.evaluation.harness_batch import pack, row_length
from nnx_zoo.evaluation.harness_tokens import HarnessTokens

pytest.importorskip("lm_eval", reason="the [eval] extra (lm-eval) is not installed")

# -- BOS / EOS conventions (the hf backend's, lm_eval/models/huggingface.py) ------------------


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    out = {}
    for style in STYLES:
        directory = str(tmp_path_factory.mktemp(style))
        write_tokenizer(directory, style)
        out[style] = HarnessTokens(make_tokenizer(directory))
    out["byte"] = HarnessTokens(ByteTokenizer())
    return out


def test_prefix_token_is_bos_when_the_tokenizer_has_one_else_eos(tokens):
    llama, gpt2, byte = tokens["llama"], tokens["gpt2"], tokens["byte"]
    assert llama.prefix_id == llama.bos_id == 0 and llama.eos_id == 1
    assert gpt2.bos_id is None and gpt2.prefix_id == gpt2.eos_id == 0
    assert byte.bos_id is None and byte.prefix_id == byte.eos_id == 256


def test_encoding_adds_bos_only_where_the_tokenizer_does(tokens):
    llama, gpt2 = tokens["llama"], tokens["gpt2"]
    text = "Question: Snow is usually"
    plain = llama.encode(text, specials=False)
    assert llama.encode(text) == [llama.bos_id, *plain]
    assert gpt2.encode(text) == gpt2.encode(text, specials=False)
    # A text that already starts with the prefix token's text gets no second one.
    assert llama.encode("<s>" + text) == llama.encode("<s>" + text, specials=False)
    assert llama.encode("<s>" + text).count(llama.bos_id) == 1


def test_loglikelihood_pairs(tokens):
    llama, gpt2, byte = tokens["llama"], tokens["gpt2"], tokens["byte"]
    # The context's trailing space moves onto the continuation; BOS stays in the context.
    ctx, cont = llama.encode_pair("Answer: ", "cold")
    assert ctx == llama.encode("Answer:") and ctx[0] == llama.bos_id
    assert ctx + cont == llama.encode("Answer: cold")
    ctx, cont = gpt2.encode_pair("Answer:", " cold")
    assert ctx == gpt2.encode("Answer:") and gpt2.eos_id not in ctx
    # An empty context is the prefix token: BOS for llama, EOS for gpt2 and bytes.
    assert llama.encode_pair("", " cold") == ([llama.bos_id], llama.encode(" cold", False))
    assert gpt2.encode_pair("", " cold") == ([gpt2.eos_id], gpt2.encode(" cold"))
    assert byte.encode_pair("", "ab") == ([256], [97, 98])
    # ... unless the continuation already starts with it.
    assert gpt2.encode_pair("", "<|endoftext|> cold") == ([0], gpt2.encode(" cold"))


def test_rolling_windows_score_every_token_once(tokens):
    from nnx_zoo.evaluation.harness_tokens import rolling_windows

    llama = tokens["llama"]
    ids = llama.encode("The river starts in the hills as a thin stream of cold water. " * 3)
    windows = rolling_windows(ids, llama.prefix_id, max_length=16)
    assert windows[0][0] == [llama.prefix_id]  # (the hf backend scores llama's own BOS too)
    assert [t for _, scored in windows for t in scored] == ids
    assert all(len(ctx) + len(scored) <= 17 for ctx, scored in windows)


def test_packing_fills_rows_first_fit_longest_first():
    assert row_length(3) == 64 and row_length(65) == 128 and row_length(65, limit=65) == 65
    rows = pack([40, 30, 20, 60, 10], 64)
    assert sorted(i for r in rows for i in r) == [0, 1, 2, 3, 4]
    assert rows == [[3], [0, 2], [1, 4]]
    with pytest.raises(ValueError, match="does not fit"):
        pack([65], 64)


# -- the model: packed == padded, and every mesh the same ------------------------------------


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tiny_llama"))
    write_tiny_llama(directory, "llama", max_seq_len=64)
    return directory


def _requests():
    """Multiple-choice and rolling requests of the example tasks, as the harness makes them."""
    from lm_eval.api.instance import Instance

    with open(os.path.join(TASKS, "zoo_facts.jsonl")) as f:
        facts = [json.loads(line) for line in f][:6]
    with open(os.path.join(TASKS, "zoo_prose.jsonl")) as f:
        prose = [json.loads(line)["text"] for line in f][:3]
    mc = [
        Instance("loglikelihood", {}, (f"Question: {d['question']}\nAnswer:", f" {c}"), i)
        for d in facts
        for i, c in enumerate(d["choices"])
    ]
    rolling = [Instance("loglikelihood_rolling", {}, (t,), 0) for t in prose]
    return mc, rolling


def _lm(hf_dir, strategy_name, devices, **kwargs):
    from nnx_zoo.evaluation.harness_lm import ZooLM
    from shardings import get_strategy
    from zoo import from_pretrained

    strategy = get_strategy(strategy_name)
    mesh = strategy.make_mesh(devices=devices)
    with jax.set_mesh(mesh):
        model = from_pretrained(hf_dir, strategy)
    return ZooLM(model, mesh, make_tokenizer(hf_dir), **kwargs)


def test_sharding_and_packing_change_nothing(hf_dir):
    mc, rolling = _requests()
    one = _lm(hf_dir, "dp", jax.devices()[:1], rows=4)
    eight = _lm(hf_dir, "fsdp_tp", jax.devices(), rows=8)
    padded = _lm(hf_dir, "dp", jax.devices()[:1], rows=4, pack=False)
    ll = {name: lm.loglikelihood(mc) for name, lm in [("one", one), ("eight", eight)]}
    roll = {
        name: lm.loglikelihood_rolling(rolling) for name, lm in [("one", one), ("eight", eight)]
    }
    ll["padded"] = padded.loglikelihood(mc)
    # One call per request list: the 24 requests go through the model in packed batches.
    assert one.calls == 2
    # float32: the same sums of ~10-200 per-token log-probs, computed with the matmuls split
    # differently (fsdp_tp splits heads and the vocab over `model`): 1e-5 relative bounds it.
    for name in ("eight", "padded"):
        np.testing.assert_allclose(
            [x[0] for x in ll[name]], [x[0] for x in ll["one"]], rtol=1e-5, atol=1e-5
        )
        assert [x[1] for x in ll[name]] == [x[1] for x in ll["one"]]
    np.testing.assert_allclose(roll["eight"], roll["one"], rtol=1e-5, atol=1e-5)
    # The prose documents are longer than max_length=64: scored in several windows.
    assert len(one.tokens.encode(rolling[0].args[0])) > 64


# -- eval_main --tasks on a trained run ------------------------------------------------------


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("run"))
    overrides = {**SMALL_RUN, "training.steps": 50, "checkpoint.enabled": True}
    overrides["checkpoint.every"] = 25  # two steps to choose from (export_main --step)
    proc = run_train_main(["--sharding_strategy=dp", f"--workdir={workdir}", *cli_flags(overrides)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir


def _eval_main(*flags, cwd=ROOT):
    """eval_main in this process (tests/_entry.py), started in `cwd`."""
    return _entry.run_main("eval_main", list(flags), cwd=cwd)


def _eval_main_process(*flags, env=None, timeout=300, cwd=ROOT):
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "eval_main.py"), *flags],
        cwd=cwd,
        env=env or child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_eval_main_tasks_on_a_trained_run(run_dir):
    from lm_eval.result_schema import EvalResults

    proc = _eval_main(
        f"--workdir={run_dir}",
        "--tasks=zoo_facts,zoo_prose",
        f"--include_path={TASKS}",
        "--num_fewshot=0",
        "--limit=8",
        "--sharding_strategy=fsdp_tp",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(run_dir, "lm_eval.json")) as f:
        results = json.load(f)
    assert set(results) <= set(EvalResults.__annotations__), set(results)
    for key in ("results", "configs", "versions", "n-shot", "higher_is_better", "n-samples"):
        assert set(results[key]) == {"zoo_facts", "zoo_prose"}, key
    assert results["n-shot"] == {"zoo_facts": 0, "zoo_prose": 0}
    assert results["n-samples"]["zoo_facts"] == {"original": 36, "effective": 8}
    assert 0.0 <= results["results"]["zoo_facts"]["acc,none"] <= 1.0
    # 50 steps on source code: far better than uniform over the byte vocabulary (8 bits).
    assert results["results"]["zoo_prose"]["bits_per_byte,none"] < 8.0
    assert "zoo_facts: acc " in proc.stdout and "wrote " in proc.stdout


@pytest.mark.parametrize(
    "flags,line",
    [
        (
            ["--tasks=zoo_facts"],
            "error: unknown task 'zoo_facts': not among the harness's tasks (a local task needs "
            "--include_path=DIR)",
        ),
        (
            ["--tasks=zoo_facts", "--include_path=/no/such/dir"],
            "error: --include_path='/no/such/dir' is not a directory of task YAML files (or "
            "lm_eval_tasks: the example tasks shipped with this package)",
        ),
    ],
    ids=["unknown_task", "missing_include_path"],
)
def test_bad_task_exits_2_with_one_line(tmp_path, flags, line):
    proc = _eval_main(f"--workdir={tmp_path}", *flags)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [line], proc.stderr[-2000:]


@pytest.mark.parametrize(
    "tasks,include,message",
    [
        ("no_such_task", TASKS, "unknown task 'no_such_task': not in --include_path="),
        ("zoo_facts", "/no/such/dir", "is not a directory"),
        (",", None, "names no task"),
    ],
)
def test_bad_task_requests_are_one_line_errors(tasks, include, message):
    from nnx_zoo.evaluation.harness import prepare

    with pytest.raises(ValueError, match=message):
        prepare(tasks, include, 0, None)


def test_include_path_names_the_shipped_examples(tmp_path, monkeypatch):
    from nnx_zoo.evaluation.harness import EXAMPLE_TASKS, include_dir

    monkeypatch.chdir(tmp_path)
    for name in ("lm_eval_tasks", "examples/lm_eval_tasks", "nnx_zoo/evaluation/lm_eval_tasks/"):
        assert include_dir(name) == EXAMPLE_TASKS, name
    assert {"zoo_facts.yaml", "zoo_prose.yaml", "zoo_facts_gen.yaml"} <= set(
        os.listdir(EXAMPLE_TASKS)
    )
    (tmp_path / "lm_eval_tasks").mkdir()  # a directory of the user's own wins
    assert include_dir("lm_eval_tasks") == str(tmp_path / "lm_eval_tasks")
    assert include_dir("other/lm_eval_tasks") == str(tmp_path / "other" / "lm_eval_tasks")


def test_tasks_without_the_extra_name_the_install_command(tmp_path):
    # A directory that shadows `lm_eval` with a package that fails to import, as if absent.
    shadow = tmp_path / "shadow" / "lm_eval"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named lm_eval')\n")
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(shadow.parent), ROOT, env.get("PYTHONPATH", "")])
    proc = _eval_main_process(f"--workdir={tmp_path}", "--tasks=zoo_facts", env=env)
    assert proc.returncode == 2
    assert ours(proc.stderr).strip() == (
        'error: --tasks needs lm-evaluation-harness: pip install "nnx-zoo[eval]" (lm-eval 0.4.13)'
    ), proc.stderr


def test_eval_main_tasks_on_an_hf_checkpoint(hf_dir, tmp_path):
    """--hf_checkpoint: the directory's tokenizer and config, the default strategy (fsdp_tp on
    8 devices); --seed reaches the backend (recorded in the results' config). Run from outside
    the checkout: --include_path=lm_eval_tasks names the example tasks shipped in the package."""
    proc = _eval_main(
        f"--workdir={tmp_path}",
        f"--hf_checkpoint={hf_dir}",
        "--tasks=zoo_facts",
        "--include_path=lm_eval_tasks",
        "--limit=4",
        "--seed=5",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "lm_eval.json") as f:
        results = json.load(f)
    assert results["n-samples"]["zoo_facts"] == {"original": 36, "effective": 4}
    assert results["results"]["zoo_facts"]["acc,none"] in (0.0, 0.25, 0.5, 0.75, 1.0)
    assert results["config"]["sampling_seed"] == 5
    assert results["config"]["mesh_shape"] == {"data": 4, "model": 2}
    assert f"hf checkpoint {hf_dir}: zoo_facts: acc " in proc.stdout


def test_generate_until_under_a_strategy_that_cannot_generate_exits_2(tmp_path):
    """A pipeline's or a context-parallel strategy cannot generate: a generate_until task is
    refused before any checkpoint is read (the workdir here holds none)."""
    proc = _eval_main(
        f"--workdir={tmp_path}",
        "--tasks=zoo_facts,zoo_facts_gen",
        f"--include_path={TASKS}",
        "--sharding_strategy=fsdp_pp",
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "error: --tasks: zoo_facts_gen (output_type generate_until): generation (KV-cache "
        "decoding) does not run under the pipeline strategy fsdp_pp; add "
        "--sharding_strategy=fsdp (or another without a `stage` axis): checkpoints load under "
        "any strategy"
    ], proc.stderr[-2000:]


def test_which_tasks_a_strategy_refuses():
    from nnx_zoo.evaluation.harness import check_strategy, prepare

    generating = prepare("zoo_facts_gen", TASKS, 0, None)
    with pytest.raises(ValueError, match=r"^--tasks: zoo_facts_gen .*over 'context' .*fsdp_tp_cp"):
        check_strategy(generating, "fsdp_tp_cp")
    check_strategy(generating, "fsdp_tp")  # it can generate
    # Log-likelihood tasks run under any strategy.
    check_strategy(prepare("zoo_facts,zoo_prose", TASKS, 0, None), "fsdp_pp")


def test_generate_until_greedy_and_sampled(hf_dir):
    from lm_eval.api.instance import Instance

    lm = _lm(hf_dir, "dp", jax.devices()[:1], rows=4)
    prompts = ["Question: Snow is usually\nAnswer:", "Question: A cat says\nAnswer:"]

    def run(**kwargs):
        args = {"until": ["\n"], "max_gen_toks": 12, **kwargs}
        return lm.generate_until([Instance("generate_until", {}, (p, args), 0) for p in prompts])

    greedy = run(do_sample=False)
    assert greedy == run(do_sample=False)
    assert all("\n" not in text for text in greedy)  # cut at the stop sequence
    lm.seed = 7
    sampled = run(do_sample=True, temperature=5.0)
    assert run(do_sample=True, temperature=5.0) == sampled  # the same seed, the same draws
    assert sampled != greedy
    lm.seed = 8
    assert run(do_sample=True, temperature=5.0) != sampled  # another seed, other draws
    # top_p reaches the sampler: a nucleus too small for a second token is greedy.
    assert run(do_sample=True, temperature=5.0, top_p=1e-6) == greedy


# -- export_main on the same run (no LoRA) ---------------------------------------------------


def _export_main(*flags):
    """export_main in this process (tests/_entry.py)."""
    return _entry.export(list(flags))


def test_export_main_hf_of_a_run_without_lora_at_a_step(run_dir, tmp_path):
    """--format=hf is for any run; --step=25 writes that step's weights (not the latest)."""
    from flax import nnx

    from nnx_zoo.checkpoint.restore import read_meta
    from nnx_zoo.evaluation import model as eval_model
    from nnx_zoo.evaluation.settings import from_run_info
    from zoo import from_pretrained

    out = str(tmp_path / "hf")
    proc = _export_main(f"--workdir={run_dir}", "--format=hf", f"--out={out}", "--step=25")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"wrote step 25 as hf to {out}" in proc.stdout

    def weights(model):
        return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}

    from shardings import get_strategy

    with jax.set_mesh(get_strategy("dp").make_mesh(devices=jax.devices()[:1])):
        exported = weights(from_pretrained(out, "dp"))
    _, meta = read_meta(run_dir, None)
    settings = from_run_info(meta["run_info"], strategy="dp")
    for step in (25, 50):
        model, _, _ = eval_model.load_from_checkpoint(run_dir, meta["run_info"], settings, step)
        saved = weights(model)
        assert exported.keys() == saved.keys()
        # f32 written as f32 safetensors: bit for bit at step 25, and trained on by step 50.
        same = all(np.array_equal(exported[k], saved[k]) for k in saved)
        assert same == (step == 25), step


@pytest.mark.parametrize(
    "flags,line",
    [
        (
            ["--format=peft"],
            "error: --format=peft exports LoRA adapters, and this run has none (lora.rank "
            "unset); use --format=hf",
        ),
        (["--format=onnx"], "error: unknown --format='onnx'; valid: hf, peft"),
        (
            ["--format=hf", "--workdir=/no/such/run"],
            "error: --workdir=/no/such/run is not a directory; it names a train_main run (its "
            "checkpoints/)",
        ),
    ],
    ids=["peft_without_lora", "unknown_format", "missing_workdir"],
)
def test_export_main_bad_input_exits_2_with_one_line(run_dir, tmp_path, flags, line):
    out = tmp_path / "out"
    proc = _export_main(f"--workdir={run_dir}", f"--out={out}", *flags)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [line], proc.stderr[-2000:]
    assert not out.exists()
