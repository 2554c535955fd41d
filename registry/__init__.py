"""Adapter registry."""
