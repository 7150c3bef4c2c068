"""kill_mid_step.py's parts: shared (log lines, bounds, bitwise comparison),
trainer (one torchrun rank), driver (the launch), landing (the daemons' log
evidence), report (the checks) and processes (what a run leaves behind)."""
