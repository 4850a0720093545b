"""render_chat: the one rendering of a conversation that the HTTP side (tokenized) and the
offline Engine (text) share; its refusals name the field to blame."""

import pytest

from server.chat_template import ChatTemplateError, render_chat

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_it_is_transformers_rendering(default_tokenizer):
    text = render_chat(default_tokenizer, MESSAGES)
    assert text == default_tokenizer.apply_chat_template(MESSAGES, tokenize=False,
                                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")  # the assistant's turn is opened
    closed = render_chat(default_tokenizer, MESSAGES, add_generation_prompt=False)
    assert text.startswith(closed) and not closed.endswith("assistant\n")


@pytest.mark.parametrize("name", ["tools", "tokenize", "messages"])
def test_a_reserved_template_variable_is_refused(default_tokenizer, name):
    with pytest.raises(ChatTemplateError, match=name) as err:
        render_chat(default_tokenizer, MESSAGES, template_kwargs={name: 1})
    assert err.value.param == "chat_template_kwargs"


def test_a_template_that_raises_names_the_messages():
    class Strict:
        def apply_chat_template(self, *args, **kwargs):
            raise ValueError("roles must alternate")

    with pytest.raises(ChatTemplateError, match="roles must alternate") as err:
        render_chat(Strict(), MESSAGES)
    assert err.value.param == "messages"
