"""schemas.weights: a bytearray payload (a fetched claim-check blob) decodes in place to the same
tensors the copying safetensors loader gives; a broken one is an InvalidEventError either way."""

from __future__ import annotations

import pytest
import torch

from agents.networks import Policy
from schemas.errors import InvalidEventError
from schemas.weights import decode_weights, encode_weights


def test_a_bytearray_weight_payload_decodes_to_views_equal_to_the_copying_loader():
    torch.manual_seed(0)
    data = encode_weights(Policy(3, 2, hidden=(8,)).state_dict(), {"obs_dim": 3})
    (copied, arch), buf = decode_weights(data), bytearray(data)
    views, arch_v = decode_weights(buf)
    assert arch == arch_v and copied.keys() == views.keys()
    for k, t in copied.items():
        assert views[k].dtype == t.dtype and torch.equal(views[k], t)
    assert min(t.data_ptr() for t in views.values()) >= torch.frombuffer(buf, dtype=torch.uint8).data_ptr()


@pytest.mark.parametrize("payload", [bytes, bytearray])
def test_a_truncated_weight_payload_does_not_decode(payload):
    data = encode_weights(Policy(3, 2, hidden=(8,)).state_dict())
    with pytest.raises(InvalidEventError):
        decode_weights(payload(data[:-4]))
