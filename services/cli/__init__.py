"""The `palisade` command line."""
