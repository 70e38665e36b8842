"""Errors of the policy layer."""

from __future__ import annotations

import logging

from schemas.errors import InvalidEventError


log = logging.getLogger(__name__)


class PolicyLoadError(InvalidEventError, ValueError):
    """A PolicyVersion's weights cannot become a module (missing, unfetchable, wrong sha256,
    unknown or misfitting architecture). A CodecError: its record can be dead-lettered."""


class BlobWriteError(RuntimeError):
    """A claim-check write failed every try: the store is down. Not a CodecError (nothing is wrong
    with a record), so it is never dead-lettered; the learner that publishes fails and restarts."""
