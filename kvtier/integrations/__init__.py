"""Adapters that plug kvtier's engine-neutral core into serving engines."""
