"""The record, the spool, the DuckDB store (all SQL lives here) and the parsers."""
