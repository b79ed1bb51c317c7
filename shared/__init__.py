"""Code every jetserve service uses: wire schemas, configuration and helpers."""
