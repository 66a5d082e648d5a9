"""Running one model over several processes: tensor-parallel ranks (parallel.py)."""
