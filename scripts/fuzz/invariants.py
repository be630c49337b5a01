"""After a fuzzing pass: what the server stored is whole, read through its own API.

For every conversation of the fuzzing tenant: cursors run 1, 2, 3, ... with no
gap; `lastCursor` is the last event's; every message an event announces can be
read; every run has its `run.queued`. Exits non-zero naming what is wrong.
"""

import json
import sys
import urllib.request

URL, TOKEN = sys.argv[1], sys.argv[2]


def gql(query, variables=None):
    request = urllib.request.Request(
        URL,
        data=json.dumps({"query": query, "variables": variables or {}}).encode(),
        headers={"content-type": "application/json", "authorization": f"Bearer {TOKEN}"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        body = json.load(response)
    if body.get("errors"):
        raise SystemExit(f"invariant query failed: {body['errors']}")
    return body["data"]


def conversations():
    after = None
    while True:
        page = gql(
            "query($a: String) { conversations(first: 100, after: $a) { nodes { id } endCursor hasMore } }",
            {"a": after},
        )["conversations"]
        yield from (node["id"] for node in page["nodes"])
        if not page["hasMore"]:
            return
        after = page["endCursor"]


def events(conversation):
    after, out = None, []
    while True:
        page = gql(
            "query($c: ID!, $a: String) { events(conversationId: $c, after: $a, first: 1000) { endCursor hasMore events { cursor type runId ... on MessageEvent { messageId } } } }",
            {"c": conversation, "a": after},
        )["events"]
        out.extend(page["events"])
        if not page["hasMore"]:
            return out
        after = page["endCursor"]


problems, checked = [], 0
for conversation in conversations():
    checked += 1
    log = events(conversation)
    for position, event in enumerate(log, start=1):
        if int(event["cursor"]) != position:
            problems.append(f"{conversation}: event {position} has cursor {event['cursor']}")
            break
    view = gql(
        "query($c: ID!) { conversation(id: $c) { lastCursor messages(last: 100) { id } runs(last: 500) { id } } }",
        {"c": conversation},
    )["conversation"]
    expected_last = log[-1]["cursor"] if log else "0" * 16
    if view["lastCursor"] != expected_last:
        problems.append(f"{conversation}: lastCursor {view['lastCursor']}, last event {expected_last}")
    announced = {e["messageId"] for e in log if e["type"] == "message.created"}
    readable = {m["id"] for m in view["messages"]}
    if len(readable) < 100 and announced != readable:
        problems.append(f"{conversation}: messages {sorted(readable)} but events announce {sorted(announced)}")
    queued = {e["runId"] for e in log if e["type"] == "run.queued"}
    for run in view["runs"]:
        if run["id"] not in queued:
            problems.append(f"{conversation}: run {run['id']} has no run.queued")

print(f"invariants: {checked} conversations checked, {len(problems)} problems")
for problem in problems:
    print(f"  {problem}")
sys.exit(1 if problems else 0)
