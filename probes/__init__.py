"""Capture inside the serving process (operator checks, KV fingerprints, NVML, OTel)."""
