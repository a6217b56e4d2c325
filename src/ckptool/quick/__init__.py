"""Metadata-only readers for `ckptool inspect`, without importing torch (see quick_inspect.py)."""
