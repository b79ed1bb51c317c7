"""Admission: the edge. Validates and tokenizes requests, enforces limits, and holds durable ones."""
