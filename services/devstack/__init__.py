"""The local development stack: `make run` and the dev node whose pods are network namespaces."""
