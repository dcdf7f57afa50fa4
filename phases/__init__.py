"""Declarative capture and restore machines: states, ops, guards."""
