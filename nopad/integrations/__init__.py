"""Adapters that put nopad under existing trainers (``nopad.integrations.verl``)."""
