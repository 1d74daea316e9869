"""Tenants, API keys, quotas and weighted fair dispatch in front of the engine."""
