"""`--kv-ttl` parsing and the traffic-class defaults."""

from __future__ import annotations

import pytest

from engine.kv_cache.store.ttl import TTLPolicy, default_class


def test_parse_the_default_and_operator_classes() -> None:
    policy = TTLPolicy.parse("agent=3d,chat=7d,batch=90m")
    assert policy.ttl("agent") == 3 * 86400 and policy.ttl("chat") == 7 * 86400
    assert policy.ttl("batch") == 5400 and policy.classes == ("agent", "batch", "chat")
    assert policy.describe() == "agent=3d,batch=90m,chat=7d"
    assert policy.min_extend("chat") == pytest.approx(0.01 * 7 * 86400)  # 1 % of the TTL
    assert TTLPolicy() == TTLPolicy.parse("agent=3d,chat=7d")


@pytest.mark.parametrize(
    "spec", ["agent=3d", "agent=3d,chat=7", "agent=3d,chat=7d,chat=1d", "agent=0d,chat=1d", "A=1d"]
)
def test_bad_specs_are_refused(spec: str) -> None:
    with pytest.raises(ValueError):
        TTLPolicy.parse(spec)


def test_default_class_follows_tools() -> None:
    assert default_class(True) == "agent" and default_class(False) == "chat"
