"""How the DSPy adapter lowers a request, without a server: copied_from fields as spans of the
input, the field-by-field checks of an OpenAI-target answer, and the max_tokens a chat-route
call gets (the lowering of ChatAdapter requests on the live server: test_dspy.py)."""

from __future__ import annotations

import pytest

dspy = pytest.importorskip("dspy")


def test_copied_from_lowers_to_a_span_of_the_input_field():
    """An output field described with copied_from("context") becomes a gen constrained to
    word spans of each context passage (ChatAdapter's own formatting of a list input)."""
    import dspy

    from sgl_adapters.dspy import copied_from
    from sgl_adapters.dspy.lowering import plan_fields

    class Grounded(dspy.Signature):
        """Answer with a phrase from the context."""

        context: list[str] = dspy.InputField()
        question: str = dspy.InputField()
        answer: str = dspy.OutputField(desc=copied_from("context", "a short phrase"))

    passages = ["Marconi sent signals in 1895.", 'Ships used "wireless" by 1900.']
    system, user = (m["content"] for m in dspy.ChatAdapter().format(
        Grounded, demos=[], inputs={"context": passages, "question": "When?"}))
    (field,) = plan_fields(system, user)
    assert field.kind == "span" and field.texts == tuple(passages)
    assert "ebnf" in field.expr(16).sampling.native()

def test_field_by_field_matching_of_one_answer():
    """The checks an OpenAI-target answer goes through (structured_outputs=False parses
    ChatAdapter markers; both paths validate each field)."""
    from sgl_adapters.dspy.lowering import OutputField
    from sgl_adapters.dspy.openai_target import (
        FieldMismatch,
        check_field,
        match_markers,
        output_schema,
    )

    fields = [OutputField("reasoning"), OutputField("answer", "select", ("yes", "no")),
              OutputField("confidence", "float"),
              OutputField("city", "json", schema={"type": "object", "required": ["name"]}),
              OutputField("quote", "span", texts=("Paris is the capital",))]
    text = ("[[ ## reasoning ## ]]\nbecause\n\n[[ ## answer ## ]]\nyes\n\n[[ ## confidence ## ]]"
            "\n0.9\n\n[[ ## city ## ]]\n{\"name\": \"Paris\"}\n\n[[ ## quote ## ]]\nthe capital"
            "\n\n[[ ## completed ## ]]")
    values = match_markers(text, fields)
    assert [check_field(f, values[f.name]) for f in fields] == [
        "because", "yes", "0.9", '{"name": "Paris"}', "the capital"]
    schema = output_schema(fields)
    assert list(schema["properties"]) == ["reasoning", "answer", "confidence", "city", "quote"]
    assert schema["properties"]["answer"] == {"type": "string", "enum": ["yes", "no"]}
    assert "pattern" in schema["properties"]["confidence"]
    for f, bad in [(fields[1], "maybe"), (fields[2], "high"), (fields[3], "{}"),
                   (fields[4], "London")]:
        with pytest.raises(FieldMismatch, match=f.name):
            check_field(f, bad)
    with pytest.raises(FieldMismatch, match="confidence"):
        match_markers(text.replace("[[ ## confidence ## ]]", ""), fields)

def test_requests_without_max_tokens_get_the_documented_default():
    """A chat-route call (lowering off, JSONAdapter, tools, backend="openai") that sets no
    max_tokens is bounded by DEFAULT_MAX_TOKENS, never the server's default of the rest of the
    context (a lowered call bounds each field by FIELD_MAX_TOKENS)."""
    from dspy.lm15 import Config, Message, Request

    from sgl_adapters.dspy.engine import DEFAULT_MAX_TOKENS, openai_kwargs

    request = Request(model="default", messages=(Message.user("hi"),))
    assert openai_kwargs(request, "default")["max_tokens"] == DEFAULT_MAX_TOKENS
    given = Request(model="default", messages=(Message.user("hi"),), config=Config(max_tokens=7))
    assert openai_kwargs(given, "default")["max_tokens"] == 7
