"""The leak probe: :func:`check_isolation` runs a packed row twice, the second time with one
sequence's tokens changed, and reports any other sequence whose outputs moved (attention across a
boundary, as transformers' default ``use_cache`` causes); then runs each sequence alone and reports
any whose packed outputs differ from it (a window or chunk the model applies only through its
attention mask, dropped inside each sequence of a packed row)."""

from nopad.engines._leak import check_isolation

__all__ = ["check_isolation"]
