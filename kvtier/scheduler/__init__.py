"""Scheduler side of kvtier, torch-free: ``TierManager`` (``manager``) answers lookups across
the host pool and the tiers (``lookups``), plans loads in waves the host pool can hold
(``load_waves``) and stores, and takes the worker's reports back (``completions``), with the
ledger of why blocks miss (``ledger``) and the hit counters (``hits``)."""
