"""The four Unicron services, each runnable as `python -m services.<name>`."""
