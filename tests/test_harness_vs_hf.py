"""Our lm-eval backend against the harness's own Hugging Face backend (`hf`, torch on CPU) on
the same tiny random Llama (saved with zoo.save_pretrained) and the example tasks: the same
requests, per-request log-likelihoods within 1e-4, the same accuracy, the same greedy
generations cut at the same stop sequences; for a BOS-adding and a BOS-less tokenizer.

Needs torch and transformers (CI: `pip install torch==2.13.0 "lm-eval[hf]==0.4.13"`).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from bench.fixtures import TASKS, write_tiny_llama

pytest.importorskip("lm_eval", reason="the [eval] extra (lm-eval) is not installed")
pytest.importorskip("torch", reason="the hf reference backend needs torch (CPU wheel)")
pytest.importorskip("transformers", reason="the hf reference backend needs transformers")

LIMIT = 12  # of 36 questions (48 multiple-choice requests), 8 paragraphs, 12 generations
# float32 on both sides; a multiple-choice answer sums ~3 token log-probs, a paragraph (in 64-id
# windows) ~200: torch and XLA differ by a few float32 ulps per token (~1e-6 of values ~10).
ATOL = 1e-4


def _evaluate(model, names, **kwargs):
    import lm_eval

    from nnx_zoo.evaluation.harness import task_manager

    return lm_eval.simple_evaluate(
        model=model,
        tasks=names,
        task_manager=task_manager(names, TASKS),
        limit=LIMIT,
        log_samples=True,
        **kwargs,
    )


@pytest.mark.parametrize(
    "style,names",
    [
        ("llama", ["zoo_facts", "zoo_prose", "zoo_facts_gen"]),
        # Without BOS the prefix token is EOS and nothing is added to contexts.
        ("gpt2", ["zoo_facts", "zoo_prose"]),
    ],
)
def test_same_answers_as_the_hf_backend(tmp_path, style, names):
    from nnx_zoo.data.tokenizers import make_tokenizer
    from nnx_zoo.evaluation.harness_lm import ZooLM
    from shardings import get_strategy
    from zoo import from_pretrained

    hf_dir = str(tmp_path / "tiny")
    write_tiny_llama(hf_dir, style, max_seq_len=64)
    # One device: test_harness.py shows every mesh gives the same numbers.
    strategy = get_strategy("dp")
    mesh = strategy.make_mesh(devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        model = from_pretrained(hf_dir, strategy)
    lm = ZooLM(model, mesh, make_tokenizer(hf_dir), rows=8)
    ours = _evaluate(lm, names, torch_random_seed=None)
    ref = _evaluate(
        "hf", names, model_args=f"pretrained={hf_dir},dtype=float32", device="cpu", batch_size=8
    )
    for task in names:
        a, b = ours["samples"][task], ref["samples"][task]
        assert [s["arguments"] for s in a] == [s["arguments"] for s in b], task
        got = [r[0] for s in a for r in s["resps"]]
        want = [r[0] for s in b for r in s["resps"]]
        if task == "zoo_facts_gen":
            assert got == want  # the same greedy text, cut where the hf backend cuts it
            assert any(w for w in want)
            continue
        got_ll = np.array([g[0] if isinstance(g, tuple) else g for g in got])
        want_ll = np.array([w[0] if isinstance(w, tuple) else w for w in want])
        np.testing.assert_allclose(got_ll, want_ll, rtol=0, atol=ATOL, err_msg=task)
        if task == "zoo_facts":
            assert [g[1] for g in got] == [w[1] for w in want]  # is-greedy flags
    for task, metrics in ref["results"].items():
        for key, value in metrics.items():
            if key.startswith("acc"):
                assert ours["results"][task][key] == value, (task, key)
