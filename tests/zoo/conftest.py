import sys
from pathlib import Path

# The zoo is imported as the package `zoo` (tests use importlib mode): tests/ goes on the path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
