"""Machinery behind the public ``poptorch`` API. Nothing here is imported by
user programs directly."""
