"""The watcher: Palisade's only reader of the Kubernetes API (or a manifest folder)."""
