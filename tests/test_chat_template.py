"""Chat templates rendered by nnx_zoo/data/chat.py equal transformers' apply_chat_template
(check 1 of issue 30): the published Llama 3, Qwen3 and Gemma 3 templates, multi-turn chats with and
without a system prompt, with and without the generation prompt; text and token ids."""

import pytest
from chat_fixtures import FAMILIES, chats, write_tokenizer_dir

from nnx_zoo.data.chat import ChatTemplate
from nnx_zoo.data.tokenizers import make_tokenizer

transformers = pytest.importorskip(
    "transformers", reason="the reference is transformers' apply_chat_template (extra [hf])"
)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, write_tokenizer_dir(str(path), request.param)


@pytest.mark.parametrize("with_system", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_text_and_ids_equal_transformers(family_dir, with_system, add_generation_prompt):
    family, path = family_dir
    reference = transformers.AutoTokenizer.from_pretrained(path)
    template = ChatTemplate.from_dir(path)
    tokenizer = make_tokenizer(path)
    for messages in chats(with_system):
        if add_generation_prompt and messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        want_text = reference.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        want_ids = reference.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
        )
        text = template.render(messages, add_generation_prompt=add_generation_prompt)
        assert text == want_text, family
        assert tokenizer.encode(text) == list(want_ids), family


def test_a_role_beyond_the_usual_four_renders_as_transformers_renders_it(tmp_path):
    """Llama 3.1's tool-output role `ipython` (and OpenAI's `developer`): the template, not a
    list of roles, decides; the Llama 3 template writes any role's header."""
    path = write_tokenizer_dir(str(tmp_path / "llama3"), "llama3")
    reference = transformers.AutoTokenizer.from_pretrained(path)
    messages = [
        {"role": "developer", "content": "Answer with a number."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "ipython", "content": '{"result": 5}'},
        {"role": "assistant", "content": "5"},
    ]
    text = ChatTemplate.from_dir(path).render(messages)
    assert text == reference.apply_chat_template(messages, tokenize=False)
    assert "<|start_header_id|>ipython<|end_header_id|>" in text
    want_ids = reference.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert make_tokenizer(path).encode(text) == list(want_ids)
