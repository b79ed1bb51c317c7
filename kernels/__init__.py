"""Triton kernels for the executor's hot paths (with torch references in `kernels.reference`)."""
