"""The routes and the OpenAI-style error check the bad-input tests share (test_bad_inputs.py,
test_bad_request_params.py)."""

from __future__ import annotations

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
GEN = "/generate"
MSG = [{"role": "user", "content": "hi"}]


def check_error(resp, status, param=None, contains=None):
    """resp is an OpenAI-style error with this status; param (when given) is named in its
    ``param`` or message, contains (when given) is in its message."""
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert param in (err["param"] or "") or param in err["message"], err
    if contains is not None:
        assert contains in err["message"], err
