"""Request building and answer conversion (pure functions, no server)."""
import json

import pytest

from workers.engine.convert import (
    StreamAccumulator, build_request, flatten_prompt, input_messages, parse_sse_line, response_text,
    to_response_from_chat, to_response_from_completion, to_response_from_responses,
)


def test_string_input_becomes_one_user_message_and_params_are_mapped():
    path, body = build_request("chat_completions", {"input": "2+2?", "max_output_tokens": 64, "temperature": 0.5,
                                                    "top_p": 0.9, "metadata": {"a": 1}, "store": False}, "m", stream=False)
    assert path == "/v1/chat/completions"
    assert body == {"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 64, "temperature": 0.5,
                    "top_p": 0.9, "model": "m"}


def test_message_list_roles_instructions_and_streaming_options():
    params = {"instructions": "be brief", "input": [
        {"role": "system", "content": "sys"}, {"role": "developer", "content": "dev"},
        {"role": "user", "content": [{"type": "input_text", "text": "hello "}, {"type": "input_text", "text": "there"}]},
        {"type": "message", "role": "assistant", "content": "hi"}, {"role": "user", "content": "q"}]}
    _, body = build_request("chat_completions", params, "m", stream=True)
    assert [m["role"] for m in body["messages"]] == ["system", "system", "developer", "user", "assistant", "user"]
    assert body["messages"][3]["content"] == "hello there"
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


def test_tools_and_function_call_items_are_translated():
    params = {"input": [{"role": "user", "content": "weather?"},
                        {"type": "function_call", "call_id": "c1", "name": "get", "arguments": "{}"},
                        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}],
              "tools": [{"type": "function", "name": "get", "parameters": {"type": "object"}}]}
    _, body = build_request("chat_completions", params, "m", stream=False)
    assert body["tools"] == [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]
    assert body["messages"][1]["tool_calls"][0]["function"]["name"] == "get"
    assert body["messages"][2] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}


def test_bad_input_raises_value_error():
    with pytest.raises(ValueError):
        input_messages({"input": [{"role": "wizard", "content": "x"}]})
    with pytest.raises(ValueError):
        input_messages({"input": 42})


def test_completions_prompt_is_flattened():
    path, body = build_request("completions", {"input": "just this", "max_output_tokens": 5}, "m", stream=False)
    assert path == "/v1/completions" and body["prompt"] == "just this" and body["max_tokens"] == 5
    prompt = flatten_prompt([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert prompt == "System: S\n\nUser: U\n\nAssistant:"


def test_responses_flavor_passes_params_through():
    params = {"input": "x", "max_output_tokens": 7, "metadata": {"k": "v"}}
    path, body = build_request("responses", params, "m", stream=True)
    assert path == "/v1/responses"
    assert body == {"input": "x", "max_output_tokens": 7, "metadata": {"k": "v"}, "model": "m", "stream": True}


def test_unknown_flavor():
    with pytest.raises(ValueError, match="api_flavor"):
        build_request("grpc", {"input": "x"}, "m", False)


CHAT = {"id": "chatcmpl-1", "created": 5, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "The answer is \\boxed{4}"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18, "prompt_tokens_details": {"cached_tokens": 3}}}


def test_chat_to_response_shape():
    r = to_response_from_chat(CHAT)
    assert r["id"].startswith("resp") and r["status"] == "completed" and r["incomplete_details"] is None
    assert r["output"] == [{"id": "msg_chatcmpl-1", "type": "message", "role": "assistant", "status": "completed",
                            "content": [{"type": "output_text", "text": "The answer is \\boxed{4}", "annotations": []}]}]
    assert r["usage"] == {"input_tokens": 11, "input_tokens_details": {"cached_tokens": 3}, "output_tokens": 7,
                          "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 18}
    assert response_text(r) == "The answer is \\boxed{4}"


def test_chat_length_finish_is_incomplete_and_reasoning_is_kept():
    chat = json.loads(json.dumps(CHAT))
    chat["choices"][0]["finish_reason"] = "length"
    chat["choices"][0]["message"]["reasoning_content"] = "thinking"
    r = to_response_from_chat(chat)
    assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}
    assert r["output"][0] == {"id": "rs_chatcmpl-1", "type": "reasoning", "summary": [{"type": "summary_text", "text": "thinking"}]}
    assert response_text(r) == "The answer is \\boxed{4}"


def test_chat_without_choices_is_an_error():
    with pytest.raises(ValueError):
        to_response_from_chat({"id": "x", "choices": []})


def test_completion_to_response():
    r = to_response_from_completion({"id": "cmpl-1", "choices": [{"index": 0, "text": " 42", "finish_reason": "length"}],
                                     "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}})
    assert response_text(r) == " 42" and r["status"] == "incomplete"
    assert r["usage"]["output_tokens"] == 1 and r["usage"]["input_tokens"] == 2


def test_responses_answer_usage_normalized():
    r = to_response_from_responses({"id": "resp_1", "output": [{"type": "message", "role": "assistant",
                                    "content": [{"type": "output_text", "text": "hi"}]}],
                                    "usage": {"input_tokens": 4, "output_tokens": 2}})
    assert r["usage"]["total_tokens"] == 6 and r["usage"]["input_tokens_details"] == {"cached_tokens": 0}
    assert r["status"] == "completed" and response_text(r) == "hi"


def _sse(obj):
    return b"data: " + json.dumps(obj).encode()


def test_streamed_chat_chunks_accumulate():
    lines = [
        _sse({"id": "c9", "created": 1, "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}),
        b"", b": keep-alive",
        _sse({"id": "c9", "choices": [{"index": 0, "delta": {"content": "4"}, "finish_reason": None}]}),
        _sse({"id": "c9", "choices": [{"index": 0, "delta": {"content": "2"}, "finish_reason": "length"}]}),
        _sse({"id": "c9", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}),
        b"data: [DONE]",
    ]
    acc = StreamAccumulator("chat_completions")
    content_flags = []
    for line in lines:
        ev = parse_sse_line(line)
        if ev is False:
            break
        if ev is not None:
            content_flags.append(acc.feed(ev))
    assert content_flags == [False, True, True, False]
    r = acc.response()
    assert response_text(r) == "42" and r["status"] == "incomplete"
    assert r["usage"]["output_tokens"] == 2 and r["usage"]["input_tokens"] == 3


def test_streamed_completions_and_tool_calls():
    acc = StreamAccumulator("completions")
    acc.feed({"id": "x", "choices": [{"index": 0, "text": "a"}]})
    acc.feed({"id": "x", "choices": [{"index": 0, "text": "b", "finish_reason": "stop"}]})
    assert response_text(acc.response()) == "ab"
    acc = StreamAccumulator("chat_completions")
    acc.feed({"id": "y", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "t1", "function": {"name": "get", "arguments": "{\"a\""}}]}}]})
    acc.feed({"id": "y", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}, "finish_reason": "tool_calls"}]})
    items = acc.response()["output"]
    assert items == [{"id": "fc_t1", "type": "function_call", "call_id": "t1", "name": "get", "arguments": "{\"a\": 1}", "status": "completed"}]


