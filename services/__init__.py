"""The jetserve services, one package each, runnable as `python -m services.<name>`."""
