"""The deploy tests share the container engine and the image `make image` builds."""

from tests.deploy.engine import engine, image

__all__ = ["engine", "image"]
