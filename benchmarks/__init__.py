"""Benchmarks: long or timing-dependent measurements that write JSON/CSV (not tests)."""
