"""Errors of the policy layer."""

from __future__ import annotations

import logging


# Weights above DEFAULT_INLINE_LIMIT must go to the blob store (the event carries a claim check);
# above DEFAULT_CLAIM_CHECK_ABOVE they go there when one is configured: one tiny record fans out
# to every reader instead of the weights, and a process of many readers fetches them once.
from schemas.errors import InvalidEventError



log = logging.getLogger(__name__)


class PolicyLoadError(InvalidEventError, ValueError):
    """A PolicyVersion's weights cannot become a module (missing, unfetchable, wrong sha256,
    unknown or misfitting architecture). A CodecError: its record can be dead-lettered."""


class BlobWriteError(RuntimeError):
    """A claim-check write failed every try: the store is down. Not a CodecError (nothing is wrong
    with a record), so it is never dead-lettered; the learner that publishes fails and restarts."""
