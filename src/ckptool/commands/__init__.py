"""One module per CLI command; cli.py collects them. Helpers shared by commands live in common.py."""
