"""The connector's settings: every refusal names the key that fixes it (no engine needed)."""

from __future__ import annotations

import pytest

from handoff_vllm.connector import TESTED_VLLM, check_version
from handoff_vllm.settings import SettingsError, parse

GOOD = {"handoff": {"coordinator": "127.0.0.1:50051", "engine_id": "prefill-0"}}


def test_the_lease_nixl_falls_back_to_outlasts_the_deadline_and_the_delivery_timeout() -> None:
    settings = parse(GOOD, None)
    assert settings.kv_lease_s == 310
    parse(GOOD, 310)
    with pytest.raises(SettingsError, match=r'"kv_lease_duration"\] is 30: .* at least 310'):
        parse(GOOD, 30)


@pytest.mark.parametrize(
    ("extra", "names"),
    [
        ({}, '"handoff"'),
        ({"handoff": {"engine_id": "p"}}, '["coordinator"]'),
        ({"handoff": {"coordinator": "h:1"}}, '["engine_id"]'),
        ({"handoff": {**GOOD["handoff"], "colour": 1}}, "colour"),
        ({"handoff": {**GOOD["handoff"], "deadline_s": -1}}, '["deadline_s"]'),
        ({"handoff": {**GOOD["handoff"], "subscribe_timeout_s": 0}}, '["subscribe_timeout_s"]'),
        ({"handoff": {**GOOD["handoff"], "token_file": "/nonexistent"}}, '["token_file"]'),
    ],
)
def test_a_bad_setting_is_refused_naming_its_key(extra: dict[str, object], names: str) -> None:
    with pytest.raises(SettingsError) as error:
        parse(extra, None)
    assert names in str(error.value)


def test_tls_and_the_token_go_to_the_client_as_for_any_sdk_client() -> None:
    settings = parse({"handoff": {**GOOD["handoff"], "tls": True, "token": "t0k"}}, None)
    assert settings.client_options() == {"timeout_s": 10.0, "tls": True, "token": "t0k"}


def test_another_vllm_is_refused_unless_allowed() -> None:
    check_version(TESTED_VLLM, allow_other=False)
    with pytest.raises(RuntimeError, match="allow_other_vllm"):
        check_version("0.33.0", allow_other=False)
    check_version("0.33.0", allow_other=True)  # a warning only
