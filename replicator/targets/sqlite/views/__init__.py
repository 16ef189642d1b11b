"""Incremental views of a SQLite target: storage, capture of changes, refresh (store.py)."""
