"""The cuinterpose coordinator engine."""
