"""Worker processes: one per tensor-parallel rank, running the scheduler (rank 0) and the
model; started and watched by the API process (client.py, launch.py)."""
