"""A rank that never finishes: the harness must stop it at its time limit."""

import time

print("started", flush=True)
time.sleep(3600)
