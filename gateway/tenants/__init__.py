"""API keys and teams: their records, store and live copy, authentication, quotas, usage, the per-client rate limit."""
