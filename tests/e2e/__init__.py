"""End-to-end tests against real servers (see conftest.py)."""
