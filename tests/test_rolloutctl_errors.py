"""rolloutctl shows an API error in words, not the raw JSON body."""
from rolloutctl.client import _describe


def test_api_error_bodies_read_as_text():
    assert _describe({"detail": "cannot pause a job that is completed", "code": "invalid_state"}) == \
        "cannot pause a job that is completed"
    assert _describe({"num_samples_in_parallel": ["Ensure this value is less than or equal to 512."],
                      "dataset": ["Invalid pk \"9\" - object does not exist."]}) == \
        'num_samples_in_parallel: Ensure this value is less than or equal to 512.; dataset: Invalid pk "9" - object does not exist.'
    assert _describe(["a", "b"]) == "a; b"
    assert _describe("<html>\n<title>502 Bad Gateway</title>\n</html>") == "502 Bad Gateway"
    assert "{" not in _describe({"detail": {"field": ["bad"]}})
