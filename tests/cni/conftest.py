"""The CNI plugin's tests run against the agent's fixtures (an in-process agent and its control plane)."""

from tests.datapath_service.agent import agent, cp

__all__ = ["agent", "cp"]
