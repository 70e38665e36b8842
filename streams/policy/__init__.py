"""The policy layer, one module per idea; ``streams.policies`` is its public surface."""
