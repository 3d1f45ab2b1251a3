"""The policy service: the pure engine (:mod:`services.policy.engine`) and the I/O shell around it."""
