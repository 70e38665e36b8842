"""The Faust worker's environment settings: parsed into the PrepareConfig, and a bad value is
named in the error rather than reported as some staleness setting."""

from __future__ import annotations

import pytest

from config import Environment
from streams.settings import prepare_config_of


def test_settings_reach_the_prepare_config():
    cfg = prepare_config_of(Environment({"RLSTREAM_ALGO": "agro", "RLSTREAM_REORDER_TIMEOUT_MS": "250",
                                   "RLSTREAM_STALENESS_K": "3", "RLSTREAM_STALENESS_MS": "none",
                                   "RLSTREAM_STALENESS_MODE": "downweight", "RLSTREAM_POLICY_ID": "p7"}))
    assert (cfg.reorder_timeout_ms, cfg.max_versions, cfg.max_ms) == (250, 3, None)
    assert (cfg.staleness_mode, cfg.policy_id) == ("downweight", "p7")


@pytest.mark.parametrize("var", ["RLSTREAM_REORDER_TIMEOUT_MS", "RLSTREAM_STALENESS_K", "RLSTREAM_STALENESS_MS"])
def test_a_non_integer_names_its_variable(var):
    with pytest.raises(ValueError, match=f"{var} must be an integer, not 'soon'"):
        prepare_config_of(Environment({var: "soon"}))
