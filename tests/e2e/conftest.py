import sys
from pathlib import Path

# The e2e tests share one helper that runs `l5d` in a clean environment (test_cli.l5d).
sys.path.insert(0, str(Path(__file__).resolve().parent))
