"""Chat templates rendered as vLLM renders them (fleetgate/chat_template.py), and which
requests the gateway can turn into the engine's exact prompt token ids (gateway/request/prefix_cache.py)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from fleetgate.chat_template import ChatTemplate, load_chat_template
from gateway.request.prefix_cache import PromptTokens
from gateway.request.requests import TokenCounter
from gateway.wire import Probe

CHATML = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
PARTS = (
    "{% for m in messages %}[{{ m['role'] }}]{% for p in m['content'] %}<{{ p['text'] }}>{% endfor %}{% endfor %}"
)


def test_chatml_with_its_default_system_and_generation_prompt() -> None:
    text = ChatTemplate(CHATML).render([{"role": "user", "content": "hi"}])
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_text_parts_are_joined_by_newlines_for_a_string_template() -> None:
    content = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    text = ChatTemplate(CHATML).render([{"role": "system", "content": content}], add_generation_prompt=False)
    assert text == "<|im_start|>system\na\nb<|im_end|>\n"


def test_a_template_that_loops_over_content_gets_parts_and_strings_become_one_part() -> None:
    t = ChatTemplate(PARTS)
    assert t.content_parts
    assert t.render([{"role": "user", "content": "x"},
                     {"role": "user", "content": [{"type": "text", "text": "y"}]}]) == "[user]<x>[user]<y>"


def test_jinja_features_transformers_gives_templates() -> None:
    source = ("{{ bos_token }}{% for m in messages %}{% generation %}{{ m['content'] | tojson }}{% endgeneration %}"
              "{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}{% endfor %}")
    t = ChatTemplate(source, {"bos_token": "<s>"})
    assert t.render([{"role": "user", "content": "é"}]) == '<s>"é"'
    with pytest.raises(Exception, match="no tools"):
        t.render([{"role": "tool", "content": "x"}])


def test_continue_final_message_leaves_the_last_message_open() -> None:
    text = ChatTemplate(CHATML).render(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}],
        add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nOnce upon")


def test_load_from_a_model_folder(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "default", "template": "{{ eos_token }}"}], "eos_token": {"content": "</s>"}}))
    t = load_chat_template(tmp_path)
    assert t is not None and t.render([]) == "</s>"
    (tmp_path / "chat_template.jinja").write_text("J")
    t = load_chat_template(tmp_path)
    assert t is not None and t.render([]) == "J"
    assert load_chat_template(tmp_path / "missing") is None


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> PromptTokens:
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("model")
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for m in messages %}"
                                                              "{{ m['content'] }} {% endfor %}"}))
    counter = TokenCounter(str(folder / "tokenizer.json"))
    return PromptTokens(counter, load_chat_template(folder))


EXACT = [
    ("a chat", {"messages": [{"role": "user", "content": "a b"}]}, [1, 2]),
    ("a chat with text parts", {"messages": [{"role": "user", "content": [{"type": "text", "text": "b"}]}]}, [2]),
    ("a completion's string", {"prompt": "b a"}, [2, 1]),
    ("a completion's token ids", {"prompt": [7, 8, 9]}, [7, 8, 9]),
    ("a chat that asks for no generation prompt", {"messages": [{"role": "user", "content": "a"}],
                                                   "add_generation_prompt": False}, [1]),
]
NOT_EXACT = [
    ("tools", {"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]}),
    ("its own template", {"messages": [{"role": "user", "content": "a"}], "chat_template": "x"}),
    ("template arguments", {"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": {"x": 1}}),
    ("an image", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]}),
    ("a tool call in the history", {"messages": [{"role": "assistant", "content": None, "tool_calls": []}]}),
    ("several prompts", {"prompt": ["a", "b"]}),
    ("the Responses API", {"input": "a"}),
]


@pytest.mark.parametrize(("why", "body", "ids"), EXACT, ids=[c[0] for c in EXACT])
def test_prompt_ids_the_gateway_can_know(tokens: PromptTokens, why: str, body: dict[str, object],
                                         ids: list[int]) -> None:
    probe = msgspec.json.decode(msgspec.json.encode({"model": "m", **body}), type=Probe)
    assert tokens.ids(probe) == ids


@pytest.mark.parametrize(("why", "body"), NOT_EXACT, ids=[c[0] for c in NOT_EXACT])
def test_prompt_ids_left_to_the_placement(tokens: PromptTokens, why: str, body: dict[str, object]) -> None:
    probe = msgspec.json.decode(msgspec.json.encode({"model": "m", **body}), type=Probe)
    assert tokens.ids(probe) is None
