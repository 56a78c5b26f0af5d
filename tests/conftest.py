"""Root of the test tree: being a conftest outside a package, pytest puts tests/ on sys.path, so every test
folder imports the helpers they share from `tests/waiting.py` (`from waiting import wait_for`)."""
