"""Example specdec drafter plugin (see README.md next to this package)."""
