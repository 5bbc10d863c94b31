"""Servers mode's PostgreSQL backend: Django's, with a health check that costs no round trip (base.py)."""
