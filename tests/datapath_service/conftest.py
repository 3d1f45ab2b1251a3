"""Fixtures shared by the datapath service tests."""

from tests.datapath_service.agent import agent, cp
from tests.datapath_service.pods import pods

__all__ = ["agent", "cp", "pods"]
