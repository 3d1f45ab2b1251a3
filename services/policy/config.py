"""Policy service configuration."""

from __future__ import annotations

import dataclasses

from services.common.config import CommonConfig, setting


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicyConfig(CommonConfig):
    """Own the policy repository and send regeneration orders."""

    max_order_bytes: int = setting("Largest order published whole; larger ones are chunked.", default=512 * 1024)
