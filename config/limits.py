"""Size limits and defaults that several layers must agree on."""

from __future__ import annotations

#: Largest record any rlstream topic takes (the topics' ``max.message.bytes``, the producers'
#: ``message.max.bytes``, the local broker's ``message.max.bytes``, the memory bus's limit).
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
#: Kafka bootstrap servers when none are given.
DEFAULT_BOOTSTRAP = "127.0.0.1:9092"
#: With a blob store, policy weights over this many bytes travel by claim check.
DEFAULT_CLAIM_CHECK_ABOVE = 1024 * 1024
#: Weights over this many bytes must travel by claim check (the event would be too large).
DEFAULT_INLINE_LIMIT = 4 * 1024 * 1024
