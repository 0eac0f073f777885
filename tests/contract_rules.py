"""The collector's OpenAPI rules that JSON Schema cannot state, as a filter on generated requests: shared by
tests/test_contract.py (schemathesis in-process) and tests/schemathesis_hooks.py (``schemathesis run``)."""

from __future__ import annotations

from typing import Any

from wattwatch.protocol import limits

# Rules JSON Schema cannot state, which the document states in words and as extension keywords:
# x-not-before (a time no earlier than another field of its object), x-equals-path (a body field that, when
# given, is the path's parameter), x-listed-in (an interval's device is one of its batch's) and
# x-lasts-at-most-s (a span's length). A case that breaks one is left out of generation; such requests get
# 422s naming the field (test_rules_the_schema_cannot_state_are_refused), and
# test_the_stated_rules_are_the_filtered_ones holds these lists equal to the document's.
NOT_BEFORE = {"t_end_s": "t_start_s", "ended_at_s": "started_at_s"}
EQUALS_PATH = {"job": "job_id"}
# x-listed-in: an interval's device is the key of one of the batch's devices.
LISTED_IN = {"device": "devices"}
# x-lasts-at-most-s: a span (an item of a "queries" list) ends at most this long after it starts.
SPAN_MAX_S = limits.MAX_SPAN_S


def keeps_stated_rules(value: Any, path_parameters: dict[str, Any]) -> bool:
    """Whether a generated body keeps every rule above, in every object it holds."""
    if isinstance(value, list):
        return all(keeps_stated_rules(v, path_parameters) for v in value)
    if not isinstance(value, dict):
        return True
    for end, start in NOT_BEFORE.items():
        end_s, start_s = value.get(end), value.get(start, 0.0)
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (end_s, start_s))
        if numbers and end_s < start_s:
            return False
    spans = value.get("queries")
    if isinstance(spans, list):
        for span in spans:
            times = [span.get(k) for k in ("t_start_s", "t_end_s")] if isinstance(span, dict) else []
            numbers = bool(times) and all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in times)
            if numbers and times[1] - times[0] > SPAN_MAX_S:
                return False
    intervals, devices = value.get("intervals"), value.get("devices", [])  # a batch without devices lists none
    if isinstance(intervals, list) and isinstance(devices, list):
        # Negative cases carry any JSON where a string goes: compared as strings only.
        keys = {d.get("key") for d in devices if isinstance(d, dict) and isinstance(d.get("key"), str)}
        named = [i.get("device") for i in intervals if isinstance(i, dict) and isinstance(i.get("device"), str)]
        if any(device not in keys for device in named):
            return False
    for field, parameter in EQUALS_PATH.items():
        given = value.get(field)
        if parameter in path_parameters and given is not None and given != path_parameters[parameter]:
            return False
    return all(keeps_stated_rules(v, path_parameters) for v in value.values())
