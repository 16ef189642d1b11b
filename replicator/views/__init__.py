"""Incremental views: the analysis of a view's query, and the store protocol the targets implement."""
