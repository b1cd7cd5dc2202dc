"""The Inductor setting fp8amp's compiled graphs need to compute what eager computes.

torch 2.11's Inductor, with ``loop_ordering_after_fusion`` on (its default), can fuse the
LayerNorm in front of an Fp8Linear into a kernel that writes the normalized rows in place in one
loop and reads them back in a later loop: the read sees stale values for part of the rows, so a
compiled model trains on wrong activations (docs/compile.md has the reproduction and the
evidence). fp8amp turns that reordering off once, when the first Fp8Linear is made; set
``FP8AMP_KEEP_INDUCTOR_CONFIG=1`` to keep Inductor's own setting.
"""

from __future__ import annotations

import os


__all__ = ["KEEP_INDUCTOR_CONFIG_ENV", "apply_inductor_config"]

KEEP_INDUCTOR_CONFIG_ENV = "FP8AMP_KEEP_INDUCTOR_CONFIG"

_applied = False


def apply_inductor_config() -> None:
    """Turns Inductor's ``loop_ordering_after_fusion`` off, once per process (idempotent)."""
    global _applied
    if _applied:
        return
    _applied = True
    if os.environ.get(KEEP_INDUCTOR_CONFIG_ENV) == "1":
        return
    from torch._inductor import config

    if hasattr(config, "loop_ordering_after_fusion"):
        config.loop_ordering_after_fusion = False
