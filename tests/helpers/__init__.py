"""What several test modules share, one module per concern; the shared fixtures are in
tests/conftest.py. Test modules import from here, never from one another."""
