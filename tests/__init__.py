"""The test suite (`make test`); shared helpers live in *_fixtures.py and server_helpers.py."""
