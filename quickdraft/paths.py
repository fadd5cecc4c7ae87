"""Where quickdraft keeps its caches (weights, assembled packaged models, built CPU kernels)."""
from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "QUICKDRAFT_CACHE_DIR"


def cache_root() -> Path:
    """Root of quickdraft's caches: ``$QUICKDRAFT_CACHE_DIR`` or the platform user cache dir."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("quickdraft"))
