"""Measurements a run reports: memory peaks (host and device); trackers live beside them."""
