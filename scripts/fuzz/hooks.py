"""Schemathesis hooks for Tether's GraphQL API (loaded through SCHEMATHESIS_HOOKS).

The check: every answer is typed. No 5xx, a JSON body, and every GraphQL error
carries one of the contract's codes; `INTERNAL` (a server-side failure) and
anything that looks like a leaked internal (SQL, a panic, a stack trace) that
the request did not itself send fail.
"""

import json

import schemathesis
from hypothesis import strategies as st
from schemathesis.graphql import nodes

# The contract's codes a client may see for a refused or failed request.
TYPED = {
    "UNAUTHENTICATED", "NOT_FOUND", "BAD_USER_INPUT", "CONFLICT", "FORBIDDEN", "TIMEOUT", "UNAVAILABLE", "RATE_LIMITED",
}
LEAKS = ("panicked", "SELECT ", "INSERT ", "UPDATE ", "sqlx", "sea_orm", "stack backtrace", "src/")

# `JSON` is sent inline; any small JSON object will do as input.
schemathesis.graphql.scalar(
    "JSON",
    st.dictionaries(st.text(max_size=8), st.integers(), max_size=3).map(
        lambda value: nodes.String(json.dumps(value))
    ),
)


@schemathesis.check
def typed_errors_only(ctx, response, case):
    if response.status_code >= 500:
        raise AssertionError(f"HTTP {response.status_code}")
    try:
        body = json.loads(response.content)
    except ValueError as err:
        raise AssertionError(f"not JSON: {err}") from err
    if not isinstance(body, dict):
        raise AssertionError("the answer is not a JSON object")
    # A message may quote the request (a refused argument, say): only text
    # the request did not carry counts as a leak.
    sent = response.request.body or b""
    if isinstance(sent, bytes):
        sent = sent.decode("utf-8", "replace")
    for error in body.get("errors") or []:
        code = ((error or {}).get("extensions") or {}).get("code")
        if code not in TYPED:
            raise AssertionError(f"untyped error (code {code!r}): {error}")
        message = str(error.get("message", ""))
        for leak in LEAKS:
            if leak in message and leak not in sent:
                raise AssertionError(f"the message leaks {leak!r}: {message}")
    return None
