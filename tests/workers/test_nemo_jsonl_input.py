"""A bad input item is named by its place (responses_create_params.input[i], .content[j]) in the row's message."""
import pytest

from workers.nemo_jsonl import validate_row

OK = {"role": "user", "content": "hi"}


@pytest.mark.parametrize("items, message", [
    ([OK, 3], "responses_create_params.input[1] must be a message object, got number"),
    ([{"role": "user", "content": "x", "type": 1}], "responses_create_params.input[0].type must be a string"),
    ([OK, {"role": "user", "content": "x", "type": "blob"}], "responses_create_params.input[1] has unknown type 'blob'"),
    ([{"content": "x"}], "responses_create_params.input[0] has no 'role'"),
    ([{"role": "robot", "content": "x"}], "responses_create_params.input[0].role must be one of"),
    ([OK, OK, {"role": "user"}], "responses_create_params.input[2] has no 'content'"),
    ([{"role": "user", "content": []}], "responses_create_params.input[0].content is an empty list"),
    ([{"role": "user", "content": 5}], "responses_create_params.input[0].content must be a string or a list of parts"),
    ([OK, {"role": "user", "content": ["a", 7]}],
     "responses_create_params.input[1].content[1] must be an object with a text part, got number"),
    ([{"role": "user", "content": [{"type": 2}]}], "responses_create_params.input[0].content[0].type must be a string"),
    ([{"role": "user", "content": [{"type": "input_text"}]}],
     "responses_create_params.input[0].content[0] is a text part without a string 'text'"),
])
def test_a_bad_item_is_named_by_its_place(items, message):
    assert validate_row({"responses_create_params": {"input": items}}).startswith(message)


def test_good_items_pass():
    good = [OK, {"role": "assistant", "content": [{"type": "output_text", "text": "a"}, "b"]},
            {"type": "function_call_output", "call_id": "c", "output": "x"}]
    assert validate_row({"responses_create_params": {"input": good}}) is None
