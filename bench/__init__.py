"""Benchmarks of gpusched's hot paths, run by `make bench` (`python -m bench`)."""
