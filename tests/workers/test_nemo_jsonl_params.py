"""The optional responses_create_params checks: the keys a row is checked for are the ones the check reads."""
import inspect
import re

import pytest

from workers import nemo_jsonl
from workers.nemo_jsonl import _CHECKED_PARAMS, check_optional_params


@pytest.mark.parametrize("key", sorted(_CHECKED_PARAMS))
def test_each_listed_key_is_checked(key):
    assert check_optional_params({"input": "hi", key: 2.5e9}) is not None  # a float: wrong for every one of them


def test_every_key_the_check_reads_is_listed():
    # the fast path skips rows with none of the listed keys: a key read below but left out of the list would
    # go unchecked whenever it comes alone
    source = inspect.getsource(nemo_jsonl.check_optional_params).split("return None", 1)[1]
    read = set(re.findall(r'"([a-z_]+)"', source)) - {"responses_create_params"}
    assert read and read == set(_CHECKED_PARAMS)


def test_rows_of_input_alone_pass_and_bad_values_still_fail():
    assert check_optional_params({"input": "hi"}) is None
    assert check_optional_params({"input": "hi", "temperature": 0.5, "extra_body": {}}) is None
    assert "temperature must be between 0 and 2" in check_optional_params({"input": "hi", "temperature": 3})
    row, _text, err = nemo_jsonl._parse_line(b'{"responses_create_params": {"input": "hi", "top_p": 1.5e0}}')
    assert row is None and "top_p must be between 0 and 1" in err
    row, _text, err = nemo_jsonl._parse_line(b'{"responses_create_params": {"input": "hi"}, "x": Infinity}')
    assert row is None and "not valid JSON" in err
