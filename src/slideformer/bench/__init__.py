"""Benchmarks: one case per process (harness), and the table and plot made from their results (report)."""