def test_streamed_responses_events():
    acc = StreamAccumulator("responses")
    assert acc.feed({"type": "response.created", "response": {"id": "resp_1"}}) is False
    assert acc.feed({"type": "response.output_text.delta", "delta": "h"}) is True
    acc.feed({"type": "response.completed", "response": {"id": "resp_1", "output": [{"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "h"}]}], "usage": {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2}}})
    assert response_text(acc.response()) == "h"


def test_stream_error_event_raises():
    acc = StreamAccumulator("chat_completions")
    with pytest.raises(ValueError, match="boom"):
        acc.feed({"error": {"message": "boom"}})
    with pytest.raises(ValueError):
        StreamAccumulator("chat_completions").response()


def test_vllm_token_ids_are_kept_on_the_message_streamed_or_not():
    # vLLM with return_token_ids: the prompt's ids on the first chunk, each chunk's sampled ids (a byte piece may
    # add no text: "\ufffd" later, or nothing yet)
    acc = StreamAccumulator("chat_completions")
    for ev in ({"id": "c1", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
                "prompt_token_ids": [0, 3, 535]},
               {"id": "c1", "choices": [{"index": 0, "delta": {"content": " 58"}, "token_ids": [638]}]},
               {"id": "c1", "choices": [{"index": 0, "delta": {"content": ""}, "token_ids": [129]}]},
               {"id": "c1", "choices": [{"index": 0, "delta": {"content": "\ufffd"}, "token_ids": [161],
                                         "finish_reason": "length"}]}):
        acc.feed(ev)
    msg = acc.response()["output"][0]
    assert (msg["prompt_token_ids"], msg["generation_token_ids"]) == ([0, 3, 535], [638, 129, 161])
    chat = {"id": "c2", "prompt_token_ids": [0, 3], "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "7"}, "finish_reason": "stop", "token_ids": [55, 1]}]}
    msg = to_response_from_chat(chat)["output"][0]
    assert (msg["prompt_token_ids"], msg["generation_token_ids"]) == ([0, 3], [55, 1])
    # without them (any other server), the message is as before
    plain = to_response_from_chat({"id": "c3", "choices": [{"index": 0, "message": {"content": "7"}}]})["output"][0]
    assert "generation_token_ids" not in plain and "prompt_token_ids" not in plain
