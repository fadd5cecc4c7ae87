"""Scale-out on Ray Serve (``pip install quickdraft[ray]``): engine replicas behind one OpenAI-compatible endpoint.

``build_app`` returns the Ray Serve application; ``quickdraft serve MODEL --replicas N`` runs it (``cluster.py``).
See docs/DEPLOY.md.
"""
from quickdraft.serving.ray.app import ReplicaOptions, build_app

__all__ = ["ReplicaOptions", "build_app"]
