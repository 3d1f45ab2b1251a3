"""The policy engine (pure) and the policy service around it."""
