"""Chat / instruction data (issue 30): the per-token loss mask covers the answers only, travels
with packed rows, and the loss counts exactly those tokens.

The "only the prompts differ" check needs a model in which a prompt token can reach the
answers' losses only through the mask: with every attention output projection zeroed, each
position's logits depend on its own token alone, so the answers' NLL is the same whatever
the prompt's content, and any prompt token counted in the loss would change it."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from chat_fixtures import write_tokenizer_dir
from flax import nnx
from model_utils import one_device_mesh

from nnx_zoo import data
from nnx_zoo.data.chat import ChatTemplate, encode_record
from nnx_zoo.data.tokenizers import make_tokenizer
from nnx_zoo.training.loop import loss_sum
from shardings import get_strategy
from zoo import create_model, get_config

SEQ = 128


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_tokenizer_dir(str(tmp_path_factory.mktemp("llama3_tok")), "llama3")


@pytest.fixture(scope="module")
def model():
    mesh = one_device_mesh()
    with jax.set_mesh(mesh):
        m = create_model(get_config("tiny", vocab_size=384), get_strategy("dp"), rngs=nnx.Rngs(0))
    return m, mesh


def _chat(question: str, answer: str, second: str = "Sure.") -> dict:
    return {
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "And then?"},
            {"role": "assistant", "content": second},
        ]
    }


def _write(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return str(path)


def _batches(source, tok_dir, seq_len=SEQ, rows=4, fmt="chat"):
    tokenizer = make_tokenizer(tok_dir)
    return list(
        data.build_dataset(
            source,
            "all",
            tokenizer,
            seq_len,
            rows,
            shuffle=False,
            repeat=False,
            data_format=fmt,
            chat_template=ChatTemplate.from_dir(tok_dir),
        )
    )


_jit_loss_sum = nnx.jit(loss_sum)


def _alone(source, tok_dir, seq_len=SEQ):
    """One row per chat, each from index 0 then padding: the unpacked reference."""
    tokenizer, template = make_tokenizer(tok_dir), ChatTemplate.from_dir(tok_dir)
    rows = []
    with open(source, encoding="utf-8") as f:
        for line in f:
            out = encode_record(json.loads(line), tokenizer, template)
            n = len(out["tokens"])
            assert n <= seq_len
            row = {
                k: np.zeros(seq_len, np.int32)
                for k in ("tokens", "segment_ids", "positions", "loss_mask")
            }
            row["tokens"][:n], row["loss_mask"][:n] = out["tokens"], out["loss_mask"]
            row["segment_ids"][:n], row["positions"][:n] = 1, np.arange(n)
            rows.append(row)
    return [{k: np.stack([r[k] for r in rows]) for k in rows[0]}]


def _loss(model_mesh, batches, zero_attention=False):
    model, mesh = model_mesh
    if zero_attention:
        model = nnx.clone(model)
        o = model.blocks.attention.o.weight
        o.set_value(jnp.zeros_like(o[...]))
    total, count = 0.0, 0
    with jax.set_mesh(mesh):
        for b in batches:
            s, n = _jit_loss_sum(model, {k: jnp.asarray(v) for k, v in b.items()})
            total, count = total + float(s), count + int(n)
    return total / count, count


def test_mask_covers_the_assistant_turns_and_their_end_of_turn(tok_dir):
    tokenizer = make_tokenizer(tok_dir)
    out = encode_record(
        _chat("Hi?", "Paris is the capital."), tokenizer, ChatTemplate.from_dir(tok_dir)
    )
    trained = out["tokens"][out["loss_mask"] == 1].tolist()
    # decode drops EOS, which is Llama 3's end of turn <|eot_id|>: it ends both answers.
    assert tokenizer.decode(trained) == "Paris is the capital.Sure."
    eot = tokenizer.eos_id
    assert [i for i, t in enumerate(trained) if t == eot] == [trained.index(eot), len(trained) - 1]
    assert trained.count(eot) == 2
    assert out["tokens"].shape == out["loss_mask"].shape


def test_prompt_completion_masks_the_completion_and_eos(tok_dir):
    tokenizer = make_tokenizer(tok_dir)
    out = encode_record({"prompt": "2 + 3 =", "completion": " 5"}, tokenizer, None)
    assert out["tokens"][-1] == tokenizer.eos_id
    n = len(tokenizer.encode(" 5")) + 1
    assert out["loss_mask"].tolist() == [0] * (len(out["tokens"]) - n) + [1] * n


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_prompt_completion_strings_start_as_the_tokenizer_starts_a_text(tmp_path, style):
    """BOS first where the tokenizer adds one, as transformers' tokenizer(prompt) does (and
    TRL with a prompt that has no chat template); nothing for a BOS-less tokenizer."""
    from tokenizers import Tokenizer as HfTok

    from bench.fixtures import STYLES, write_tokenizer

    write_tokenizer(str(tmp_path), style)
    tokenizer = make_tokenizer(str(tmp_path))
    reference = HfTok.from_file(str(tmp_path / "tokenizer.json"))  # what transformers calls
    prompt, completion = "Question: Snow is usually", " white"
    out = encode_record({"prompt": prompt, "completion": completion}, tokenizer, None)
    want_prompt = reference.encode(prompt, add_special_tokens=True).ids
    n = len(want_prompt)
    assert out["tokens"][:n].tolist() == want_prompt
    assert (want_prompt[0] == reference.token_to_id("<s>")) == (STYLES[style]["bos"] is not None)
    assert out["tokens"][n:].tolist() == [*tokenizer.encode(completion), tokenizer.eos_id]
    assert out["loss_mask"].tolist() == [0] * n + [1] * (len(out["tokens"]) - n)
    # A prompt that already starts with BOS gets no second one.
    if style == "llama":
        again = encode_record({"prompt": "<s>" + prompt, "completion": completion}, tokenizer, None)
        assert again["tokens"].tolist() == out["tokens"].tolist()


def test_only_answers_differ_changes_the_loss(tmp_path, tok_dir, model):
    a = _write(tmp_path / "a.jsonl", [_chat("What is the capital?", "Paris is the capital.")])
    b = _write(tmp_path / "b.jsonl", [_chat("What is the capital?", "The sea is wide.")])
    assert (
        _loss(model, _batches(a, tok_dir), True)[0] != _loss(model, _batches(b, tok_dir), True)[0]
    )


def test_only_prompts_differ_keeps_the_loss(tmp_path, tok_dir, model):
    a = _write(tmp_path / "a.jsonl", [_chat("What is the capital of France?", "Paris.")])
    b = _write(tmp_path / "b.jsonl", [_chat("Write a poem about the sea!", "Paris.")])
    la, na = _loss(model, _batches(a, tok_dir), True)
    lb, nb = _loss(model, _batches(b, tok_dir), True)
    assert na == nb
    assert la == lb
    # Without the mask the prompts would count: the same model sees different losses.
    ta = _batches(a, tok_dir)
    tb = _batches(b, tok_dir)
    for batches in (ta, tb):
        for batch in batches:
            del batch["loss_mask"]
    assert _loss(model, ta, True)[0] != _loss(model, tb, True)[0]


def test_packed_rows_equal_unpacked(tmp_path, tok_dir, model):
    records = [_chat(f"Question {i}?", "Answer " * (1 + i), f"More {i}.") for i in range(6)]
    source = _write(tmp_path / "chats.jsonl", records)
    packed = _batches(source, tok_dir, seq_len=4 * SEQ, rows=2)
    alone = _alone(source, tok_dir)
    assert max(int(b["segment_ids"].max()) for b in packed) > 1  # several chats in a row
    (lp, np_), (la, na) = _loss(model, packed), _loss(model, alone)
    assert np_ == na
    # float32; the same sums in another order and attention over other row lengths.
    np.testing.assert_allclose(lp, la, rtol=1e-5)


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",  # reaching Python's object graph
        "{{ messages.append(1) }}",  # mutating what it was given (immutable sandbox)
        "{{ cycler.__init__.__globals__ }}",  # a module's globals through a builtin
    ],
)
def test_a_template_reaching_outside_its_sandbox_is_one_line(template):
    chat = ChatTemplate(template, source="evil/tokenizer_config.json")
    with pytest.raises(ValueError) as err:
        chat.render([{"role": "user", "content": "hi"}])
    message = str(err.value)
    assert "\n" not in message and message.startswith("evil/tokenizer_config.json: "), message
    assert "sandbox" in message or "raised" in message, message


def test_a_role_the_template_knows_trains_and_one_it_does_not_is_one_line(tmp_path, tok_dir):
    """The template judges roles: Llama 3's writes any role (Llama 3.1's `ipython` included,
    refused by a fixed list before); Qwen3's renders nothing for `ipython`, so it is refused,
    naming the roles it does render there."""
    from chat_fixtures import chat_template

    chat = {
        "messages": [
            {"role": "user", "content": "What is 2 + 3?"},
            {"role": "ipython", "content": '{"result": 5}'},
            {"role": "assistant", "content": "It is 5."},
        ]
    }
    tokenizer = make_tokenizer(tok_dir)
    out = encode_record(chat, tokenizer, ChatTemplate.from_dir(tok_dir))
    trained = out["tokens"][out["loss_mask"] == 1].tolist()
    assert tokenizer.decode(trained) == "It is 5."  # the tool output is context, not a target
    qwen = ChatTemplate(chat_template("qwen3"), {"eos_token": "<|im_end|>"}, source="qwen3")
    with pytest.raises(ValueError) as err:
        encode_record(chat, tokenizer, qwen)
    assert str(err.value) == (
        "qwen3: message 1 has role 'ipython', which the chat template does not know (it renders "
        "nothing of that message); roles it renders there: system, user, assistant, tool"
    )
    # A later record bringing a new role is encoded while the run is built, not in a worker.
    source = _write(tmp_path / "chats.jsonl", [_chat("Hi?", "Hello."), chat])
    with pytest.raises(ValueError, match="role 'ipython'"):
        data.build_dataset(
            source,
            "all",
            tokenizer,
            SEQ,
            2,
            shuffle=False,
            repeat=False,
            data_format="chat",
            chat_template=qwen,
        )
